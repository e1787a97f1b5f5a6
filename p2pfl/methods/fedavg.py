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
the round (reported as a deadlock), exactly as before. One server and one client behaviour
serve both, each written as the paper's Algorithm 1 with the shared steps of
:mod:`p2pfl.methods.steps`.

``aggregator:`` replaces the server's mean by a robust rule (:mod:`p2pfl.learning.robust`:
``median``, ``trimmed_mean``, ``krum``, ``centered_clipping``, ...) against attacking peers
(``adversary:``). A robust rule is unweighted (an attacker could lie about its sample
count), so with one the peers send no sample counts: R·K fewer ``control`` messages.

``relaxed_init: {beta, aggregate}`` is FedInit (:mod:`p2pfl.methods.relaxed`): each peer
starts its local training from the relaxed point and keeps its last local model, in the
client's own behaviour; the server and the messages stay exactly as above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import numpy_rng
from p2pfl.learning.robust import Mean
from p2pfl.methods.base import METHODS, Aggregating, NodeContext
from p2pfl.methods.effects import Behaviour, Evaluate, Finish, Recv, Send, State, Steps, Train
from p2pfl.methods.relaxed import local_round
from p2pfl.methods.steps import deadline_in, gather, reachable
from p2pfl.methods.stragglers import Stragglers, fewer_epochs, parse_stragglers
from p2pfl.network.message import Message
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import Topology


