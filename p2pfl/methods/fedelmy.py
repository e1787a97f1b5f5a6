"""FedELMY (Wang et al., ACM MM 2024): one-shot sequential FL with a diverse local model pool.

Paper §3 (Alg. 1), App. B (Alg. 2) and App. C (Alg. 3); choices in docs/fedelmy.md.
Peers form FedSeq's chain. The first peer warms the shared init
up for ``warmup_epochs``; every peer then grows a pool from the model m0 it received: model
j starts from the uniform mean of the pool so far and trains on

    L = CE − α·d1/a + β·d2/a,

d1 = mean distance to the pool's models (plus the frozen start, as in the official code),
d2 = distance to m0, a = a power-of-ten scale that keeps the distances about an order of
magnitude below the loss (App. A). Each model keeps its best-validation epoch when
``train.select`` is ``best_val``. The peer forwards the mean of its S+1 models, so one
cycle moves N−1 models and ``cycles: T`` moves T·N−1 (Alg. 2, warm-up once). The last
peer's pool mean is the output. ``variant: parallel`` is Alg. 3: on a complete mesh every
peer warms up and grows its own pool from the shared init, sends its pool mean to all
others, and all end with the mean of the N pool means (N(N−1) models).

Distances use the trainable parameters only; averaging covers the whole state, BatchNorm
buffers included. The last pool's pairwise L2 distances (the paper's Fig. 10) are saved as
the ``pool_distances`` artifact.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn

from p2pfl.core.errors import ConfigError
from p2pfl.data.federated import PeerData
from p2pfl.learning.state import average_states, tensor_sum
from p2pfl.methods.base import METHODS, NodeContext
from p2pfl.methods.effects import (
    Artifact,
    Behaviour,
    Compute,
    Evaluate,
    Finish,
    Log,
    Recv,
    Report,
    Send,
    State,
    Steps,
    Train,
)
from p2pfl.methods.fedseq import FedSeq
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import Topology

Dist = Literal["l2sq", "l2", "l1", "cosine"]
L2_EPS = 1e-12
"""Added under the square root of ``l2``: its gradient is NaN where θ equals the anchor,
which is the first step of every pool's first model (docs/fedelmy.md)."""
MIN_CE = 1e-8
"""``log_scale`` clamps the loss here: a batch's CE can be exactly 0 in float32
(docs/fedelmy.md)."""


def distance(theta: Sequence[Tensor], anchor: Sequence[Tensor], kind: Dist) -> Tensor:
    """dist(θ, a) between two parameter lists, as a scalar tensor (Eqs. 7–8, Fig. 9).

    ``l2sq`` Σ(θ−a)² (the official code), ``l2`` sqrt(Σ(θ−a)² + 1e-12) (the paper's
    Eqs. 7–8), ``l1`` Σ|θ−a|, ``cosine`` 1 − ⟨θ, a⟩ / (‖θ‖·‖a‖).
    """
    if kind == "cosine":
        dot = tensor_sum((t * a).sum() for t, a in zip(theta, anchor, strict=True))
        norm_t = torch.sqrt(tensor_sum(t.pow(2).sum() for t in theta))
        norm_a = torch.sqrt(tensor_sum(a.pow(2).sum() for a in anchor))
        return 1 - dot / (norm_t * norm_a).clamp_min(L2_EPS)
    diffs = [t - a for t, a in zip(theta, anchor, strict=True)]
    if kind == "l1":
        return tensor_sum(d.abs().sum() for d in diffs)
    squared = tensor_sum(d.pow(2).sum() for d in diffs)
    return squared if kind == "l2sq" else torch.sqrt(squared + L2_EPS)


def log_scale(ce: float, d: float) -> float:
    """The official code's ``scale_to_order_of_magnitude``: a power of ten a ≥ 1 such that
    d/a sits about one order of magnitude below ``ce`` (the paper's App. A); 1 when d is 0.

    ``ce`` is clamped at 1e-8 so a zero loss cannot crash ``log10``; a loss or distance
    that is not finite also gives 1 (the trainer skips that step).
    """
    if not (math.isfinite(ce) and math.isfinite(d)) or d <= 0:
        return 1.0
    oa = math.floor(math.log10(max(ce, MIN_CE)))
    ob = math.floor(math.log10(d))
    return 10.0 ** (ob - oa + 1) if ob > oa - 1 else 1.0


