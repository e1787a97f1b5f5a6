"""FedAsync (Xie, Koyejo, Gupta, "Asynchronous Federated Optimization", 2019, Algorithm 1)
on a star: the server mixes every arriving model into its own at once.

Server. It holds x_{t-1}, version t − 1 (x_0: the shared init). Its scheduler gives every
worker (x_0, 0). Its updater takes the pairs (x_new, τ) as they arrive — a worker's model
trained from version τ — and makes version t of each:

    α_t = α · s(t − τ),        x_t = (1 − α_t) · x_{t−1} + α_t · x_new

with s one of §5's staleness functions (:class:`Staleness`). A worker that trained on the
latest model has t − τ = 1; each update made in the meantime adds one. The server then
schedules that worker again at once: it sends it x_t stamped t (the message's ``round``).

Worker. On (x_t, t): τ ← t, then local SGD from x_t (the ``train:`` section) on
f(x) + (ρ/2)·‖x − x_t‖², then push (x_new, τ).

End. After update R (``rounds``) the server answers the worker that made it, and each
worker whose model arrives later (not applied), with the stop of FedAvg's clients; it ends
when it has told every worker, so nothing is left in flight to it. Its x_R is the output.
Each update logs its staleness t − τ (``metrics.csv``, metric ``staleness``, round t).

Traffic: N + R − 1 models down, as many up, N stops, whatever the speeds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import bind
from p2pfl.learning.state import average_states
from p2pfl.learning.training import Proximal
from p2pfl.methods.base import METHODS, NodeContext, Rounds
from p2pfl.methods.effects import Behaviour, Evaluate, Finish, Log, Recv, Send, Train
from p2pfl.methods.fedavg import orders, stop
from p2pfl.network.plan import Plan, Transfer

DEFAULT_A = {"polynomial": 0.5, "hinge": 10.0}
"""§6's a for each function (FedAsync+Poly: a = 0.5; FedAsync+Hinge: a = 10, b = 4)."""
DEFAULT_B = 4.0


@dataclass(frozen=True)
class Staleness:
    """s(t − τ), the weight of an update t − τ versions stale (§5):

    - ``constant``: 1;
    - ``polynomial``: (t − τ + 1)^(−a);
    - ``hinge``: 1 if t − τ ≤ b, else 1 / (a·(t − τ − b) + 1).

    Unset, a and b take §6's values: a = 0.5 (polynomial), a = 10 and b = 4 (hinge).
    """

    name: str = "constant"
    a: float | None = None
    b: float | None = None

    def __post_init__(self) -> None:
        if self.name not in ("constant", "polynomial", "hinge"):
            raise ConfigError(
                "name", f"unknown staleness function {self.name!r}; choose constant, "
                "polynomial or hinge",
            )  # fmt: skip
        if self.name == "constant" and (self.a is not None or self.b is not None):
            raise ConfigError("a" if self.a is not None else "b", "constant takes no a or b")
        if self.name == "polynomial" and self.b is not None:
            raise ConfigError("b", "polynomial takes no b (only hinge does)")
        if self.name != "constant" and self.a is None:
            object.__setattr__(self, "a", DEFAULT_A[self.name])
        if self.name == "hinge" and self.b is None:
            object.__setattr__(self, "b", DEFAULT_B)
        if self.a is not None and not self.a >= 0:
            raise ConfigError("a", f"must be >= 0, got {self.a}")
        if self.b is not None and not self.b >= 0:
            raise ConfigError("b", f"must be >= 0, got {self.b}")

    def __call__(self, lag: int) -> float:
        """s(lag), for lag = t − τ >= 1."""
        if self.name == "constant":
            return 1.0
        assert self.a is not None
        if self.name == "polynomial":
            return float((lag + 1) ** -self.a)
        assert self.b is not None
        return 1.0 if lag <= self.b else 1.0 / (self.a * (lag - self.b) + 1.0)


