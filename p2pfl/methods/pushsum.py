"""Stochastic gradient push, SGP (Assran, Loizou, Ballas, Rabbat, ICML 2019, Algorithm 1).

Push-sum makes gossip averaging correct on directed and changing graphs, where mixing
weights cannot be doubly stochastic: each peer i keeps a numerator x_i and a weight w_i
(w_i = 1 at the start) and trains the de-biased model z_i = x_i / w_i. Each round k:

1. x_i ← x_i + Δ_i, where Δ_i is the change local training makes to z_i (Alg. 1 line 3:
   the gradient step, evaluated at z_i, is applied to the numerator);
2. it keeps the share 1/(d_i + 1) of (x_i, w_i) and pushes one share each to its d_i
   out-neighbours of round k (Alg. 1 lines 4–5; column-stochastic mixing);
3. x_i, w_i ← the sums of its own share and the shares received (lines 6–7).

The sum of all weights stays N, so the z_i agree in the limit however the graph changes.
With ``network.graph: {every: round, kind: s_out, s: ...}`` each peer pushes to s random
peers each round (the time-varying directed graphs of §4). ``wait_s`` waits at most that long
for the round's shares; without it a peer waits for every in-neighbour. A lost share takes
its mass with it: the weights decay, and since a step on z changes x by Δ, z then moves by
Δ/w — push-sum needs links that deliver (we measured the collapse: docs/dynamics.md). A
share that comes after its round's receive (its sender was held up, or was online when its
receiver took it for offline) is added at the next receive, as SGP adds whatever has
arrived; only shares that come after the last round's receive are left.

``robust: true`` sends running sums instead of shares (Hadjicostis, Vaidya and
Domínguez-García, "Robust distributed average consensus via exchange of running sums", IEEE
TAC 61(6), 2016, for fixed digraphs): peer i adds each share it pushes to j to the running
totals (σ_ij, τ_ij) of all it has ever pushed to j, and sends those; j adds the difference
from the last totals it took from i (a running sum older than that one is already in it, and
is dropped). A lost share is then not lost for good: the next message on the same link that
gets through carries it. Only mass pushed on a link that never delivers again is lost.
Messages have the same size; without losses the models equal plain push-sum's to float
rounding (the running sums are float32 and grow with the rounds, so each difference rounds).
The cost is memory: a model for each out-link a peer has pushed on and each in-link it has
taken from, kept for the run; on a graph redrawn every round (``s_out``) up to 2·s more
models per peer and round, at most 2·(N − 1).

Only floating tensors are push-summed; other buffers stay the peer's own. The result
is the mean of the peers' z_i.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from p2pfl.core.errors import ConfigError
from p2pfl.methods.base import METHODS, NodeContext, Rounds
from p2pfl.methods.effects import (
    Behaviour,
    Evaluate,
    Finish,
    Neighbours,
    Now,
    Recv,
    Send,
    State,
    Train,
)
from p2pfl.network.plan import Plan, Transfer

LATE = 1 << 30
"""As many late shares as have come: a receive whose deadline has passed takes what is there."""


def scaled(state: State, factor: float) -> State:
    """``factor`` times the floating tensors of ``state`` (the others as they are)."""
    return {k: v * factor if v.is_floating_point() else v for k, v in state.items()}


def plus(a: State, b: State, sign: int = 1) -> State:
    """``a + sign·b`` on the floating tensors (the others as in ``a``)."""
    return {k: v.add(b[k], alpha=sign) if v.is_floating_point() else v for k, v in a.items()}


def weight_meta(w: float) -> dict[str, str]:
    """The push-sum weight as exact fixed-width text, so every share costs the same bytes."""
    return {"weight": f"{w:.17e}"}


@METHODS.register("pushsum")
@dataclass(kw_only=True, eq=False)
class PushSum(Rounds):
    """SGP: local training on x/w, then push-sum mixing along the round's out-edges.

    Args:
        wait_s: wait at most this long for the round's shares; a later share is added at the next
            round's receive (null: wait for all).
        robust: send running sums of the shares (Hadjicostis et al. 2016), so the next message that
            gets through on a link brings what was lost on it.
    """

    serverless = True
    unattackable = (
        "pushsum sends shares of its un-normalised model x (with weight w), not models: a "
        "model attack, defined on models and their updates, would corrupt the wrong quantity "
        "(data attacks and free_ride apply)"
    )

    wait_s: float | None = None
    robust: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.wait_s is not None and not self.wait_s > 0:
            raise ConfigError("wait_s", "must be > 0")

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        x, w = ctx.init_state(), 1.0
        pushed: dict[int, tuple[State, float]] = {}  # robust: (σ_ij, τ_ij) per out-neighbour j
        taken: dict[int, tuple[int, State, float]] = {}  # robust: k's last (round, σ, τ) added
        for r in range(1, self.rounds + 1):
            z = scaled(x, 1 / w)
            trained = (yield Train(z, r)).state
            x = {
                k: x[k] + (trained[k] - z[k]) if x[k].is_floating_point() else trained[k] for k in x
            }
            out = yield Neighbours(round=r)
            incoming = yield Neighbours(round=r, incoming=True)
            share = 1.0 / (len(out) + 1)
            x, w = scaled(x, share), w * share
            for j in out:
                sigma, tau = x, w
                if self.robust:  # the running totals of all pushed to j, this share included
                    if j in pushed:  # x first: its buffers ride along, as plain's do
                        sigma, tau = plus(x, pushed[j][0]), pushed[j][1] + w
                    pushed[j] = sigma, tau
                yield Send(j, "model", r, sigma, weight_meta(tau))
            deadline = None if self.wait_s is None else (yield Now()) + self.wait_s
            msgs = yield Recv(count=len(incoming), round=r, deadline=deadline)
            if deadline is not None:  # shares that came after their round's receive, or extra
                msgs += yield Recv(count=LATE, before=r + 1, deadline=(yield Now()))
            for m in msgs:
                dx, dw = m.tensors, float(m.meta["weight"])
                if self.robust:  # what k pushed since the running sums last taken from it
                    last = taken.get(m.src)
                    if last is not None and last[0] >= m.round:
                        continue  # an older running sum: already in the last one taken
                    taken[m.src] = (m.round, dx, dw)
                    if last is not None:
                        dx, dw = plus(dx, last[1], -1), dw - last[2]
                x, w = plus(x, dx), w + dw
            yield Evaluate(scaled(x, 1 / w), r)
        yield Finish(scaled(x, 1 / w))

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Round r: each peer pushes one share (a model and its weight) to each out-neighbour,
        Σ_i deg(i)·M per round on a static graph, as DFedAvgM."""
        topology = plan.topology
        for r in range(1, self.rounds + 1):
            for i in topology.peers:
                for j in topology.neighbours(i):
                    yield plan.send(i, j, "model", r, r, plan.state, weight_meta(0.5))
