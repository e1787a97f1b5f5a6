"""Robust aggregation: rules that combine model states when some of them may be lies.

A rule is a keyword-only dataclass registered in ``AGGREGATORS`` (its fields are the keys
of the ``aggregator:`` option of FedAvg, FedProx, DFedAvgM and DFedSAM, e.g.
``aggregator: {name: krum, m: 5}`` or just ``aggregator: median``). It is called as
``rule(center, others, weights, center_weight)``:

- ``center`` is the aggregating node's own reference: the server's current global model on
  a star, the peer's own model on a graph (where it takes part with ``center_weight`` > 0);
- ``others`` are the models that arrived, ``weights`` their mixing weights (sample counts on
  a star, Metropolis–Hastings weights on a graph). Only ``mean`` and the clipping rules use
  weights: an attacker could lie about its sample count, so the robust statistics do not.

Every robust rule works on the floating tensors; integer buffers (BatchNorm's batch counter)
are taken from ``center`` (``mean`` averages them, as FedAvg always has). On identical
inputs every rule returns that input, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from p2pfl.core.errors import ConfigError, TopologyMisfit
from p2pfl.core.options import Registry
from p2pfl.learning.state import State, average_states


class Aggregator:
    """Base class of a rule: ``__call__`` returns the aggregate of ``center`` (weighted
    ``center_weight``; 0 leaves it out) and ``others`` (weighted ``weights``)."""

    name: ClassVar[str]

    def __call__(
        self, center: State, others: Sequence[State], weights: Sequence[float], center_weight: float
    ) -> State:
        raise NotImplementedError

    def too_few(self, n: int) -> tuple[str, str] | None:
        """Why ``n`` models are too few for the rule as set: (its key, the need); None
        where they are enough (a rule with no need on n: always)."""
        return None

    def check_inputs(self, inputs: Mapping[str, int]) -> None:
        """Raise ``TopologyMisfit`` (key ``aggregator.KEY``) where the topology gives a node
        too few models to combine, every round: ``inputs`` maps each aggregating node (as
        a phrase, "the server", "peer 3") to that number, its own model included where it
        takes part. Fewer arriving at run time (churn, a deadline) is no error."""
        short: dict[str, tuple[int, tuple[str, str]]] = {}
        for node, n in inputs.items():
            if (why := self.too_few(n)) is not None:
                short[node] = (n, why)
        if short:
            key, need = next(iter(short.values()))[1]
            shown = [f"{node} gets {n}" for node, (n, _) in list(short.items())[:3]]
            more = f" (and {len(short) - 3} more)" if len(short) > 3 else ""
            raise TopologyMisfit(key, f"{need}; {', '.join(shown)}{more}").within("aggregator")


AGGREGATORS: Registry[type[Aggregator]] = Registry("aggregator")


def resolve_aggregator(option: str | dict) -> dict[str, Any]:
    """An ``aggregator:`` option (a name, or a mapping with ``name`` and the rule's keys)
    checked, the rule's own checks included, and written out as a mapping with every key of
    the rule, its defaults filled in (what ``config.yaml`` holds); a ``ConfigError`` keyed
    ``aggregator.KEY`` (an unknown name lists the registered ones)."""
    try:
        keys = AGGREGATORS.resolve(option)
        AGGREGATORS.get(keys["name"])(**{k: v for k, v in keys.items() if k != "name"})
    except ConfigError as e:  # the rule's own checks too
        raise e.within("aggregator") from None
    return keys


def parse_aggregator(option: str | dict) -> Aggregator:
    """The rule an ``aggregator:`` option names (checked as :func:`resolve_aggregator`)."""
    keys = resolve_aggregator(option)
    return AGGREGATORS.get(keys["name"])(**{k: v for k, v in keys.items() if k != "name"})


def _inputs(center: State, others: Sequence[State], center_weight: float) -> list[State]:
    return ([center] if center_weight > 0 else []) + list(others)


def _per_key(center: State, states: Sequence[State], fn: object) -> State:
    """Apply ``fn`` to the ``[n, ...]`` float64 stack of each floating tensor; integer
    tensors come from ``center``. The result is cast back to each tensor's dtype."""
    out: State = {}
    for k, v in center.items():
        if not v.is_floating_point():
            out[k] = v.clone()
            continue
        stack = torch.stack([s[k].to(torch.float64) for s in states])
        out[k] = fn(stack).to(v.dtype)  # type: ignore[operator]
    return out


@AGGREGATORS.register("mean")
@dataclass(kw_only=True, frozen=True)
class Mean(Aggregator):
    """The weighted mean (FedAvg's and gossip's own rule): no defence at all."""

    def __call__(
        self, center: State, others: Sequence[State], weights: Sequence[float], center_weight: float
    ) -> State:
        if center_weight > 0:
            return average_states([center, *others], [center_weight, *weights])
        return average_states(others, weights) if others else center


def median_of(stack: Tensor) -> Tensor:
    """numpy's median along the first axis: the middle value, or the mean of the two."""
    n = stack.shape[0]
    ordered = stack.sort(dim=0).values
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


@AGGREGATORS.register("median")
@dataclass(kw_only=True, frozen=True)
class Median(Aggregator):
    """Coordinate-wise median (Yin et al., ICML 2018, Def. 1); on a graph over the peer and
    its neighbours (He et al. 2022's gossip median)."""

    def __call__(
        self, center: State, others: Sequence[State], weights: Sequence[float], center_weight: float
    ) -> State:
        states = _inputs(center, others, center_weight)
        return _per_key(center, states, median_of) if states else center


@AGGREGATORS.register("trimmed_mean")
@dataclass(kw_only=True, frozen=True)
class TrimmedMean(Aggregator):
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018, Def. 2): drop the ``b`` largest
    and ``b`` smallest values of each coordinate, average the rest; where fewer than
    2b + 1 values arrived, b shrinks until one is left (as He et al.'s code does).

    Args:
        b: how many of the largest and of the smallest values of each coordinate are dropped.
    """

    b: int = 1

    def __post_init__(self) -> None:
        if self.b < 0:
            raise ConfigError("b", "must be >= 0")

    def too_few(self, n: int) -> tuple[str, str] | None:
        if n < 2 * self.b + 1:
            return "b", f"trimmed_mean with b={self.b} needs 2b + 1 = {2 * self.b + 1} models"
        return None

    def check_inputs(self, inputs: Mapping[str, int]) -> None:
        """Only where no node can trim ``b``: b shrinks where fewer models arrive, by
        design, but a b that holds nowhere is a mistake."""
        if all(self.too_few(n) is not None for n in inputs.values()):
            super().check_inputs(inputs)

    def __call__(
        self, center: State, others: Sequence[State], weights: Sequence[float], center_weight: float
    ) -> State:
        states = _inputs(center, others, center_weight)
        if not states:
            return center
        b = min(self.b, (len(states) - 1) // 2)

        def trimmed(stack: Tensor) -> Tensor:
            kept = stack.sort(dim=0).values[b : stack.shape[0] - b]
            return kept.sum(dim=0) / kept.shape[0]

        return _per_key(center, states, trimmed)


def _flat(state: State) -> Tensor:
    """The floating tensors of a state as one float64 vector (keys in the state's order)."""
    return torch.cat(
        [v.reshape(-1).to(torch.float64) for v in state.values() if v.is_floating_point()]
    )


@AGGREGATORS.register("krum")
@dataclass(kw_only=True, frozen=True)
class Krum(Aggregator):
    """Krum and Multi-Krum (Blanchard et al., NeurIPS 2017, §4): score each model by the
    summed squared distances to its n − f − 2 nearest others; the mean of the ``m`` best
    (m = 1: Krum, the single best). ``f`` is the number of attackers the rule tolerates;
    null takes the most Krum can, ⌊(n − 3)/2⌋ for n models. Ties go to the lower index.

    Args:
        f: the number of attackers the rule tolerates (null: the most Krum can, ⌊(n − 3)/2⌋ of n
            models).
        m: how many of the best-scored models are averaged (1: Krum; more: Multi-Krum).
    """

    f: int | None = None
    m: int = 1

    def __post_init__(self) -> None:
        if self.f is not None and self.f < 0:
            raise ConfigError("f", "must be >= 0")
        if self.m < 1:
            raise ConfigError("m", "must be >= 1")

    def tolerated(self, n: int) -> int:
        """f, or where it is null the most Krum tolerates among ``n`` models."""
        return max(0, (n - 3) // 2) if self.f is None else self.f

    def too_few(self, n: int) -> tuple[str, str] | None:
        """Krum needs n >= 2f + 3 (Blanchard et al., Prop. 1) and Multi-Krum m <= n − f
        (more would take in an attacker's model)."""
        f = self.tolerated(n)
        if self.f is not None and n < 2 * f + 3:
            return "f", f"krum with f={f} needs n >= 2f + 3 = {2 * f + 3} models"
        if self.m > max(1, n - f):
            return "m", f"multi-krum with m={self.m} needs n − f >= {self.m} models it can trust"
        return None

    def select(self, states: Sequence[State]) -> list[int]:
        """The indices of the ``m`` best-scored states, best first."""
        n = len(states)
        f = self.tolerated(n)
        nearest = max(1, n - f - 2)
        flat = torch.stack([_flat(s) for s in states])
        dist = torch.cdist(flat, flat).square()
        scores = []
        for i in range(n):
            others = torch.cat([dist[i, :i], dist[i, i + 1 :]])
            scores.append(float(others.sort().values[:nearest].sum()) if n > 1 else 0.0)
        order = sorted(range(n), key=lambda i: (scores[i], i))
        return order[: min(self.m, n)]

    def __call__(
        self, center: State, others: Sequence[State], weights: Sequence[float], center_weight: float
    ) -> State:
        states = _inputs(center, others, center_weight)
        if not states:
            return center
        chosen = [states[i] for i in self.select(states)]
        out = chosen[0] if len(chosen) == 1 else average_states(chosen)
        return {k: v if v.is_floating_point() else center[k].clone() for k, v in out.items()}


def clip_step(
    center: State, others: Sequence[State], weights: Sequence[float], center_weight: float,
    tau: float,
) -> State:  # fmt: skip
    """v + Σ_j w_j/W · clip(x_j − v, τ) with W = center_weight + Σ w_j: a clipped move from
    ``center`` towards each model (clip scales a difference, as one vector, to norm ≤ τ)."""
    total = center_weight + sum(weights)
    diffs = [_flat(s) - _flat(center) for s in others]
    move = torch.zeros_like(_flat(center))
    for w, d in zip(weights, diffs, strict=True):
        norm = float(d.norm())
        scale = 1.0 if norm <= tau else tau / norm
        move.add_(d, alpha=w / total * scale)
    out: State = {}
    offset = 0
    for k, v in center.items():
        if not v.is_floating_point():
            out[k] = v.clone()
            continue
        n = v.numel()
        out[k] = (v.to(torch.float64) + move[offset : offset + n].view(v.shape)).to(v.dtype)
        offset += n
    return out


def _distances(center: State, others: Sequence[State]) -> list[float]:
    c = _flat(center)
    return [float((_flat(s) - c).norm()) for s in others]


@dataclass(kw_only=True, frozen=True)
class Clipping(Aggregator):
    """A rule that clips each model's pull to a radius ``tau`` (null: the rule's adaptive
    choice)."""

    tau: float | None = None

    def __post_init__(self) -> None:
        if self.tau is not None and not self.tau > 0:
            raise ConfigError("tau", "must be > 0")


@AGGREGATORS.register("centered_clipping")
@dataclass(kw_only=True, frozen=True)
class CenteredClipping(Clipping):
    """Centered clipping (Karimireddy, He, Jaggi, ICML 2021, Alg. 2): start at the server's
    model v and repeat ``iterations`` times v ← v + 1/n Σ clip(x_j − v, τ). ``tau`` null
    (our default, since the paper's τ is set for gradients, not model updates): the median
    distance of the arrived models from v, so no minority can drag v further than a typical
    honest update.

    Args:
        tau: the clipping radius τ (null: the median distance of the arrived models from v).
        iterations: how many clipping steps from the server's model.
    """

    iterations: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.iterations < 1:
            raise ConfigError("iterations", "must be >= 1")

    def __call__(
        self, center: State, others: Sequence[State], weights: Sequence[float], center_weight: float
    ) -> State:
        if not others:
            return center
        uniform = [1.0] * len(others)
        v = center
        for _ in range(self.iterations):
            tau = self.tau
            if tau is None:
                tau = float(median_of(torch.tensor(_distances(v, others), dtype=torch.float64)))
            v = clip_step(v, others, uniform, 0.0, tau)
        return v


@AGGREGATORS.register("clipped_gossip")
@dataclass(kw_only=True, frozen=True)
class ClippedGossip(Clipping):
    """ClippedGossip (He, Karimireddy, Jaggi 2022, Alg. 1, "self-centered clipping"):
    x_i ← x_i + Σ_j w_ij clip(x_j − x_i, τ_i) with the gossip weights w_ij. ``tau`` null:
    the authors' adaptive rule (their code): τ_i is the second-largest neighbour distance,
    so the farthest neighbour is clipped to it (the only one with one neighbour).

    Args:
        tau: the clipping radius τ (null: the authors' adaptive rule, the second-largest neighbour
            distance).
    """

    def __call__(
        self, center: State, others: Sequence[State], weights: Sequence[float], center_weight: float
    ) -> State:
        if not others:
            return center
        tau = self.tau
        if tau is None:
            distances = sorted(_distances(center, others))
            tau = distances[-2] if len(distances) >= 2 else distances[-1]
        return clip_step(center, others, weights, center_weight, tau)
