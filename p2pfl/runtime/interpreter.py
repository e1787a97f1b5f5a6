"""The one place a node's effects are carried out, for every runtime.

A behaviour yields effects (:mod:`p2pfl.methods.effects`); :meth:`Interpreter.drive` sends
each one's result back. What an effect means is decided here, once: ``Finish`` records the
node's final model, ``Now`` reads the clock, ``Neighbours`` asks the network, ``Serve``
installs the node's handler, and the local effects (``Evaluate``, ``Report``, ``Artifact``,
``Log``) go to the shared :class:`~p2pfl.runtime.worker.Worker`; ``Evaluate`` and
``Finish`` also move the run's :class:`ProgressBar`. A runtime implements only
what depends on its transport and its clock: ``send``, ``recv``, ``sleep``, ``compute``
(``Train`` and ``Compute``, which take time) and ``before`` (what happens to a node that is
offline or has crashed before it acts).

``drive`` is a generator: the simulation runs it as a SimPy process (the runtime's parts
yield SimPy events); over sockets the parts block and yield nothing, and the node runs it
to its end with :func:`run_blocking`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from typing import Any

from tqdm import tqdm

from p2pfl.core.errors import RunError
from p2pfl.methods.effects import (
    Behaviour,
    Compute,
    Effect,
    Evaluate,
    Finish,
    Log,
    Neighbours,
    Now,
    Recv,
    Send,
    Serve,
    State,
    Train,
    Wait,
)
from p2pfl.network.dynamics import Network
from p2pfl.network.message import Message
from p2pfl.network.topology import Topology
from p2pfl.runtime.worker import Worker

Steps = Generator[Any, Any, Any]
"""A runtime's part of an effect: yields what its clock waits on (nothing, over sockets)."""

FINISHED_EVERY_S = 0.2
"""How often, at most, the progress bar redraws its count of finished nodes."""


class ProgressBar:
    """A run's progress on stderr: the rounds its nodes reach (at every ``Evaluate``, scored
    or not: a run scored only at its end would show nothing until then), then how many
    nodes have finished. The rounds are all reached once the first node reaches the last,
    but the others still finish it: 10⁴ DFedAvgM peers mix and score their last round for
    12 s of a 25 s run, which the count shows moving."""

    def __init__(self, rounds: int | None = None, show: bool = False) -> None:
        self._bar = tqdm(total=rounds, unit="round", disable=not show, leave=False)
        self._shown = -math.inf  # when the count of finished nodes was last drawn

    def reached(self, round: int) -> None:
        """A node has reached ``round``."""
        if round > self._bar.n:
            self._bar.update(round - self._bar.n)

    def finished(self, done: int, nodes: int) -> None:
        """``done`` of the ``nodes`` have finished (drawn at most every
        :data:`FINISHED_EVERY_S`, and when the last has)."""
        now = time.monotonic()
        if self._bar.disable or (done < nodes and now - self._shown < FINISHED_EVERY_S):
            return
        self._shown = now
        self._bar.set_postfix_str(f"{done:,}/{nodes:,} nodes finished")

    def close(self) -> None:
        self._bar.close()


