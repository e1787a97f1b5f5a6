"""Gossip learning (Ormándi, Hegedűs, Jelasity, "Gossip learning with linear models on fully
distributed data", CCPE 2013, Algorithm 1), asynchronous, on any serverless graph.

Every peer runs two threads of Algorithm 1 in one loop, one period of Δ = ``period_s``
seconds at a time:

- passive thread (``onReceiveModel``): the models that arrived during the period are merged
  with the current one (their average: ``merge``, §4.2) and the merged model is updated
  by local training (``update``);
- active thread: at the end of each period the peer sends its current model to one
  neighbour drawn at random among those it believes online (``selectPeer``; a stream of
  its own per peer and period).

Models thus perform random walks on the graph and nobody waits for anybody: a message lost
or sent to a peer that has just gone offline is simply gone. A peer that was offline skips
the periods it missed rather than catching up in a burst. A peer that received nothing in a
period keeps its model untouched, as in the paper; ``train_idle: true`` trains it anyway
(the variant of Hegedűs et al. 2019, whose peers also learn between messages). The result is
the mean of the peers' final models.
"""

from __future__ import annotations

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
    Train,
    Wait,
)
from p2pfl.network.plan import Plan, Transfer


@METHODS.register("gossip")
@dataclass(kw_only=True, eq=False)
class Gossip(Rounds):
    """Every Δ seconds: merge and train what arrived, push the model to a random neighbour.

    Args:
        period_s: Δ, the seconds between a peer's merge-train-push steps.
        train_idle: also train in a period in which nothing arrived.
    """

    serverless = True

    period_s: float = 1.0
    train_idle: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.period_s > 0:
            raise ConfigError("period_s", "must be > 0")

    def select_peer(self, online: list[int], seed: int, node: int, period: int) -> int:
        """``selectPeer()``: a neighbour drawn uniformly, seeded by peer and period."""
        return int(numpy_rng(seed, "gossip", node, period).choice(online))

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        state = ctx.init_state()
        for k in range(1, self.rounds + 1):
            end = k * self.period_s
            if (yield Now()) > end:
                continue  # it was offline through this period's end: nothing to catch up
            yield Wait(until=end)
            arrived = yield Recv(count=len(ctx.peers), deadline=end)
            merged = bool(arrived)
            if arrived:
                state = average_states([state] + [m.tensors for m in arrived])
            # the arrived models are merged: let them go before the training, which waits for
            # every peer's of this moment (batched), so that no period holds them at its peak
            del arrived
            if merged or self.train_idle:
                state = (yield Train(state, k)).state
            online = yield Neighbours(round=k)  # the graph of period k, if redrawn
            if online:
                yield Send(self.select_peer(online, ctx.seed, ctx.node, k), "model", k, state)
            yield Evaluate(state, k)
        yield Finish(state)

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """With every peer online: each period every peer sends one model, to the neighbour
        its stream draws; R·N·M in all, on any graph (an upper bound when a training
        outlasts ``period_s``: the peer then skips the periods it missed)."""
        topology = plan.topology
        for k in range(1, self.rounds + 1):
            for i in topology.peers:
                j = self.select_peer(topology.neighbours(i), plan.seed, i, k)
                yield plan.send(i, j, "model", k, k, plan.state)