@METHODS.register("fedavg")
@dataclass(kw_only=True, eq=False)
class FedAvg(Aggregating):
    """Server-side averaging of locally trained models, with partial participation.

    Args:
        participation: the share of peers sampled each round, in (0, 1]: K = max(1,
            round(participation·N)).
        weighting: the server's mean: ``samples`` (weighted by the peers' sample counts, sent in
            small ``control`` messages) or ``uniform``.
        deadline_s: with a misbehaving network: each round the server samples among the peers it
            believes reachable, waits at most this long and averages what arrived (null: wait for
            every sampled peer).
        stragglers: systems heterogeneity as in FedProx §5.2: ``{fraction, epochs, drop}``, the
            share of each round's sampled peers that do only ``epochs`` local epochs, and
            whether the server drops them (:class:`p2pfl.methods.stragglers.Stragglers`;
            null: none).
    """

    topologies = ("star",)

    participation: float = 1.0
    weighting: Literal["samples", "uniform"] = "samples"
    deadline_s: float | None = None
    stragglers: dict | None = None
    slow: Stragglers | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.slow = parse_stragglers(self.stragglers)
        if not 0 < self.participation <= 1:
            raise ConfigError("participation", "must be in (0, 1]")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ConfigError("deadline_s", "must be > 0")

    @property
    def sends_counts(self) -> bool:
        """Whether peers send their sample counts: for the sample-weighted mean only."""
        return self.weighting == "samples" and isinstance(self.rule, Mean)

    @property
    def live(self) -> bool:
        """Whether the run lives with a network that misbehaves (``deadline_s``): the server
        samples among the peers it can reach and waits for them at most ``deadline_s``."""
        return self.deadline_s is not None

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
        return self.server(ctx) if ctx.is_server else self.client(ctx)

    def server(self, ctx: NodeContext) -> Behaviour:
        """McMahan et al. 2017, Algorithm 1, "Server executes" (a round lasts at most
        ``deadline_s``, if set, and averages the models that came in time)."""
        w = ctx.init_state()  # initialize w_0
        for t in range(1, self.rounds + 1):  # for each round t
            deadline = yield from deadline_in(self.deadline_s)
            online = yield from reachable(ctx, self.live)
            chosen = self.sample(ctx.peers, ctx.seed, t, among=online)  # S_t: m = max(C·K, 1)
            chosen, slow = self.straggling(chosen, ctx.seed, t)
            for k in chosen:  # each k ∈ S_t: ClientUpdate(k, w_t)
                yield Send(k, "model", t, w, {"epochs": slow[k]} if k in slow else {})
            updates = yield from gather(len(chosen), t, deadline)  # the w_{t+1}^k
            if updates:  # w_{t+1} ← Σ_k n_k/m_t · w_{t+1}^k (or the robust rule)
                n = yield from self.counts(updates, t)
                w = self.rule(w, [u.tensors for u in updates], n, 0.0)
            yield Evaluate(w, t)
        for p in ctx.peers:
            yield stop(p, self.rounds)
        yield Finish(w, output=True)

    def counts(self, updates: list[Message], round: int) -> Steps[list[int]]:
        """n_k of each update, in their order: 1 each where the rule takes no counts; else
        from the model's metadata with a deadline, or from the clients' ``control`` messages
        (see :meth:`upload`)."""
        if not self.sends_counts:
            return [1] * len(updates)
        if self.live:
            return [m.meta["num_samples"] for m in updates]
        sizes = yield Recv(kinds=("control",), count=len(updates), round=round)
        count = {m.src: m.meta["num_samples"] for m in sizes}
        return [count[m.src] for m in updates]

    def client(self, ctx: NodeContext) -> Behaviour:
        """Algorithm 1, ClientUpdate(k, w) for each model the server sends, until its word to
        stop (with a deadline: or the last possible end of the run, if the word is lost)."""
        held = ctx.init_state()  # the last local model (FedInit's per-peer state)
        last_end = self.rounds * self.deadline_s if self.deadline_s is not None else None
        while msg := (yield from orders(self.rounds, last_end)):
            train: Callable[[State, int], Train] = self.local_train
            if "epochs" in msg.meta:  # a straggler this round (``stragglers``)
                train = fewer_epochs(self.local_train, msg.meta["epochs"])
            held, w = yield from local_round(
                self.relaxed, train, msg.tensors, held, ctx.trainable, msg.round
            )
            yield from self.upload(msg.src, msg.round, w, ctx.num_samples)
        yield Finish(held)

    def straggling(
        self, chosen: list[int], seed: int, round: int
    ) -> tuple[list[int], dict[int, int]]:
        """The round's peers to ask and the stragglers' epochs among them: with
        ``stragglers.drop`` the stragglers are left out (and none is slow); without
        ``stragglers``, ``chosen`` and none."""
        if self.slow is None:
            return chosen, {}
        slow = self.slow.pick(chosen, seed, round)
        if self.slow.drop:
            return [k for k in chosen if k not in slow], {}
        return chosen, slow

    def upload(self, server: int, round: int, w: State, n: int) -> Steps[None]:
        """Algorithm 1's "return w to server", with n_k: with a deadline n_k rides in the
        model's metadata, so no ``control`` message can go missing on its own; else it follows
        the model in a ``control`` message, where the mean needs it."""
        if self.live:
            yield Send(server, "model", round, w, {"num_samples": n})
            return
        yield Send(server, "model", round, w)
        if self.sends_counts:
            yield Send(server, "control", round, {}, {"num_samples": n})

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Round r: K models down (phase 2r−1), K models and, with ``weighting: samples`` and
        the mean, K sample counts up (phase 2r); then N stop messages. R·(2K·M + K·C_n) + N·C_stop.
        With ``deadline_s``, when every peer is reachable: the counts ride in the models."""
        server, peers = plan.topology.hub, plan.topology.peers
        for r in range(1, self.rounds + 1):
            chosen, slow = self.straggling(self.sample(peers, plan.seed, r), plan.seed, r)
            for p in chosen:
                down = {"epochs": slow[p]} if p in slow else None
                yield plan.send(server, p, "model", r, 2 * r - 1, plan.state, down)
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


def orders(rounds: int, deadline: float | None = None) -> Steps[Message | None]:
    """A client's next model from the server, or ``None`` once the server says stop
    (:func:`is_stop`; any other control frame is passed over) or, with a ``deadline``, when
    nothing has come by then."""
    while msgs := (yield Recv(kinds=("model", "control"), deadline=deadline)):
        (msg,) = msgs
        if msg.kind == "model":
            return msg
        if is_stop(msg, rounds):
            return None
    return None


def round_half(x: float) -> int:
    """Round half up (Python's round() rounds half to even)."""
    return int(x + 0.5)
