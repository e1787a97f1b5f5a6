"""FedSeq (sequential FedAvg): each peer trains what it received and passes it on.

Peers form a chain in ``order`` (index order, or a seeded permutation); peer 1 starts from
the shared init. One cycle moves N−1 models; with ``cycles: T`` the last peer sends back to
the first and the chain repeats, T·N−1 models in all. The output is the last peer's model.

``skip_offline: true`` lives with a network that misbehaves: the holder passes the model to
the next peer of the chain that it believes online and has a link to (``Neighbours``),
passing over the others — their turns are lost, the hop count goes on as if they had taken
them. If no later peer is reachable it waits, checking every ``retry_s`` seconds (at most 10
times), and then ends the chain: its model is the output. A peer that never got a turn
finishes without a model when the run is over. On a mesh any peer can be passed over; on a
ring only the next one is linked, so an offline successor is waited for. Without the option
the chain is the plain one above, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import numpy_rng
from p2pfl.methods.base import METHODS, Method, NodeContext
from p2pfl.methods.effects import (
    Behaviour,
    Evaluate,
    Finish,
    Neighbours,
    Now,
    Recv,
    Send,
    State,
    Steps,
    Train,
    Wait,
)
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import Topology


@METHODS.register("fedseq")
@dataclass(kw_only=True, eq=False)
class FedSeq(Method):
    """Sequential training along a chain of peers (one or more cycles).

    Args:
        cycles: T, how many times the model goes round the chain.
        order: the chain's order: ``index`` (peer order) or ``random`` (a seeded permutation).
        skip_offline: pass the model to the next chain peer believed online and linked, passing over
            the others (their turns are lost).
        retry_s: with ``skip_offline``: when no next peer is reachable, check again every this many
            seconds, at most 10 times, then end the chain.
    """

    serverless = True

    cycles: int = 1
    order: Literal["index", "random"] = "index"
    skip_offline: bool = False
    retry_s: float = 1.0

    def __post_init__(self) -> None:
        if self.cycles < 1:
            raise ConfigError("cycles", "must be >= 1")
        if not self.retry_s > 0:
            raise ConfigError("retry_s", "must be > 0")

    def chain(self, peers: list[int], seed: int) -> list[int]:
        """The visiting order of the peers."""
        if self.order == "index":
            return list(peers)
        return [int(p) for p in numpy_rng(seed, "chain-order").permutation(peers)]

    def check(self, topology: Topology, seed: int) -> None:
        super().check(topology, seed)
        chain = self.chain(topology.peers, seed)
        hops = list(zip(chain, chain[1:], strict=False))
        if self.cycles > 1:
            hops.append((chain[-1], chain[0]))
        for a, b in hops:
            if not topology.graph.has_edge(a, b):
                raise ConfigError("kind", f"{self.name} needs a link {a}->{b} for its chain order")

    def total_rounds(self, num_peers: int) -> int:
        return self.cycles * num_peers

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        return self.skipping(ctx) if self.skip_offline else self.plain(ctx)

    def skipping(self, ctx: NodeContext) -> Behaviour:
        """The chain passing over peers that are offline (``skip_offline``)."""
        chain = self.chain(ctx.peers, ctx.seed)
        n, pos, last = len(chain), chain.index(ctx.node), self.cycles * len(ctx.peers)
        state: State | None = None
        hop, received = 1, self.start(ctx)
        if pos != 0:  # wait for a first turn, which may never come
            msgs = yield Recv(kinds=("model",), deadline=math.inf)
            if not msgs:
                yield Finish(None)
                return
            hop, received = msgs[0].round + 1, msgs[0].tensors
        while True:
            state = yield from self.turn(ctx, received, hop)
            yield Evaluate(state, hop)
            later = [h for h in range(hop + 1, last + 1) if chain[(h - 1) % n] != ctx.node]
            target = None
            for _ in range(10 if later else 0):
                for h in later:  # hop h's message is round h - 1: that round's graph, if redrawn
                    if chain[(h - 1) % n] in (yield Neighbours(round=h - 1)):
                        target = h
                        break
                if target is not None:
                    break
                yield Wait(until=(yield Now()) + self.retry_s)
            if target is None:  # the chain ends here
                yield Finish(state, output=True)
                return
            yield Send(chain[(target - 1) % n], "model", target - 1, state)
            if not any(chain[(h - 1) % n] == ctx.node for h in range(target + 1, last + 1)):
                break  # no turn of ours is left
            msgs = yield Recv(kinds=("model",), deadline=math.inf)
            if not msgs:
                break
            hop, received = msgs[0].round + 1, msgs[0].tensors
        yield Finish(state)

    def plain(self, ctx: NodeContext) -> Behaviour:
        chain = self.chain(ctx.peers, ctx.seed)
        n, pos = len(chain), chain.index(ctx.node)
        state: State | None = None
        for cycle in range(self.cycles):
            hop = cycle * n + pos + 1  # 1-based position of this turn in the whole run
            if hop == 1:
                received = self.start(ctx)
            else:
                (msg,) = yield Recv(round=hop - 1, src=chain[pos - 1])
                received = msg.tensors
            state = yield from self.turn(ctx, received, hop)
            yield Evaluate(state, hop)
            if hop < self.cycles * n:
                yield Send(chain[(pos + 1) % n], "model", hop, state)
        yield Finish(state, output=pos == n - 1)

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Hop h (round and phase h) moves one model to the next peer of the chain:
        (T·N − 1)·M in all."""
        chain = self.chain(plan.topology.peers, plan.seed)
        n = len(chain)
        for hop in range(1, self.cycles * n):
            pos = (hop - 1) % n
            yield plan.send(chain[pos], chain[(pos + 1) % n], "model", hop, hop, plan.state)

    def start(self, ctx: NodeContext) -> State:
        """The model the first peer starts from."""
        return ctx.init_state()

    def turn(self, ctx: NodeContext, received: State, hop: int) -> Steps[State]:
        """One peer's work on the received model; returns the model to forward."""
        result = yield Train(received, hop)
        return result.state
