"""Partitioners: split a train set's indices among peers.

Each partitioner is ``fn(labels, num_peers, rng, *, <keys>) -> list[np.ndarray]``: one
shuffled index array per peer into the train set. Its keyword arguments are the YAML keys
of the ``partition:`` section; errors name keys relative to that section. ``rng`` is a
numpy ``Generator`` or a legacy ``RandomState`` (to reproduce reference codes' splits), so
partitioners call only the methods both have.

Domain shift (``domain``) splits labels IID; :func:`rotations` tells the caller which
rotation each peer's data gets, so partitioners stay plain index splitters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import Registry

Partitioner = Callable[..., list[np.ndarray]]
Rng = np.random.Generator | np.random.RandomState  # the legacy one reproduces reference splits
PARTITIONERS: Registry[Partitioner] = Registry("partition")


def _check_peers(labels: np.ndarray, num_peers: int) -> None:
    if num_peers < 1:
        raise ConfigError("count", f"need at least 1 peer, got {num_peers}")
    if num_peers > len(labels):
        raise ConfigError(
            "count",
            f"{num_peers} peers but the train set has only {len(labels)} samples; "
            "use fewer peers or more data",
        )


@PARTITIONERS.register("iid")
def iid(
    labels: np.ndarray,
    num_peers: int,
    rng: Rng,
    *,
    samples_per_peer: int | None = None,
    replace: bool = False,
) -> list[np.ndarray]:
    """Shuffle all samples and split them into near-equal parts; or give each peer
    ``samples_per_peer`` of them, disjoint or (``replace: true``) drawn independently per
    peer, so that more peers than samples each get data (100,000 peers from 60,000 images).

    With ``replace``, each peer's samples are a uniform draw of ``samples_per_peer``
    distinct samples from the whole train set, independent of every other peer's: sampling
    with replacement across peers, without within one, so a sample may be held by several
    peers. Shards are index arrays into the one dataset tensor; the images are gathered once
    for all peers, never per peer (:func:`p2pfl.data.federated.make_federated_data`).

    Args:
        samples_per_peer: each peer's number of samples, validation included (null: all the
            samples split near-evenly, as without the key).
        replace: draw each peer's samples independently of the others' (shards overlap; with
            ``samples_per_peer`` only, which may then exceed the train set divided by the peers).
    """
    if samples_per_peer is None:
        if replace:
            raise ConfigError("replace", "needs samples_per_peer: how many samples each peer draws")
        _check_peers(labels, num_peers)
        return np.array_split(rng.permutation(len(labels)), num_peers)
    n = len(labels)
    if num_peers < 1:
        raise ConfigError("count", f"need at least 1 peer, got {num_peers}")
    if not 1 <= samples_per_peer <= n:
        raise ConfigError(
            "samples_per_peer",
            f"must be between 1 and the {n} train samples, got {samples_per_peer}",
        )
    if not replace:
        if num_peers * samples_per_peer > n:
            raise ConfigError(
                "samples_per_peer",
                f"{num_peers} peers x {samples_per_peer} samples needs "
                f"{num_peers * samples_per_peer} but the train set has {n}; lower it or "
                "set replace: true (peers' samples drawn independently, shards overlap)",
            )
        perm = rng.permutation(n)[: num_peers * samples_per_peer]
        return list(perm.reshape(num_peers, samples_per_peer))
    return list(_distinct_rows(rng, n, num_peers, samples_per_peer))


def _distinct_rows(rng: Rng, n: int, rows: int, size: int) -> np.ndarray:
    """``rows`` independent uniform draws of ``size`` distinct integers below ``n``, as an
    int64 array ``[rows, size]``: every row drawn with replacement, and each row holding a
    repeat drawn again whole until none does (rejection: exactly uniform; a row repeats with
    probability about size²/2n, so a few passes; where size² > n, each row is the head of a
    permutation instead). ``rng.choice`` exists on both random
    streams (a legacy ``RandomState`` too) and draws ``rows × size`` at once."""
    if size * size > n:  # a repeat in most rows: a permutation's head per row instead
        return np.stack([rng.permutation(n)[:size] for _ in range(rows)]).astype(np.int64)
    out = np.asarray(rng.choice(n, size=(rows, size)), dtype=np.int64)
    redo = np.arange(rows)
    while True:
        block = np.sort(out[redo], axis=1)
        redo = redo[(block[:, 1:] == block[:, :-1]).any(axis=1)]
        if not len(redo):
            return out
        out[redo] = rng.choice(n, size=(len(redo), size))


@PARTITIONERS.register("dirichlet")
def dirichlet(
    labels: np.ndarray,
    num_peers: int,
    rng: Rng,
    *,
    alpha: float = 0.5,
    min_size: int = 10,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label skew as in the FedELMY code: per class draw p ~ Dir(alpha), give nothing more
    to peers already holding >= n/N samples, and cut the class's shuffled indices by
    cumsum(p). Redraw everything until each peer has >= ``min_size`` samples, at most
    ``max_tries`` times.

    If every eligible peer draws exactly 0 (possible for tiny alpha), the class is spread
    uniformly over the eligible peers instead of dividing by zero.

    Args:
        alpha: the Dirichlet concentration (> 0; smaller is more skewed).
        min_size: redraw until every peer has at least this many samples...
        max_tries: ...at most this many times, then a clear error (it never loops forever).
    """
    _check_skew(labels, num_peers, alpha, min_size, max_tries)
    n = len(labels)

    def draw() -> list[list[np.ndarray]]:
        parts: list[list[np.ndarray]] = [[] for _ in range(num_peers)]
        sizes = np.zeros(num_peers, dtype=np.int64)
        for k in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == k))
            p = _finite(rng.dirichlet(np.full(num_peers, alpha))) * (sizes < n / num_peers)
            if p.sum() == 0:
                p = (sizes < n / num_peers).astype(float)
            cuts = (np.cumsum(p / p.sum()) * len(idx)).astype(int)[:-1]
            for j, chunk in enumerate(np.split(idx, cuts)):
                parts[j].append(chunk)
                sizes[j] += len(chunk)
        return parts

    return _redraw(draw, rng, min_size, max_tries)