class PoolRegularizer:
    """The FedELMY terms −α·d1/a1 + β·d2/a2 for one pool model (Eqs. 7–9, App. A).

    ``anchors`` are the states d1 averages over, ``m0`` the received model. With
    ``scale_key: d2`` (the code) one a = log_scale(ce, d2) divides both terms; ``separate``
    (the paper's wording) scales each by its own magnitude; ``none`` uses a = 1. For
    ``l2sq``, d1 uses the centroid identity mean_t ‖θ−a_t‖² = ‖θ−c‖² + mean_t ‖a_t−c‖²:
    one distance per batch instead of one per anchor. Keeps per-batch means of ce, d1, d2
    and the scale for logging.
    """

    def __init__(
        self,
        anchors: list[State],
        m0: State,
        alpha: float,
        beta: float,
        dist: Dist,
        scale_key: Literal["d2", "separate", "none"],
    ) -> None:
        self.anchors, self.m0 = anchors, m0
        self.alpha, self.beta, self.dist, self.scale_key = alpha, beta, dist, scale_key
        self.sums: dict[str, float] = defaultdict(float)
        self.batches = 0
        self._on_device: tuple[list[Tensor], list[list[Tensor]], float] | None = None

    def _prepare(
        self, names: list[str], device: torch.device
    ) -> tuple[list[Tensor], list[list[Tensor]], float]:
        """m0's parameters, the anchors' parameters (for l2sq: their centroid alone) and
        the constant mean_t ‖a_t − c‖² (0 unless l2sq), on ``device``."""
        m0 = [self.m0[n].to(device) for n in names]
        if self.dist != "l2sq":
            return m0, [[a[n].to(device) for n in names] for a in self.anchors], 0.0
        anchors64 = [[a[n].to(device, torch.float64) for n in names] for a in self.anchors]
        centroid = [torch.stack(ts).mean(0) for ts in zip(*anchors64, strict=True)]
        spread = sum(distance(a, centroid, "l2sq").item() for a in anchors64) / len(anchors64)
        return m0, [[c.to(t.dtype) for c, t in zip(centroid, m0, strict=True)]], spread

    def __call__(self, module: nn.Module, ce: Tensor) -> Tensor:
        theta = list(module.parameters())
        if self._on_device is None:
            names = [n for n, _ in module.named_parameters()]
            self._on_device = self._prepare(names, theta[0].device)
        m0, anchors, spread = self._on_device
        values = {"ce": ce.item()}
        total = ce.new_zeros(())
        if self.beta or self.scale_key == "d2":
            d2 = distance(theta, m0, self.dist)
            values["d2"] = d2.item()
        if self.alpha:
            if self.dist == "l2sq":
                d1 = distance(theta, anchors[0], "l2sq") + spread
            else:
                d1 = tensor_sum(distance(theta, a, self.dist) for a in anchors) / len(anchors)
            values["d1"] = d1.item()
            values["scale_d1"] = self._scale(values, "d1")
            total = total - self.alpha * d1 / values["scale_d1"]
        if self.beta:
            values["scale_d2"] = self._scale(values, "d2")
            total = total + self.beta * d2 / values["scale_d2"]
        for key, value in values.items():
            self.sums[key] += value
        self.batches += 1
        return total

    def _scale(self, values: dict[str, float], term: str) -> float:
        """The divisor a of ``term`` (d1 or d2) for this batch."""
        if self.scale_key == "none":
            return 1.0
        return log_scale(values["ce"], values["d2" if self.scale_key == "d2" else term])

    def means(self) -> dict[str, float]:
        """Per-batch means of ce, d1, d2 and the scales over the whole training."""
        return {k: v / max(self.batches, 1) for k, v in self.sums.items()}


def pool_distances(pool: list[State], module: nn.Module, data: PeerData, device: object) -> Tensor:
    """Pairwise L2 distances between the pool's models over the trainable parameters
    (float64), as in the paper's Fig. 10. A ``Compute`` function: ``module`` names the
    parameters."""
    names = [n for n, _ in module.named_parameters()]
    flat = torch.stack([torch.cat([s[n].flatten().double() for n in names]) for s in pool])
    return torch.cdist(flat, flat)


