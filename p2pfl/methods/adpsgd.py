"""AD-PSGD (Lian, Zhang, Zhang, Liu, "Asynchronous decentralized parallel stochastic gradient
descent", ICML 2018, Algorithm 1), on any serverless graph with active and passive peers.

Each iteration k, every peer i (Algorithm 1):

1. computes a local update on its model as it is now, ``x̂_i`` (possibly stale by the time it
   is applied: the peer keeps averaging meanwhile) — here ``Train``, whose change
   ``Δ_i = trained − x̂_i`` stands for −γ·∇F_i(x̂_i);
2. averages atomically with one random neighbour j: x_i, x_j ← (x_i + x_j) / 2;
3. applies its update: x_i ← x_i + Δ_i.

The atomic pairwise average is the protocol of §4: peers are split in two groups (even ids
are active, odd ids passive; on a bipartite graph such as an even ring every edge joins the
two), so two averagings never wait on each other. Every peer computes continuously; averaging
is served beside the computation, as the paper's separate thread does (``Serve``). An active
peer sends its model to a passive neighbour drawn at random among those it believes online,
trains meanwhile, then takes the partner's reply and averages with it. A passive peer never
waits for a request: it trains iteration after iteration, and answers each request at its
arrival, even mid-training, with its model as it is then and averages with it (its training
goes on from the copy it started from, applied afterwards to the averaged model); after its
own iterations it goes on answering until each active neighbour says it is done. A reply
that does not come within ``reply_timeout_s`` of the request (lost, or the partner offline)
is not waited for: the active peer applies its update alone. The result is the mean of the
peers' final models.

Earlier, in p2pfl 0.1.0, a passive peer waited up to ``reply_timeout_s`` for a request
before each iteration and answered only between its own iterations, so a slow passive peer
held back its active partners and the run's time was set by the timeout; that protocol is
gone (no use of it remained that the paper's does not serve better).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import numpy_rng
from p2pfl.learning.state import average_states
from p2pfl.methods.base import METHODS, NodeContext, Rounds
from p2pfl.methods.effects import (
    Behaviour,
    Evaluate,
    Finish,
    Neighbours,
    Now,
    Recv,
    Send,
    Serve,
    State,
    Train,
)
from p2pfl.network.message import Message
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import Topology


def is_active(node: int) -> bool:
    """The bipartite split of §4: even peers start the averagings, odd peers answer."""
    return node % 2 == 0


def passive_of(topology: Topology, node: int) -> list[int]:
    """The passive neighbours an active ``node`` may average with (none for a passive one)."""
    return [j for j in topology.neighbours(node) if not is_active(j)] if is_active(node) else []


def applied(x: State, stale: State, trained: State) -> State:
    """x + (trained − stale): a local update computed on ``stale``, applied to ``x``."""
    return {
        k: x[k] + (trained[k] - stale[k]) if x[k].is_floating_point() else trained[k] for k in x
    }


@dataclass
class Model:
    """A peer's model, shared by its worker (the behaviour) and its averaging thread."""

    x: State


@METHODS.register("adpsgd")
@dataclass(kw_only=True, eq=False)
class ADPSGD(Rounds):
    """Asynchronous pairwise averaging between active and passive peers, with stale updates.

    Args:
        reply_timeout_s: how long an active peer waits for its partner's reply, and a passive peer
            for a request.
    """

    serverless = True

    reply_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.reply_timeout_s > 0:
            raise ConfigError("reply_timeout_s", "must be > 0")

    def check(self, topology: Topology, seed: int) -> None:
        super().check(topology, seed)
        for i in topology.peers:
            if is_active(i) and not any(not is_active(j) for j in topology.neighbours(i)):
                raise ConfigError(
                    "kind", f"active (even) peer {i} has no passive (odd) neighbour to average with"
                )

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        return self.active(ctx) if is_active(ctx.node) else self.passive(ctx)

    def active(self, ctx: NodeContext) -> Behaviour:
        x = ctx.init_state()
        for k in range(1, self.rounds + 1):
            # a partner must be able to answer: on a directed graph, an edge both ways
            back = set((yield Neighbours(round=k, incoming=True)))
            partners = [j for j in (yield Neighbours(round=k)) if not is_active(j) and j in back]
            partner = None
            if partners:
                partner = self.partner(partners, ctx.seed, ctx.node, k)
                asked = yield Now()
                yield Send(partner, "model", k, x, {"request": True})
            stale = x
            trained = (yield Train(stale, k)).state
            if partner is not None:
                deadline = asked + self.reply_timeout_s
                reply = yield Recv(src=partner, round=k, deadline=deadline)
                if reply:
                    x = average_states([x, reply[0].tensors])
            x = applied(x, stale, trained)
            yield Evaluate(x, k)
        # no more requests from this peer: tell the passive neighbours it can reach (on a
        # redrawn graph, those of its last iteration's graph)
        for j in (yield Neighbours(round=self.rounds)):
            if not is_active(j):
                yield Send(j, "control", self.rounds, {}, {"done": True})
        yield Finish(x)

    def passive(self, ctx: NodeContext) -> Behaviour:
        node = Model(ctx.init_state())

        def answer(request: Message) -> Behaviour:
            """The averaging thread: reply with x_i, then x_i <- (x_i + x_j) / 2, at once."""
            yield Send(request.src, "model", request.round, node.x, {"reply": True})
            node.x = average_states([node.x, request.tensors])

        yield Serve(answer)
        for k in range(1, self.rounds + 1):
            stale = node.x
            trained = (yield Train(stale, k)).state  # requests are answered meanwhile
            node.x = applied(node.x, stale, trained)
            yield Evaluate(node.x, k)
        # go on answering until every active neighbour is done (or, if one never says so,
        # until the run is over)
        # the active peers with this one among their passive neighbours: on the (undirected)
        # topology, its active neighbours (not a scan of every peer: O(N²) over the run)
        actives = [i for i in ctx.topology.neighbours(ctx.node) if is_active(i)]
        yield Recv(kinds=("control",), count=len(actives), deadline=math.inf)
        yield Finish(node.x)

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """With every peer online: each iteration every active peer sends one request to the
        passive neighbour its stream draws and gets one reply, 2·M per active peer and
        iteration (a passive peer answers every request, after its own iterations too); at
        the end each active peer tells each passive neighbour it is done (a small control
        message), so passive peers need not wait for the run's end."""
        topology = plan.topology
        for k in range(1, self.rounds + 1):
            for i in topology.peers:
                partners = passive_of(topology, i)
                if is_active(i) and partners:
                    j = self.partner(partners, plan.seed, i, k)
                    yield plan.send(i, j, "model", k, 2 * k - 1, plan.state, {"request": True})
                    yield plan.send(j, i, "model", k, 2 * k, plan.state, {"reply": True})
        for i in topology.peers:
            for j in passive_of(topology, i):
                yield plan.send(
                    i, j, "control", self.rounds, 2 * self.rounds + 1, {}, {"done": True}
                )

    def partner(self, passive: list[int], seed: int, node: int, k: int) -> int:
        """The passive neighbour an active peer averages with in iteration ``k`` (seeded)."""
        return int(numpy_rng(seed, "adpsgd", node, k).choice(passive))