def _finite(p: np.ndarray) -> np.ndarray:
    """``p`` with non-finite entries set to 0: the legacy ``RandomState.dirichlet`` draws NaN
    for alpha below about 1e-3, which must fall into the all-zero fallback."""
    if not np.isfinite(p).all():
        p = np.where(np.isfinite(p), p, 0.0)
    return p


def _check_skew(
    labels: np.ndarray, num_peers: int, alpha: float, min_size: int, max_tries: int
) -> None:
    """Validate the keys the Dirichlet splitters share."""
    _check_peers(labels, num_peers)
    n = len(labels)
    if alpha <= 0:
        raise ConfigError("alpha", f"must be > 0, got {alpha}")
    if min_size < 0:
        raise ConfigError("min_size", f"must be >= 0, got {min_size}")
    if num_peers * min_size > n:
        raise ConfigError(
            "min_size",
            f"{num_peers} peers x min_size {min_size} needs {num_peers * min_size} samples "
            f"but the train set has {n}",
        )
    if max_tries < 1:
        raise ConfigError("max_tries", f"must be >= 1, got {max_tries}")


def _redraw(
    draw: Callable[[], list[list[np.ndarray]]],
    rng: Rng,
    min_size: int,
    max_tries: int,
) -> list[np.ndarray]:
    """Call ``draw`` until every peer gets >= ``min_size`` samples (at most ``max_tries``
    times); each peer's chunks are joined and shuffled. A clear error instead of a loop."""
    smallest = 0
    for _ in range(max_tries):
        parts = draw()
        smallest = min(sum(len(c) for c in part) for part in parts)
        if smallest >= min_size:
            return [rng.permutation(np.concatenate(part)) for part in parts]
    raise ConfigError(
        "min_size",
        f"could not give every peer >= {min_size} samples after {max_tries} tries "
        f"(smallest peer got {smallest}); lower min_size or raise alpha",
    )