@METHODS.register("fedelmy")
@dataclass(kw_only=True, eq=False)
class FedELMY(FedSeq):
    """FedSeq's chain, where each peer trains a diverse pool and forwards its mean.

    Args:
        pool_size: S, models trained per peer; the pool ends with S + 1 (0: forward the received
            model).
        alpha: α, the weight of −d1 (diversity from the pool's models); α > β makes the loss
            unbounded below (a warning is printed).
        beta: β, the weight of +d2 (proximity to the received model m0).
        warmup_epochs: E_w, the first peer's plain cross-entropy warm-up epochs (0: none).
        variant: ``sequential`` (the paper's Algs. 1-2, on a ring) or ``parallel`` (Alg. 3, a
            complete mesh, one round).
        dist: the diversity measure of d1 and d2: ``l2sq`` (the official code's), ``l2``, ``l1`` or
            ``cosine``.
        scale_key: the log-scale normalisation: ``d2`` (one factor for both terms, as the code),
            ``separate`` (one per term) or ``none``.
        send: what a peer forwards: ``mean`` of its pool (the method) or its ``last`` model.
        anchor_start: include the frozen start of model j among d1's anchors (the official code).
    """

    pool_size: int = 3
    alpha: float = 1.0
    beta: float = 1.0
    warmup_epochs: int = 5
    variant: Literal["sequential", "parallel"] = "sequential"
    dist: Dist = "l2sq"
    scale_key: Literal["d2", "separate", "none"] = "d2"
    send: Literal["mean", "last"] = "mean"
    anchor_start: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("pool_size", "warmup_epochs", "alpha", "beta"):
            if getattr(self, key) < 0:
                raise ConfigError(key, "must be >= 0")
        if self.variant == "parallel" and self.cycles > 1:
            raise ConfigError("cycles", "the parallel variant (Alg. 3) runs one round only")
        if self.alpha > self.beta:
            warnings.warn(
                f"fedelmy: alpha {self.alpha} > beta {self.beta} makes the loss unbounded below "
                "(docs/fedelmy.md); non-finite steps are skipped",
                stacklevel=3,
            )

    def check(self, topology: Topology, seed: int) -> None:
        if self.variant == "sequential":
            return super().check(topology, seed)
        peers = topology.peers
        if topology.server is not None or any(
            not topology.graph.has_edge(a, b) for a in peers for b in peers if a < b
        ):
            raise ConfigError("kind", "fedelmy variant parallel (Alg. 3) needs a complete mesh")

    def total_rounds(self, num_peers: int) -> int:
        return 1 if self.variant == "parallel" else super().total_rounds(num_peers)

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        return self.parallel(ctx) if self.variant == "parallel" else super().behaviour(ctx)

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Sequential: FedSeq's chain, (T·N − 1)·M. Parallel (Alg. 3): every peer sends its
        pool mean to every other peer in one phase, N(N − 1)·M."""
        if self.variant == "sequential":
            yield from super().transfers(plan)
            return
        peers = plan.topology.peers
        for i in peers:
            for j in peers:
                if j != i:
                    yield plan.send(i, j, "model", 1, 1, plan.state)

    def warmup(self, state: State, round: int) -> Train:
        """Plain-CE training of the start model for ``warmup_epochs`` (Alg. 1, line 1)."""
        return Train(state, round, tag="warmup", overrides={"epochs": self.warmup_epochs})

    def turn(self, ctx: NodeContext, received: State, hop: int) -> Steps[State]:
        """Warm up (first hop only), grow the pool, forward its mean (or its last model)."""
        if hop == 1 and self.warmup_epochs:
            received = (yield self.warmup(received, hop)).state
        pool = yield from self.grow_pool(received, hop)
        yield from self.describe(pool, hop, last=hop == self.total_rounds(len(ctx.peers)))
        return pool[-1] if self.send == "last" else average_states(pool)

    def parallel(self, ctx: NodeContext) -> Behaviour:
        """Alg. 3: own warm-up and pool, pool means to everyone, mean of all N."""
        state = ctx.init_state()
        if self.warmup_epochs:
            state = (yield self.warmup(state, 1)).state
        pool = yield from self.grow_pool(state, 1)
        yield from self.describe(pool, 1, last=ctx.node == ctx.peers[-1])
        means = {ctx.node: pool[-1] if self.send == "last" else average_states(pool)}
        others = [p for p in ctx.peers if p != ctx.node]
        for p in others:
            yield Send(p, "model", 1, means[ctx.node])
        for msg in (yield Recv(count=len(others), round=1)):
            means[msg.src] = msg.tensors
        # Summed in peer order on every peer, so all of them hold the same bits.
        final = average_states([means[p] for p in sorted(means)])
        yield Evaluate(final, 1)
        yield Finish(final)

    def grow_pool(self, m0: State, round: int) -> Steps[list[State]]:
        """Train ``pool_size`` models, each from the mean of the pool so far; return the
        pool [m0, m1, ..., mS]."""
        pool = [m0]
        for j in range(1, self.pool_size + 1):
            start = average_states(pool)
            reg = self.regularizer(pool + [start] if self.anchor_start else pool, m0)
            # Model 1 draws FedSeq's batch order, so S = 1 with α = β = 0 is FedSeq (tested).
            result = yield Train(start, round, tag="" if j == 1 else f"pool{j}", regularizer=reg)
            pool.append(result.state)
            stats = {"val_accuracy": result.val_accuracy, "skipped_steps": result.skipped_steps}
            for key, value in (stats | (reg.means() if reg else {})).items():
                yield Log(round, f"pool{j}_{key}", float(value))
        return pool

    def regularizer(self, anchors: list[State], m0: State) -> PoolRegularizer | None:
        """The diversity terms for one model, or None when α = β = 0 (plain CE)."""
        if not (self.alpha or self.beta):
            return None
        return PoolRegularizer(anchors, m0, self.alpha, self.beta, self.dist, self.scale_key)

    def describe(self, pool: list[State], round: int, last: bool) -> Behaviour:
        """Log the pool's mean pairwise L2 distance. For the run's last pool, save the matrix
        and score its last model alone (baseline ``last_model``: what averaging adds)."""
        matrix = yield Compute(pool[0], partial(pool_distances, pool), passes=0.0)
        k = len(pool)
        if k > 1:
            yield Log(round, "pool_spread", float(matrix.sum() / (k * (k - 1))))
        if last:
            title = f"Pairwise L2 distances in the last pool ({k} models)"
            yield Artifact("pool_distances", matrix, title)
            yield Report("last_model", pool[-1])
