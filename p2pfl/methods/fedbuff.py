"""FedBuff (Nguyen, Malik, Zhao, Sanjabi, Rabbat, Esmaeili, Huba, "Federated Learning with
Buffered Asynchronous Aggregation", AISTATS 2022, Algorithm 1) on a star: the server buffers
the clients' updates and steps once every K of them.

Server. It holds x (the shared init first), version t = 0, and keeps C clients training
(``concurrency``; all of them by default): it sends (x, t) — the version is the message's
``round`` — to C clients, drawn from the round's seeded stream when C < N. Each update Δ_i
that arrives, from a client that trained on version τ_i, goes to the buffer, with staleness
t − τ_i (the server steps since that client's download):

    Δ̄ ← Δ̄ + s(t − τ_i) · Δ_i,    k ← k + 1
    if k = K:   x ← x + η_g · Δ̄ / K,   Δ̄ ← 0,  k ← 0,  t ← t + 1

with η_g the server learning rate (``server_lr``) and s = 1 (``staleness_scaling: false``,
the default) or s(τ) = 1/√(1 + τ) (``true``, the scaling of the paper's experiments). The
client that sent it is then idle, and the server sends (x, t) at once to an idle client: the
one that just returned when every client trains at once (C = N), otherwise one drawn among
the idle ones from the arrival's seeded stream.

Client. On (x, t): local SGD from x (the ``train:`` section), then send Δ = y − x, the
trained model minus the received one, stamped t. (The paper's Δ is x − y and its server
steps x − η_g·Δ̄: the same step.)

End. After step R (``rounds``) the server tells every idle client to stop (FedAvg's stop),
and every client whose update arrives later (not applied) as it arrives; it ends when it
has told every client, so nothing is left in flight to it. Its x is the output. Each
buffered update logs its staleness t − τ_i (``metrics.csv``, metric ``staleness``, round t).

Traffic: R·K + C − 1 models down, as many updates up, N stops, whatever the speeds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from p2pfl.core.errors import ConfigError, TopologyMisfit
from p2pfl.core.seeding import numpy_rng
from p2pfl.methods.base import METHODS, NodeContext, Rounds
from p2pfl.methods.effects import Behaviour, Evaluate, Finish, Log, Recv, Send, State, Train
from p2pfl.methods.fedavg import orders, stop
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import Topology


def server_step(x: State, buffer: list[tuple[State, float]], lr: float) -> State:
    """x + η_g · (1/K) Σ s_i·Δ_i over the K buffered (Δ_i, s_i), summed in float64 in the
    order of arrival and cast back (integer tensors rounded)."""
    k = len(buffer)
    out: State = {}
    for name, v in x.items():
        acc = v.to(torch.float64, copy=True)
        for delta, s in buffer:
            acc.add_(delta[name], alpha=lr * s / k)
        out[name] = acc.to(v.dtype) if v.is_floating_point() else acc.round().to(v.dtype)
    return out


@METHODS.register("fedbuff")
@dataclass(kw_only=True, eq=False)
class FedBuff(Rounds):
    """Buffered asynchronous aggregation: a server step with the mean of every K updates.

    Args:
        buffer_size: K, the arriving updates per server step (>= 1).
        server_lr: η_g, the server's step size on the mean update.
        staleness_scaling: weigh each update by 1/√(1 + τ), τ the server steps since its client's
            download.
        concurrency: C, how many clients train at once (null: all; fewer: each arrival's model goes
            to an idle client drawn from a seeded stream).
    """

    topologies = ("star",)
    unattackable = (
        "fedbuff's clients send updates (trained minus received model), not models: a model "
        "attack would corrupt the wrong quantity (data attacks apply)"
    )

    buffer_size: int = 10
    server_lr: float = 1.0
    staleness_scaling: bool = False
    concurrency: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.buffer_size < 1:
            raise ConfigError("buffer_size", f"must be >= 1, got {self.buffer_size}")
        if not self.server_lr > 0:
            raise ConfigError("server_lr", f"must be > 0, got {self.server_lr}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError("concurrency", f"must be >= 1, got {self.concurrency}")

    def check(self, topology: Topology, seed: int) -> None:
        """Also: at most as many clients train at once as there are."""
        super().check(topology, seed)
        n = len(topology.peers)
        if self.concurrency is not None and self.concurrency > n:
            raise TopologyMisfit("concurrency", f"must be <= the {n} peers, got {self.concurrency}")

    def weight(self, staleness: int) -> float:
        """s(τ): 1, or 1/√(1 + τ) with ``staleness_scaling``."""
        return 1.0 / math.sqrt(1 + staleness) if self.staleness_scaling else 1.0

    def first(self, peers: list[int], seed: int) -> list[int]:
        """The C clients that start (sorted): all, or C drawn from the seeded stream."""
        c = self.concurrency or len(peers)
        if c >= len(peers):
            return list(peers)
        chosen = numpy_rng(seed, "fedbuff", 0).choice(peers, c, replace=False)
        return sorted(int(p) for p in chosen)

    def next_client(self, idle: list[int], seed: int, arrival: int) -> int:
        """The idle client that trains next, after the ``arrival``-th update (from 1): the
        only one when C = N (the client that just returned), else one drawn."""
        if len(idle) == 1:
            return idle[0]
        return idle[int(numpy_rng(seed, "fedbuff", arrival).integers(len(idle)))]

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        return self.server(ctx) if ctx.is_server else self.client(ctx)

    def server(self, ctx: NodeContext) -> Behaviour:
        x, t = ctx.init_state(), 0
        training = self.first(ctx.peers, ctx.seed)
        idle = sorted(set(ctx.peers) - set(training))
        for i in training:
            yield Send(i, "model", t, x)
        buffer: list[tuple[State, float]] = []  # (Δ_i, s_i)
        told: set[int] = set()
        arrival = 0
        while len(told) < len(ctx.peers):
            (msg,) = yield Recv(kinds=("model",))  # Δ_i from a client, in order of arrival
            arrival += 1
            idle = sorted([*idle, msg.src])
            if t < self.rounds:
                yield Log(t, "staleness", t - msg.round)
                buffer.append((msg.tensors, self.weight(t - msg.round)))
                if len(buffer) == self.buffer_size:
                    x, t, buffer = server_step(x, buffer, self.server_lr), t + 1, []
                    yield Evaluate(x, t)
            if t < self.rounds:
                i = self.next_client(idle, ctx.seed, arrival)
                idle.remove(i)
                yield Send(i, "model", t, x)
            else:  # done: every idle client is told, and each one still training on return
                for i in idle:
                    yield stop(i, self.rounds)
                told.update(idle)
                idle = []
        yield Finish(x, output=True)

    def client(self, ctx: NodeContext) -> Behaviour:
        held = ctx.init_state()
        k = 0  # its trainings so far: each draws its own batch order
        while msg := (yield from orders(self.rounds)):
            x = msg.tensors
            held = (yield Train(x, msg.round, tag=str(k))).state
            yield Send(msg.src, "model", msg.round, {n: y - x[n] for n, y in held.items()})
            k += 1
        yield Finish(held)

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Every client's k-th model down in phase 2k + 1 and its update up in phase 2k + 2.

        The totals hold for any speeds: R·K + C − 1 models down, as many updates up, N stops.
        Who sends how many, and the versions they carry, are those of a run in which every
        training takes equally long and every link is alike, so that the updates come back
        in the order the models went out: as where compute is free (the assumption of
        ``p2pfl cost``) or, under ``compute: model``, where the peers have equal speeds and
        equal data sizes. Otherwise the faster clients send more."""
        server, peers, seed = plan.topology.hub, plan.topology.peers, plan.seed
        training = self.first(peers, seed)
        idle = sorted(set(peers) - set(training))
        out: deque[tuple[int, int]] = deque()  # (client, τ) in order of return
        trips = dict.fromkeys(peers, 0)  # each client's models so far
        for i in training:
            yield plan.send(server, i, "model", 0, 1, plan.state)
            out.append((i, 0))
        t, k, told, arrival = 0, 0, 0, 0
        while told < len(peers):
            j, tau = out.popleft()
            arrival += 1
            trips[j] += 1
            yield plan.send(j, server, "model", tau, 2 * trips[j], plan.state)
            idle = sorted([*idle, j])
            if t < self.rounds:
                k += 1
                if k == self.buffer_size:
                    t, k = t + 1, 0
            if t < self.rounds:
                i = self.next_client(idle, seed, arrival)
                idle.remove(i)
                yield plan.send(server, i, "model", t, 2 * trips[i] + 1, plan.state)
                out.append((i, t))
            else:
                for i in idle:
                    yield plan.send(server, i, "control", self.rounds, 2 * trips[i] + 1,
                                    meta={"stop": True})  # fmt: skip
                told += len(idle)
                idle = []