@PARTITIONERS.register("peer_dirichlet")
def peer_dirichlet(
    labels: np.ndarray,
    num_peers: int,
    rng: Rng,
    *,
    alpha: float = 0.1,
    min_size: int = 10,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Label skew as in the FedFisher (and FedMA) code: each peer draws its class mix
    q_i ~ Dir(alpha·1_C), and each class's shuffled indices are cut among the peers in
    proportion to q_ik / Σ_j q_jk, so peer sizes come out unequal. Redraw everything until
    each peer has >= ``min_size`` samples, at most ``max_tries`` times.

    Args:
        alpha: the Dirichlet concentration of each peer's class mix (> 0; smaller is more skewed).
        min_size: redraw until every peer has at least this many samples...
        max_tries: ...at most this many times, then a clear error.
    """
    _check_skew(labels, num_peers, alpha, min_size, max_tries)
    classes = np.unique(labels)

    def draw() -> list[list[np.ndarray]]:
        q = _finite(rng.dirichlet(np.full(len(classes), alpha), size=num_peers))
        parts: list[list[np.ndarray]] = [[] for _ in range(num_peers)]
        for col, k in enumerate(classes):
            idx = rng.permutation(np.flatnonzero(labels == k))
            total = q[:, col].sum()  # 0 only if every draw underflows: split evenly
            share = q[:, col] / total if total > 0 else np.full(num_peers, 1 / num_peers)
            cuts = (np.cumsum(share) * len(idx)).astype(int)[:-1]
            for j, chunk in enumerate(np.split(idx, cuts)):
                parts[j].append(chunk)
        return parts

    return _redraw(draw, rng, min_size, max_tries)


@PARTITIONERS.register("shards")
def shards(
    labels: np.ndarray,
    num_peers: int,
    rng: Rng,
    *,
    classes_per_peer: int = 2,
) -> list[np.ndarray]:
    """Each peer holds ``classes_per_peer`` classes, taken round-robin from a shuffled class
    order, so every class is used (peers x classes_per_peer must reach the number of
    classes); each class's samples are split evenly among the peers holding it.

    Args:
        classes_per_peer: how many classes every peer holds, each class split evenly among its
            holders; peers × classes_per_peer must cover every class.
    """
    _check_peers(labels, num_peers)
    classes = np.unique(labels)
    if not 1 <= classes_per_peer <= len(classes):
        raise ConfigError(
            "classes_per_peer",
            f"must be between 1 and the {len(classes)} classes, got {classes_per_peer}",
        )
    if num_peers * classes_per_peer < len(classes):
        lost = len(classes) - num_peers * classes_per_peer
        raise ConfigError(
            "classes_per_peer",
            f"{num_peers} peers x {classes_per_peer} classes each leave {lost} of the "
            f"{len(classes)} classes unused; raise classes_per_peer or use more peers",
        )
    order = rng.permutation(classes)
    held = [
        order[(np.arange(classes_per_peer) + i * classes_per_peer) % len(classes)]
        for i in range(num_peers)
    ]
    parts: list[list[np.ndarray]] = [[] for _ in range(num_peers)]
    for k in classes:
        holders = [i for i in range(num_peers) if k in held[i]]
        idx = rng.permutation(np.flatnonzero(labels == k))
        for i, chunk in zip(holders, np.array_split(idx, max(len(holders), 1)), strict=False):
            parts[i].append(chunk)
    return [rng.permutation(np.concatenate(part)) for part in parts]


@PARTITIONERS.register("disjoint")
def disjoint(labels: np.ndarray, num_peers: int, rng: Rng) -> list[np.ndarray]:
    """Shuffle the classes into ``num_peers`` disjoint near-equal groups; each peer gets all
    samples of its group's classes."""
    _check_peers(labels, num_peers)
    classes = np.unique(labels)
    if num_peers > len(classes):
        raise ConfigError(
            "name",
            f"disjoint needs at most one peer per class: {num_peers} peers, {len(classes)} classes",
        )
    groups = np.array_split(rng.permutation(classes), num_peers)
    return [rng.permutation(np.flatnonzero(np.isin(labels, g))) for g in groups]


@PARTITIONERS.register("domain")
def domain(
    labels: np.ndarray,
    num_peers: int,
    rng: Rng,
    *,
    angles: tuple[float, ...] = (0.0, 15.0, 30.0, 45.0),
    samples_per_peer: int | None = None,
) -> list[np.ndarray]:
    """Domain shift: disjoint IID samples per peer (``samples_per_peer`` each, default
    n // num_peers); peer i's data is rotated by ``angles[i % len(angles)]`` degrees, which
    the caller applies using :func:`rotations`.

    Args:
        angles: peer i's images are rotated by ``angles[i % len(angles)]`` degrees (exact ``rot90``
            for multiples of 90).
        samples_per_peer: disjoint IID samples per peer (null: n // N).
    """
    _check_peers(labels, num_peers)
    if not angles:
        raise ConfigError("angles", "must list at least one angle")
    size = len(labels) // num_peers if samples_per_peer is None else samples_per_peer
    if size < 1 or size * num_peers > len(labels):
        raise ConfigError(
            "samples_per_peer",
            f"{num_peers} peers x {size} samples does not fit the {len(labels)} train samples",
        )
    perm = rng.permutation(len(labels))
    return [perm[i * size : (i + 1) * size] for i in range(num_peers)]


@PARTITIONERS.register("natural")
def natural(groups: np.ndarray, num_peers: int, rng: Rng) -> list[np.ndarray]:
    """The dataset's own groups as peers (Shakespeare's speaking roles, Synthetic's
    devices): peer i holds every train sample of the i-th largest group (most train
    samples; ties: the earlier group), so ``peers.count`` N takes the N largest and leaving
    it out takes them all. A partitioner whose first parameter is ``groups`` is handed the
    dataset's group of each train sample instead of its label; a dataset without groups
    cannot be split so (:func:`p2pfl.data.federated.make_federated_data`)."""
    sizes = np.bincount(groups) if len(groups) else np.zeros(0, np.int64)
    present = np.flatnonzero(sizes)
    if not 1 <= num_peers <= len(present):
        raise ConfigError(
            "count",
            f"{num_peers} peers but the dataset has {len(present)} natural groups; "
            f"ask for 1..{len(present)} (or leave peers.count out for all of them)",
        )
    order = present[np.argsort(-sizes[present], kind="stable")][:num_peers]
    return [rng.permutation(np.flatnonzero(groups == g)) for g in order]


def takes_groups(fn: Partitioner) -> bool:
    """Whether the partitioner ``fn`` splits by the dataset's natural groups (its first
    parameter is ``groups``) rather than by labels."""
    return next(iter(inspect.signature(fn).parameters), None) == "groups"


def rotations(name: str, num_peers: int, options: dict[str, Any]) -> list[float] | None:
    """Each peer's rotation in degrees for the ``domain`` partitioner (``options`` are its
    bound keys); None for partitioners without domain shift."""
    if name != "domain":
        return None
    angles = options["angles"]
    return [float(angles[i % len(angles)]) for i in range(num_peers)]
