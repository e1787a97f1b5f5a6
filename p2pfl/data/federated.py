"""Turn a dataset and a ``partition:`` section into per-peer train/validation data.

torchvision is imported only where used, to keep ``import p2pfl`` fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import bind_with_common
from p2pfl.data.datasets import Dataset
from p2pfl.data.partition import PARTITIONERS, rotations, takes_groups

_PARTITION_TAG = 2  # mixes into the run seed so the partition is its own random stream


@dataclass
class PeerData:
    """One peer's local data: a train split and a held-out validation split.

    The train split is the peer's own tensors ``source_x``/``source_y``, or with ``rows``
    (an int64 index) those rows of them: tensors that many peers share, the dataset's own
    where the peers' samples outnumber it (``iid`` with ``replace: true``:
    :func:`make_federated_data`), so a sample that k peers drew is held once, not k times.
    :attr:`train_x`/:attr:`train_y` are the split either way (gathered on each read where
    ``rows`` is set); batched training reads the rows through
    :class:`~p2pfl.learning.batched.DataPool`'s index instead.
    """

    source_x: torch.Tensor
    source_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    rows: torch.Tensor | None = None

    @property
    def train_x(self) -> torch.Tensor:
        return self.source_x if self.rows is None else self.source_x[self.rows]

    @train_x.setter
    def train_x(self, x: torch.Tensor) -> None:
        self._own()
        self.source_x = x

    @property
    def train_y(self) -> torch.Tensor:
        return self.source_y if self.rows is None else self.source_y[self.rows]

    @train_y.setter
    def train_y(self, y: torch.Tensor) -> None:
        self._own()
        self.source_y = y

    def _own(self) -> None:
        """Hold the train split as tensors of its own (before one of them is replaced)."""
        if self.rows is not None:
            self.source_x, self.source_y, self.rows = self.train_x, self.train_y, None

    @property
    def num_train(self) -> int:
        return len(self.source_y if self.rows is None else self.rows)


@dataclass
class FederatedData:
    """All peers' data plus the global test set."""

    peers: list[PeerData]
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    counts: np.ndarray  # [num_peers, num_classes]: train + val samples per peer and class


