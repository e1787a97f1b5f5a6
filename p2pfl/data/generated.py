"""Generated benchmarks: datasets built from a seeded generator, nothing downloaded.

``mnist1d`` is MNIST-1D (Greydanus, "Scaling down deep learning", 2020), built by the
reference generator (the ``mnist1d`` package's ``make_dataset``) from the ten 1-D digit
templates it ships. Only ``make_dataset`` is called: the package's ``get_dataset`` may
download a pickle, and is never used. Samples are float ``[n, 1, 40]``: one channel of
length 40, channels first like images, so a 1-D convolution (``cnn1d``) takes them as they
are and ``mlp``/``logreg`` flatten them.

``synthetic`` is Synthetic(α, β) of FedProx (Li et al., MLSys 2020, §5.1; the generator of
its code and of LEAF): 30 devices with power-law (lognormal) sample counts, 60-dimensional
features, 10 classes labelled by each device's own multinomial logistic model. Each device's
samples are its own (:attr:`p2pfl.data.datasets.Dataset.train_groups`): the natural
partition gives device k to peer k.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import torch

from p2pfl.core.errors import ConfigError
from p2pfl.data.datasets import DATASETS, Dataset

# --- MNIST-1D ---------------------------------------------------------------------------

MNIST1D_LENGTH = 40
"""Samples per signal (the generator's ``final_seq_length``)."""


@DATASETS.register("mnist1d")
def mnist1d(
    *, num_samples: int = 5000, train_split: float = 0.8, seed: int = 42, shuffle_seq: bool = False
) -> Dataset:
    """MNIST-1D (Greydanus 2020) from its reference generator: 10 classes of 1-D signals of
    length 40, ``[n, 1, 40]``, normalised by the generator (mean 0, std 1 over the set).

    Args:
        num_samples: signals generated, split evenly over the 10 classes (5000: the
            reference set, 4000 train / 1000 test).
        train_split: the first this fraction of the shuffled signals train, the rest test.
        seed: the generator's seed (42: the reference set); the run seed does not change
            the data, only its split among peers.
        shuffle_seq: permute the 40 positions of every signal the same way (the paper's
            "shuffled" variant, which defeats spatial priors).
    """
    if num_samples < 20:
        raise ConfigError("num_samples", f"must be >= 20 (two per class), got {num_samples}")
    if not 0 < train_split < 1:
        raise ConfigError("train_split", f"must be in (0, 1), got {train_split}")
    if not 0 <= seed < 2**32:
        raise ConfigError("seed", f"must be in [0, 2**32), got {seed}")
    n_train = int(num_samples // 10 * 10 * train_split)
    if not 1 <= n_train < num_samples // 10 * 10:
        raise ConfigError(
            "train_split", f"{train_split} of {num_samples} signals leaves a split empty"
        )
    arrays = _make_mnist1d(num_samples, train_split, seed, shuffle_seq)
    x, y, x_test, y_test = (t.clone() for t in arrays)  # the cache stays untouched
    return Dataset("mnist1d", x, y, x_test, y_test, num_classes=10)


@functools.cache
def _make_mnist1d(
    num_samples: int, train_split: float, seed: int, shuffle_seq: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The generator's arrays as tensors (cached: a set takes about 1 s to build). It seeds
    numpy's and Python's global generators, so both are restored afterwards."""
    from mnist1d.data import get_dataset_args, make_dataset  # numpy/scipy only; no download

    args = get_dataset_args()
    args.num_samples, args.train_split, args.seed = num_samples, train_split, seed
    args.shuffle_seq = shuffle_seq
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    out = []
    for xs, ys in ((data["x"], data["y"]), (data["x_test"], data["y_test"])):
        out.append(torch.from_numpy(np.asarray(xs, np.float32)[:, None, :]))
        out.append(torch.from_numpy(np.asarray(ys, np.int64)))
    return out[0], out[1], out[2], out[3]


# --- Synthetic(alpha, beta) ---------------------------------------------------------------

SYNTHETIC_DIM = 60
SYNTHETIC_CLASSES = 10


@DATASETS.register("synthetic")
def synthetic(
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    iid: bool = False,
    devices: int = 30,
    test_fraction: float = 0.1,
    seed: int = 0,
) -> Dataset:
    """Synthetic(α, β) of FedProx (Li et al. 2020, §5.1): device k draws u_k ~ N(0, α) and
    B_k ~ N(0, β); its model W_k ~ N(u_k, 1) (60×10), b_k ~ N(u_k, 1); its features
    x ~ N(v_k, Σ) with v_k ~ N(B_k, 1) and Σ = diag(j^−1.2); its labels argmax(softmax(W_k x
    + b_k)). Device k holds ⌊lognormal(4, 2)⌋ + 50 samples (a power law), shuffled, the
    last ``test_fraction`` of them held out: the test set is every device's held-out part.
    Each sample's device is its group (``partition: {name: natural}``).

    Args:
        alpha: how much the devices' models differ (≥ 0; 0: one model's mean).
        beta: how much the devices' feature distributions differ (≥ 0).
        iid: one W, b ~ N(0, 1) for every device and features x ~ N(0, Σ) on all (the
            paper's IID variant; ``alpha`` and ``beta`` are then unused).
        devices: how many devices (30 in the paper).
        test_fraction: the share of each device's samples held out for the test set.
        seed: the generator's seed; the run seed does not change the data.
    """
    if alpha < 0:
        raise ConfigError("alpha", f"must be >= 0, got {alpha}")
    if beta < 0:
        raise ConfigError("beta", f"must be >= 0, got {beta}")
    if devices < 1:
        raise ConfigError("devices", f"must be >= 1, got {devices}")
    if not 0 < test_fraction < 1:
        raise ConfigError("test_fraction", f"must be in (0, 1), got {test_fraction}")
    if not 0 <= seed < 2**32:
        raise ConfigError("seed", f"must be in [0, 2**32), got {seed}")
    arrays = _make_synthetic(
        float(alpha), float(beta), bool(iid), devices, float(test_fraction), seed
    )
    x, y, groups, x_test, y_test, test_groups = (t.clone() for t in arrays)  # cache untouched
    return Dataset(
        "synthetic",
        x,
        y,
        x_test,
        y_test,
        num_classes=SYNTHETIC_CLASSES,
        train_groups=groups,
        test_groups=test_groups,
        group_names=tuple(f"f_{k:05d}" for k in range(devices)),
    )


@functools.cache
def _make_synthetic(
    alpha: float, beta: float, iid: bool, devices: int, test_fraction: float, seed: int
) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E7]))
    sizes = rng.lognormal(4, 2, devices).astype(np.int64) + 50
    u = rng.normal(0, alpha, devices)  # the mean of device k's W and b
    b_mean = rng.normal(0, beta, devices)  # the mean of device k's feature means
    cov = np.power(np.arange(1, SYNTHETIC_DIM + 1, dtype=np.float64), -1.2)  # diagonal
    w_global = rng.normal(0, 1, (SYNTHETIC_DIM, SYNTHETIC_CLASSES))
    b_global = rng.normal(0, 1, SYNTHETIC_CLASSES)
    train: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    test: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for k in range(devices):
        if iid:
            mean_x, w, b = np.zeros(SYNTHETIC_DIM), w_global, b_global
        else:
            mean_x = rng.normal(b_mean[k], 1, SYNTHETIC_DIM)
            w = rng.normal(u[k], 1, (SYNTHETIC_DIM, SYNTHETIC_CLASSES))
            b = rng.normal(u[k], 1, SYNTHETIC_CLASSES)
        xs = mean_x + rng.standard_normal((int(sizes[k]), SYNTHETIC_DIM)) * np.sqrt(cov)
        ys = np.argmax(xs @ w + b, axis=1)  # softmax is monotone: its argmax is the logits'
        n_train = len(ys) - max(1, int(round(test_fraction * len(ys))))
        train.append((xs[:n_train], ys[:n_train], np.full(n_train, k)))
        test.append((xs[n_train:], ys[n_train:], np.full(len(ys) - n_train, k)))

    def cat(parts: list[Any], i: int, dtype: Any) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([p[i] for p in parts]).astype(dtype))

    return (
        cat(train, 0, np.float32),
        cat(train, 1, np.int64),
        cat(train, 2, np.int64),
        cat(test, 0, np.float32),
        cat(test, 1, np.int64),
        cat(test, 2, np.int64),
    )