class Interpreter:
    """Carries out the effects of the nodes of one run; a runtime subclasses it."""

    topology: Topology
    worker: Worker
    network: Network | None

    def __init__(self) -> None:
        self.finals: dict[int, Finish] = {}
        self.servers: dict[int, Serve] = {}  # each serving node's handler
        self.keep_latest = False  # whether to keep ``latest`` (a stop or a probe needs it)
        self.latest: dict[int, State] = {}  # each node's model as it last evaluated it
        self.round_seen = 0  # the latest round any node evaluated
        self.samples = 0  # samples trained on by the nodes this interpreter runs
        self.nodes = 0  # how many nodes this interpreter runs (the progress bar counts them)
        self.bar = ProgressBar()  # hidden unless the run shows one

    # -- what a runtime provides ---------------------------------------------------------
    @property
    def clock(self) -> float:
        """The time on the run's clock (simulated, or wall seconds since the start)."""
        raise NotImplementedError

    def send(self, node: int, eff: Send) -> None:
        """Hand a message to the network; returns at once."""
        raise NotImplementedError

    def recv(self, node: int, eff: Recv) -> Steps:
        """Wait for the messages ``eff`` asks for; return them (a list)."""
        raise NotImplementedError

    def sleep(self, node: int, until: float) -> Steps:
        """Resume at ``until`` on the run's clock, taking in messages meanwhile."""
        raise NotImplementedError

    def compute(self, node: int, eff: Train | Compute) -> Steps:
        """Run a training or a local statistic, charging its time; return its result."""
        raise NotImplementedError

    def resume(self, node: int, gen: Behaviour, value: Any) -> Effect:
        """The behaviour's next effect, given the last one's result."""
        return gen.send(value)

    def before(self, node: int, eff: Effect) -> Steps:
        """What happens before ``node`` carries out ``eff`` (a crash, an offline pause)."""
        yield from ()

    # -- the same in every runtime -------------------------------------------------------
    def drive(self, node: int, gen: Behaviour) -> Steps:
        """Run ``node``'s behaviour to its end, carrying out each effect it yields."""
        value: Any = None
        try:
            while True:
                try:
                    eff = self.resume(node, gen, value)
                except StopIteration:
                    return
                value = None
                yield from self.before(node, eff)
                if isinstance(eff, Send):
                    self.send(node, eff)
                elif isinstance(eff, Recv):
                    value = yield from self.recv(node, eff)
                elif isinstance(eff, Train | Compute):
                    value = yield from self.compute(node, eff)
                elif isinstance(eff, Wait):
                    if eff.until > self.clock:
                        yield from self.sleep(node, eff.until)
                else:
                    value = self.instant(node, eff)
        finally:
            self.servers.pop(node, None)

    def instant(self, node: int, eff: Effect) -> Any:
        """Carry out an effect that takes no time on the run's clock; return its result."""
        if isinstance(eff, Finish):
            self.finals[node] = eff
            self.bar.finished(len(self.finals), self.nodes)
            return None
        if isinstance(eff, Now):
            return self.clock
        if isinstance(eff, Neighbours):
            return self.neighbours(node, eff)
        if isinstance(eff, Evaluate):
            self.bar.reached(eff.round)
            if self.keep_latest:
                self.latest[node] = eff.state
                self.round_seen = max(self.round_seen, eff.round)
        elif isinstance(eff, Serve):
            if eff.handler is None:
                self.servers.pop(node, None)
            else:
                self.servers[node] = eff
            return None
        return self.worker.perform(node, eff, self.clock)[0]

    def trained(self, result: Any) -> None:
        """Count a finished training's samples (``stop.samples``)."""
        self.samples += result.train_samples

    def stopped_finals(self, nodes: list[int]) -> None:
        """The run was stopped (``stop:``): each of ``nodes`` that has not finished keeps
        the model it last evaluated; the server's is the run's output."""
        server = self.topology.server
        for node in nodes:
            if node not in self.finals:
                self.finals[node] = Finish(self.latest.get(node), output=node == server)

    def neighbours(self, node: int, eff: Neighbours) -> list[int]:
        """The neighbours ``node`` believes reachable now (the network's view, if any)."""
        if self.network is None:
            return self.topology.neighbours(node)
        return self.network.neighbours(node, eff.round, self.clock, eff.incoming)

    def serves(self, node: int, msg: Message) -> bool:
        """Whether a message arriving at ``node`` goes to its handler; if so, run it."""
        server = self.servers.get(node)
        if server is None or server.handler is None or msg.kind not in server.kinds:
            return False
        handler = server.handler(msg)
        value: Any = None
        for _ in range(1_000_000):  # bounded: a handler answers, it does not loop for ever
            try:
                eff = handler.send(value)
            except StopIteration:
                return True
            if isinstance(eff, Send):
                self.send(node, eff)
                value = None
            elif isinstance(eff, Log | Now | Neighbours):
                value = self.instant(node, eff)
            else:
                raise RunError(
                    f"{self.topology.name(node)}'s handler yielded {type(eff).__name__}; a "
                    "handler may only Send, Log, Now or Neighbours"
                )
        raise RunError(f"{self.topology.name(node)}'s handler yielded 1,000,000 effects")


def run_blocking(steps: Steps) -> Any:
    """Run a runtime's steps that block instead of yielding (over sockets); return the value."""
    try:
        while True:
            next(steps)
            raise AssertionError("a blocking runtime's step yielded")  # pragma: no cover
    except StopIteration as stop:
        return stop.value