@dataclass(frozen=True)
class SplitOptions:
    """The ``partition`` keys every partitioner shares.

    Args:
        val_fraction: each peer holds out the first this fraction of its shuffled samples as its
            validation split (at least one; every peer keeps a training sample).
        seed: fix the split for every run seed: drawn with numpy's legacy ``RandomState(seed)``, as
            reference codes that call ``np.random.seed`` do (null: the run's seed).
    """

    val_fraction: float = 0.1
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError("val_fraction", f"must be in [0, 1), got {self.val_fraction}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ConfigError("seed", f"must be in [0, 2**32), got {self.seed}")

    def validation_size(self, n: int) -> int:
        """How many of a peer's ``n`` samples are held out: ``val_fraction`` of them, at
        least one when ``val_fraction`` > 0 and the peer has two or more."""
        if self.val_fraction == 0 or n < 2:
            return 0
        return max(1, int(self.val_fraction * n + 1e-9))

    def rng(self, run_seed: int) -> np.random.Generator | np.random.RandomState:
        """The split's random stream. By default it comes from the run seed, so seeds vary
        the split. With ``seed`` the split is fixed for every run seed and drawn with
        numpy's legacy ``RandomState(seed)``: the stream ``np.random.seed(seed)`` gives the
        FedFisher and FedMA reference codes, whose call order ``peer_dirichlet`` follows, so
        ``seed: 3`` is the FedFisher reference's Fashion-MNIST split."""
        if self.seed is not None:
            return np.random.RandomState(self.seed)
        return np.random.default_rng(np.random.SeedSequence([run_seed, _PARTITION_TAG]))


def make_federated_data(
    dataset: Dataset, partition_options: dict[str, Any], num_peers: int, seed: int
) -> FederatedData:
    """Split ``dataset``'s train set among ``num_peers`` peers as the YAML ``partition:``
    mapping (``name`` included) says.

    The split is seeded by ``seed`` (same seed, same split) unless the section fixes its own
    ``seed`` (:meth:`SplitOptions.rng`). Each peer's validation set is
    the first ``val_fraction`` of its shuffled indices, as in the FedELMY code. For domain
    shift each peer's data is rotated by its angle (``torch.rot90`` for multiples of 90°,
    exact), and the test set is the union of the test set under every peer angle (each
    distinct angle once). Error keys stay relative to the ``partition`` section, except
    ``count`` which refers to the number of peers.
    """
    if "name" not in partition_options:
        raise ConfigError("name", "missing required key")
    name = partition_options["name"]
    rest = {k: v for k, v in partition_options.items() if k != "name"}
    fn = PARTITIONERS.get(name)
    kwargs, common = bind_with_common(fn, SplitOptions, rest, skip=3)
    split = SplitOptions(**common)  # reject a bad val_fraction or seed before splitting

    labels = dataset.train_y.numpy()
    test_x, test_y = dataset.test_x, dataset.test_y
    if takes_groups(fn):
        if dataset.train_groups is None:
            raise ConfigError(
                "name",
                f"{name} makes each of the dataset's natural groups a peer, but "
                f"{dataset.name} has none (shakespeare has: its speaking roles)",
            )
        groups = dataset.train_groups.numpy()
        parts = fn(groups, num_peers, split.rng(seed), **kwargs)
        if dataset.test_groups is not None:  # the test windows of the groups in the run
            used = np.unique(np.concatenate([groups[p] for p in parts]))
            keep = torch.from_numpy(np.isin(dataset.test_groups.numpy(), used))
            test_x, test_y = test_x[keep], test_y[keep]
    else:
        parts = fn(labels, num_peers, split.rng(seed), **kwargs)
    angles = rotations(name, num_peers, kwargs) or [0.0] * num_peers
    if any(angles) and (len(dataset.input_shape) != 3 or dataset.tokens):
        raise ConfigError(
            "angles",
            f"{name} rotates images [C, H, W]; {dataset.name}'s samples have shape "
            f"{list(dataset.input_shape)}; use angles: [0] or another partition",
        )
    # the darkest value per channel, for rotated corners (a pass over every image: only if used)
    fill = dataset.train_x.amin(dim=(0, 2, 3)).tolist() if any(angles) else []

    for i, idx in enumerate(parts):
        if len(idx) == 0:
            raise ConfigError("", f"peer {i} got no training samples; use fewer peers")
    n_val = [split.validation_size(len(idx)) for idx in parts]
    for i, (idx, nv) in enumerate(zip(parts, n_val, strict=True)):
        if nv >= len(idx):
            raise ConfigError(
                "val_fraction",
                f"{split.val_fraction} leaves peer {i} ({len(idx)} samples) no training "
                "samples; lower val_fraction",
            )
    # every peer's training samples end to end in one tensor (batched training takes it as
    # it is: learning/batched.DataPool), its validation samples in another; where the
    # peers' training samples outnumber the dataset's (drawn with replacement), each peer
    # holds its rows of the dataset's tensors instead, which the peers share: the index
    # (8 bytes a sample) instead of the copies
    pairs = list(zip(parts, n_val, strict=True))
    train = torch.from_numpy(np.concatenate([idx[v:] for idx, v in pairs]))
    val = torch.from_numpy(np.concatenate([idx[:v] for idx, v in pairs]))
    shared = not any(angles) and len(train) > len(dataset.train_y)
    if shared:
        train_x, train_y = dataset.train_x, dataset.train_y
    else:
        train_x, train_y = dataset.train_x[train], dataset.train_y[train]
    val_x, val_y = dataset.train_x[val], dataset.train_y[val]
    peers = []
    t = v = 0
    for idx, nv, angle in zip(parts, n_val, angles, strict=True):
        nt = len(idx) - nv
        vx, vy = val_x[v : v + nv], val_y[v : v + nv]
        if shared:
            peers.append(PeerData(train_x, train_y, vx, vy, rows=train[t : t + nt]))
        else:
            x = train_x[t : t + nt]
            for part in (x, vx) if angle % 360 else ():
                if len(part):  # image by image: the same pixels as rotating them together
                    part.copy_(rotate(part, angle, fill))
            peers.append(PeerData(x, train_y[t : t + nt], vx, vy))
        t, v = t + nt, v + nv

    domains = list(dict.fromkeys(angles))
    counts = np.stack([np.bincount(labels[p], minlength=dataset.num_classes) for p in parts])
    return FederatedData(
        peers=peers,
        test_x=torch.cat([rotate(test_x, a, fill) for a in domains]),
        test_y=test_y.repeat(len(domains)),
        num_classes=dataset.num_classes,
        input_shape=dataset.input_shape,
        counts=counts,
    )


def rotate(x: torch.Tensor, angle: float, fill: list[float]) -> torch.Tensor:
    """Rotate images ``[n, C, H, W]`` counter-clockwise by ``angle`` degrees: exactly with
    ``rot90`` for square images and multiples of 90°, else bilinearly with corners set to
    ``fill``."""
    if angle % 360 == 0:
        return x
    if angle % 90 == 0 and x.shape[-1] == x.shape[-2]:
        return torch.rot90(x, int(angle // 90) % 4, dims=(2, 3)).contiguous()
    import torchvision.transforms.functional as TF

    return TF.rotate(x, angle, interpolation=TF.InterpolationMode.BILINEAR, fill=fill)
