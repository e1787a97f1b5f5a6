"""FedAvg (McMahan et al., 2017) on a star: a server samples peers, they train, it averages.

Each round the server sends the global model to K = max(1, round(participation * N))
peers drawn from the round's seeded stream, each trains ``train.epochs`` and sends its
model back, and the server takes their sample-weighted mean. One round moves 2·K·M model
bytes; with ``weighting: samples`` each peer also sends its sample count in a small
``control`` message. ``rounds: 1`` with ``participation: 1`` is one-shot FedAvg. At the
end the server tells every peer to stop (one ``control`` message each).

``deadline_s`` makes it live with a network that misbehaves (``network:``): each round the
server samples among the peers it believes reachable (``Neighbours``, as Flower samples the
connected clients), waits at most ``deadline_s`` seconds and averages the models that
arrived (none: it keeps its model); a model carries its sample count in its metadata, so no
``control`` message can go missing on its own. Clients stop at the last possible end of the
run when the server's stop message does not reach them. Without it, a lost message stalls
the round (reported as a deadlock), exactly as before.

``aggregator:`` replaces the server's mean by a robust rule (:mod:`p2pfl.learning.robust`:
``median``, ``trimmed_mean``, ``krum``, ``centered_clipping``, ...) against attacking peers
(``adversary:``). A robust rule is unweighted (an attacker could lie about its sample
count), so with one the peers send no sample counts: R·K fewer ``control`` messages.

``relaxed_init: {beta, aggregate}`` is FedInit (:mod:`p2pfl.methods.relaxed`): each peer
starts its local training from the relaxed point and keeps its last local model, in the
client's own behaviour; the server and the messages stay exactly as above.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import numpy_rng
from p2pfl.learning.robust import Aggregator, Mean, parse_aggregator
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
    Train,
)  # fmt: skip
from p2pfl.methods.relaxed import RelaxedInit, local_round, parse_relaxed_init
from p2pfl.network.message import Message
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import Topology


@METHODS.register("fedavg")
@dataclass(kw_only=True, eq=False)
class FedAvg(Method):
    """Server-side averaging of locally trained models, with partial participation."""

    topologies = ("star",)

    rounds: int = 20
    participation: float = 1.0
    weighting: Literal["samples", "uniform"] = "samples"
    deadline_s: float | None = None
    aggregator: str | dict = "mean"
    relaxed_init: dict | None = None
    relaxed: RelaxedInit | None = field(init=False, repr=False)
    rule: Aggregator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ConfigError("rounds", "must be >= 1")
        if not 0 < self.participation <= 1:
            raise ConfigError("participation", "must be in (0, 1]")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ConfigError("deadline_s", "must be > 0")
        self.relaxed = parse_relaxed_init(self.relaxed_init)
        self.rule = parse_aggregator(self.aggregator)

    @property
    def sends_counts(self) -> bool:
        """Whether peers send their sample counts: for the sample-weighted mean only."""
        return self.weighting == "samples" and isinstance(self.rule, Mean)

    def total_rounds(self, num_peers: int) -> int:
        return self.rounds

    def check(self, topology: Topology, seed: int) -> None:
        """Also: the server's K models a round are enough for the aggregator as set."""
        super().check(topology, seed)
        self.rule.check_inputs({"the server": self.cohort(len(topology.peers))})

    def cohort(self, num_peers: int) -> int:
        """K, the peers the server asks each round: ``participation`` of them, at least 1."""
        return max(1, round_half(self.participation * num_peers))

    def sample(
        self, peers: list[int], seed: int, round: int, among: list[int] | None = None
    ) -> list[int]:
        """The peers taking part in ``round`` (seeded, sorted): K of ``peers``, or with a
        deadline as many of those reachable (``among``) as there are, up to K."""
        k = self.cohort(len(peers))
        pool = peers if among is None else among
        if k >= len(pool):  # all of them: the draw would only shuffle them
            return sorted(pool)
        rng = numpy_rng(seed, "participation", round)
        chosen = rng.choice(pool, min(k, len(pool)), replace=False)
        return sorted(int(p) for p in chosen)

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        if self.deadline_s is not None:
            return self.deadline_server(ctx) if ctx.is_server else self.deadline_client(ctx)
        return self.server(ctx) if ctx.is_server else self.client(ctx)

    def deadline_server(self, ctx: NodeContext) -> Behaviour:
        """Rounds of at most ``deadline_s``: average whatever arrived in time."""
        assert self.deadline_s is not None
        state = ctx.init_state()
        for r in range(1, self.rounds + 1):
            start = yield Now()
            chosen = self.sample(ctx.peers, ctx.seed, r, among=(yield Neighbours()))
            for p in chosen:
                yield Send(p, "model", r, state)
            deadline = start + self.deadline_s
            models = yield Recv(count=len(chosen), round=r, deadline=deadline)
            if models:
                weights = [m.meta["num_samples"] for m in models]
                if not self.sends_counts:
                    weights = [1] * len(models)
                state = self.rule(state, [m.tensors for m in models], weights, 0.0)
            yield Evaluate(state, r)
        for p in ctx.peers:
            yield stop(p, self.rounds)
        yield Finish(state, output=True)

    def deadline_client(self, ctx: NodeContext) -> Behaviour:
        """Train what comes; stop on the server's word or when the run must be over."""
        assert self.deadline_s is not None
        held = ctx.init_state()
        last_end = self.rounds * self.deadline_s
        while msgs := (yield Recv(kinds=("model", "control"), deadline=last_end)):
            (msg,) = msgs
            if msg.kind == "control":
                if self.is_stop(msg):
                    break
                continue
            held, upload = yield from local_round(
                self.relaxed, self.local_train, msg.tensors, held, ctx.trainable, msg.round
            )
            yield Send(msg.src, "model", msg.round, upload, {"num_samples": ctx.num_samples})
        yield Finish(held)

    def server(self, ctx: NodeContext) -> Behaviour:
        state = ctx.init_state()
        for r in range(1, self.rounds + 1):
            chosen = self.sample(ctx.peers, ctx.seed, r)
            for p in chosen:
                yield Send(p, "model", r, state)
            models = yield Recv(count=len(chosen), round=r)
            weights = [1] * len(models)
            if self.sends_counts:
                sizes = yield Recv(kinds=("control",), count=len(chosen), round=r)
                count = {m.src: m.meta["num_samples"] for m in sizes}
                weights = [count[m.src] for m in models]
            state = self.rule(state, [m.tensors for m in models], weights, 0.0)
            yield Evaluate(state, r)
        for p in ctx.peers:
            yield stop(p, self.rounds)
        yield Finish(state, output=True)

    def is_stop(self, msg: Message) -> bool:
        """The server's word to stop (:func:`is_stop`)."""
        return is_stop(msg, self.rounds)

    def client(self, ctx: NodeContext) -> Behaviour:
        held = ctx.init_state()  # the last local model (FedInit's per-peer state)
        while True:
            (msg,) = yield Recv(kinds=("model", "control"))
            if msg.kind == "control":
                if self.is_stop(msg):
                    break
                continue
            held, upload = yield from local_round(
                self.relaxed, self.local_train, msg.tensors, held, ctx.trainable, msg.round
            )
            yield Send(msg.src, "model", msg.round, upload)
            if self.sends_counts:
                yield Send(msg.src, "control", msg.round, {}, {"num_samples": ctx.num_samples})
        yield Finish(held)

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Round r: K models down (phase 2r−1), K models and, with ``weighting: samples`` and
        the mean, K sample counts up (phase 2r); then N stop messages. R·(2K·M + K·C_n) + N·C_stop.
        With ``deadline_s``, when every peer is reachable: the counts ride in the models."""
        server, peers = plan.topology.hub, plan.topology.peers
        for r in range(1, self.rounds + 1):
            chosen = self.sample(peers, plan.seed, r)
            for p in chosen:
                yield plan.send(server, p, "model", r, 2 * r - 1, plan.state)
            for p in chosen:
                if self.deadline_s is not None:  # the sample count rides with the model
                    meta = {"num_samples": plan.num_train[p]}
                    yield plan.send(p, server, "model", r, 2 * r, plan.state, meta)
                    continue
                yield plan.send(p, server, "model", r, 2 * r, plan.state)
                if self.sends_counts:
                    meta = {"num_samples": plan.num_train[p]}
                    yield plan.send(p, server, "control", r, 2 * r, meta=meta)
        last, stop = self.rounds, 2 * self.rounds + 1
        for p in peers:
            yield plan.send(server, p, "control", last, stop, meta={"stop": True})

    def local_train(self, state: State, round: int) -> Train:
        """The local training step (FedProx adds its proximal term here)."""
        return Train(state, round)


def stop(dst: int, rounds: int) -> Send:
    """The server's word to stop, to client ``dst``: a ``control`` message at the last round,
    ``rounds``, with meta ``{"stop": true}`` (FedAvg's; FedAsync and FedBuff end alike)."""
    return Send(dst, "control", rounds, {}, {"stop": True})


def is_stop(msg: Message, rounds: int) -> bool:
    """Whether ``msg`` is the server's word to stop (:func:`stop`) in a run of ``rounds``: a
    control frame of any other form, which only a forger sends, is passed over."""
    return msg.meta.get("stop") is True and msg.round == rounds


def round_half(x: float) -> int:
    """Round half up (Python's round() rounds half to even)."""
    return int(x + 0.5)