def parse_staleness(option: str | dict[str, Any]) -> Staleness:
    """The ``staleness`` key: a function's name, or ``{name, a, b}``."""
    if isinstance(option, str):
        option = {"name": option}
    try:
        return Staleness(**bind(Staleness, option))
    except ConfigError as e:
        raise e.within("staleness") from None


@METHODS.register("fedasync")
@dataclass(kw_only=True, eq=False)
class FedAsync(Rounds):
    """Asynchronous federated optimization: every arriving model is mixed in at once, with a
    weight that decays with its staleness.

    Args:
        alpha: α in (0, 1], the mixing weight of an arriving model.
        staleness: s, the weight's decay with the update's staleness t − τ: ``constant``,
            ``polynomial`` ((t − τ + 1)^−a) or ``hinge``, a name or ``{name, a, b}``.
        rho: ρ, the client's proximal term (ρ/2)·‖x − x_t‖² on its local loss (0: plain local SGD).
    """

    topologies = ("star",)

    alpha: float = 0.6
    staleness: str | dict = "constant"
    rho: float = 0.0
    s: Staleness = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.alpha <= 1:
            raise ConfigError("alpha", f"must be in (0, 1], got {self.alpha}")
        if not self.rho >= 0:
            raise ConfigError("rho", f"must be >= 0, got {self.rho}")
        self.s = parse_staleness(self.staleness)

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        return self.server(ctx) if ctx.is_server else self.worker(ctx)

    def server(self, ctx: NodeContext) -> Behaviour:
        x, t = ctx.init_state(), 0
        for i in ctx.peers:  # Scheduler: every worker starts from (x_0, 0)
            yield Send(i, "model", t, x)
        told = 0
        while told < len(ctx.peers):
            (msg,) = yield Recv(kinds=("model",))  # (x_new, τ), in order of arrival
            if t < self.rounds:  # Updater
                t, tau = t + 1, msg.round
                alpha_t = self.alpha * self.s(t - tau)
                x = average_states([x, msg.tensors], [1 - alpha_t, alpha_t])
                yield Log(t, "staleness", t - tau)
                yield Evaluate(x, t)
            if t < self.rounds:  # Scheduler: that worker trains again, from (x_t, t)
                yield Send(msg.src, "model", t, x)
            else:
                yield stop(msg.src, self.rounds)
                told += 1
        yield Finish(x, output=True)

    def worker(self, ctx: NodeContext) -> Behaviour:
        held = ctx.init_state()
        while msg := (yield from orders(self.rounds)):
            x_t, tau = msg.tensors, msg.round
            g = Proximal(x_t, self.rho) if self.rho else None  # f(x) + (ρ/2)·‖x − x_t‖²
            held = (yield Train(x_t, tau, regularizer=g)).state
            yield Send(msg.src, "model", tau, held)  # push (x_new, τ)
        yield Finish(held)

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Every worker's k-th model down in phase 2k + 1 and up in phase 2k + 2 (k from 0).

        The totals hold for any speeds: N + R − 1 models each way and N stops. Which worker
        sends how many, and the versions they carry, are those of a run in which every
        training takes equally long and every link is alike, so that the models come back
        in the order they went out: round robin over the peers, as where compute is free
        (the assumption of ``p2pfl cost``) or, under ``compute: model``, where the peers
        have equal speeds and equal data sizes. Otherwise the faster workers send more."""
        server, peers = plan.topology.hub, plan.topology.peers
        out: deque[tuple[int, int, int]] = deque()  # (worker, τ, its k) in order of return
        for i in peers:
            yield plan.send(server, i, "model", 0, 1, plan.state)
            out.append((i, 0, 0))
        t, told = 0, 0
        while told < len(peers):
            i, tau, k = out.popleft()
            yield plan.send(i, server, "model", tau, 2 * k + 2, plan.state)
            t = min(t + 1, self.rounds)
            if t < self.rounds:
                yield plan.send(server, i, "model", t, 2 * k + 3, plan.state)
                out.append((i, t, k + 1))
            else:
                yield plan.send(server, i, "control", self.rounds, 2 * k + 3, meta={"stop": True})
                told += 1
