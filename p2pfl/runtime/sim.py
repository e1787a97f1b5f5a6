"""The simulation runtime: method behaviours as SimPy processes on one shared clock.

- ``Send`` passes the message through the wire format's choke point (``wire.deliver``:
  the frame's exact size, and what the receiver decodes from it; the frame itself is only
  built when a codec packs the message), queues it on the sender's uplink (one transfer
  at a time, FIFO), holds the uplink for 8·bytes/bandwidth seconds, then the message
  arrives ``latency_s`` later and is recorded in the ledger. With ``peers.uplink: shared``
  the transfers under way on an uplink share it equally instead (processor sharing: each
  moves at its link's bandwidth / their number), as TCP flows leaving one shaped link do.
- ``Recv`` blocks until enough matching messages are in the node's mailbox; arrivals are
  counted against the waiting ``Recv``, so a node wakes once, when it has them all.
- ``Train`` and ``Compute`` advance the node's clock by their modelled (or measured) time.
  With ``peers.batched``, trainings overlapping in simulated time run as one batched call
  (:mod:`p2pfl.runtime.train_batcher`); the clock and the event order are unchanged.
- ``Evaluate``, ``Report``, ``Artifact``, ``Log`` and ``Finish`` take no simulated time;
  ``Now`` reads the clock, ``Wait`` sleeps until a time, ``Neighbours`` asks the network.

With a ``network:`` section (:class:`p2pfl.network.dynamics.Network`) the network decides
each message's fate when it arrives (lost on its link, its receiver offline or crashed, a
partition between them) and only delivered ones reach the inbox; every one is in the
ledger. A node that is offline is paused: a ``Send``, ``Train`` or ``Compute`` it yields
waits until it is back (one already under way finishes; nothing reaches its inbox
meanwhile). A node that crashes stops at once, for good; a message it had already handed
to its uplink still goes out.

Event order is deterministic, so the same config and seed replay bit for bit. If every
process is blocked while some node still waits, the run fails naming who waits for what.
"""

from __future__ import annotations

import functools
import gc
import math
from collections.abc import Callable, Generator
from typing import Any

import simpy

from p2pfl.core.errors import RunError
from p2pfl.learning.state import average_states
from p2pfl.methods.effects import Behaviour, Compute, Effect, Finish, Recv, Send, Train
from p2pfl.network.codecs import Compression, choose
from p2pfl.network.dynamics import Network
from p2pfl.network.ledger import Ledger
from p2pfl.network.message import Message
from p2pfl.network.topology import Link, Topology
from p2pfl.network.wire import deliver
from p2pfl.runtime.interpreter import Interpreter
from p2pfl.runtime.mailbox import describe, matches, take
from p2pfl.runtime.setup import StopConfig
from p2pfl.runtime.shards import Shards
from p2pfl.runtime.train_batcher import TrainBatcher
from p2pfl.runtime.uplinks import FifoUplinks, InFlight, SharedUplinks, Uplinks
from p2pfl.runtime.windows import Key, Windows
from p2pfl.runtime.worker import Worker

FULL_RARER = 10
"""How many times rarer the cyclic collector's full collections are while a simulation
runs (its third threshold multiplied): 10⁴ DFedAvgM peers spent 0.9 s collecting instead of
2.4-2.8 s, at the same peak memory."""


def _summed(counts: list[dict[str, int]]) -> dict[str, int] | None:
    """Counts by fate added up; ``None`` for none."""
    if not counts:
        return None
    out: dict[str, int] = {}
    for c in counts:
        for fate, k in c.items():
            out[fate] = out.get(fate, 0) + k
    return out


def _why(fates: dict[str, int] | None) -> str:
    """Why a network that misbehaves may have left nodes waiting: a wait without a deadline
    lasts until every message it counts on comes, and some never will (``fates``: what
    became of the messages to such waits, as :meth:`SimRuntime._fates` counts them)."""
    if fates is None:
        return ""
    told = ", ".join(f"{k} {fate}" for fate, k in sorted(fates.items())) or "none"
    return (
        " (with a network: section a wait without a deadline can last for ever: a message "
        "lost, sent while its receiver was offline, or never sent by a peer that took its "
        f"receiver for offline; undelivered to the waiting, over the run: {told}; give the "
        "algorithm its deadline, e.g. wait_s or deadline_s)"
    )


class SimRuntime(Interpreter):
    """Runs one behaviour per node on a SimPy clock with the topology's link model."""

    def __init__(
        self,
        topology: Topology,
        worker: Worker,
        ledger: Ledger,
        compression: Compression | None = None,
        network: Network | None = None,
        uplink: str = "fifo",
        stop: StopConfig | None = None,
        probe_s: float | None = None,
        shards: Shards | None = None,
        windows: Windows | None = None,
    ) -> None:
        super().__init__()
        self.windows = windows  # with ``--shard-events``: this rank's share of the events
        self.env = simpy.Environment() if windows is None else windows.env
        self.network = network
        self.gone: set[int] = set()  # crashed, or offline for good (a trace that ends down)
        self.end = 0.0  # when the last node ended or the last message landed
        self.done = False
        self.compression = compression
        self.topology = topology
        self.worker = worker
        self.ledger = ledger
        nodes = list(topology.graph.nodes)
        self.inbox: dict[int, list[Message]] = {n: [] for n in nodes}
        self.wakeup: dict[int, simpy.Event] = {}
        self.links: dict[tuple[int, int], Link] = {}  # the topology's, as senders use them
        self.missing: dict[int, int] = {}  # matching messages a waiting node still lacks
        self.waiting: dict[int, Recv] = {}
        self.dropped: dict[int, dict[str, int]] = {}  # per receiver: undelivered, by fate
        # what tells the end of the run: nodes still running, those of them listening
        # "until the end", and timers in SimPy's queue that can change nothing then (a
        # receive's deadline after it was met, a stale shared-uplink timer, a crash time)
        self.alive = 0
        self.listening = 0
        self.inert = 0
        kind = SharedUplinks if uplink == "shared" else FifoUplinks
        self.uplinks: Uplinks = kind(self.env, nodes, self._arrive, self._idle, self._away)
        self.batcher = TrainBatcher(self.env, worker)
        self.stop = stop
        self.probe_s = probe_s
        self.keep_latest = stop is not None or probe_s is not None
        self.halted: str | None = None  # why a stop: section ended the run
        self.shards = shards  # with ``--shard``: the messages that cross ranks
        # --shard-events: when each wait began (the event's key, and how many waits that
        # event had begun before), and the last such pair
        self.began: dict[int, tuple[Key, int]] = {}
        self._begun: tuple[Key, int] = ((), 0)

    def run(self, behaviours: dict[int, Behaviour]) -> dict[int, Finish]:
        """Drive every node's behaviour to its end; return each node's ``Finish``
        (``--shard-events``: ``behaviours`` and the result hold this rank's nodes)."""
        first, roots = self._first_events() if self.windows is not None else ({}, 0)
        for node, gen in behaviours.items():
            if self.windows is not None:  # numbered among every rank's, as in one process
                self.windows.env.children = first[node]
            process = self.env.process(self._drive(node, gen))
            crash = self.network.crash_at.get(node) if self.network else None
            if crash is not None:
                self._idle(self.env.timeout(crash)).callbacks.append(self._crasher(process, node))
        self.alive = self.nodes = len(behaviours)
        if self.windows is not None:  # after every node's, as in one process
            self.windows.env.children = roots
        if self.stop is not None and self.stop.time_s is not None:
            timer = self._idle(self.env.timeout(self.stop.time_s))
            timer.callbacks.append(lambda _: self._halt("time_s"))
            if self.windows is not None:
                self.windows.stop_key = self.windows.env.scheduled
        if self.windows is not None and self.stop is not None and self.stop.samples is not None:
            self.windows.budget = self.stop.samples
            self.windows.shortest = self.worker.shortest_training()
        if self.probe_s is not None:
            self._probe_at(1)
        # Objects made before the run (torch, the data) stay out of the cyclic collector's
        # scans while it runs: a full collection over them costs 0.1-0.3 s each time. And
        # full collections come FULL_RARER times rarer: over the peers' own objects they
        # still took 1.8-2.0 of a 10^4-peer DFedAvgM run's 2.4-2.8 s of collecting.
        thresholds = gc.get_threshold()
        gc.set_threshold(*thresholds[:2], thresholds[2] * FULL_RARER)
        gc.freeze()
        try:
            if self.windows is not None:
                self._run_windows()
            else:
                self._run_until_quiet()
            for _ in range(
                0 if self.halted or self.windows else 10 * len(behaviours)
            ):  # bounded: each pass ends a listener's wait
                listeners = [n for n, r in self.waiting.items() if r.deadline == math.inf]
                if not listeners:
                    break
                for n in listeners:  # the run is over: a receive "until the end" returns now
                    self.wakeup[n].succeed()
                self._run_until_quiet()
        finally:
            gc.unfreeze()
            gc.set_threshold(*thresholds)
        self.done = True  # a run that failed keeps its clock at the failure
        if self.halted:
            self.stopped_finals(sorted(set(behaviours) - self.gone))
        if self.windows is not None and self.stop is not None:  # each rank counted its own
            self.samples = self.windows.total(self.samples)
        stuck = sorted(set(behaviours) - set(self.finals) - self.gone)
        waits = [f"{self.topology.name(n)} waits for {self._describe(n)}" for n in stuck]
        fates = self._fates(stuck)
        if self.windows is not None:  # every rank's, in rank order (each rank's in node order)
            self.end = self.windows.maximum(self.end)
            told = self.windows.gather([waits, fates])
            waits = [w for ws, _ in told for w in ws]
            fates = _summed([f for _, f in told if f is not None])
        if waits:  # the caller adds the time
            raise RunError(f"deadlock: {'; '.join(waits)}{_why(fates)}")
        return self.finals

    def _first_events(self) -> tuple[dict[int, int], int]:
        """Where each node's events start among those one process schedules at set-up (its
        start, then its crash time if it has one, node after node), and how many they are."""
        first, roots = {}, 0
        for n in self.topology.graph.nodes:
            first[n] = roots
            roots += 2 if self.network and n in self.network.crash_at else 1
        return first, roots

    def _run_windows(self) -> None:
        """``--shard-events``: run the windows until every rank is quiet, then wake the
        listeners of every rank in the order they began to wait, after the last event of
        all (as one process does), until none is left."""
        assert self.windows is not None
        windows = self.windows
        halted = lambda: self.halted is not None  # noqa: E731
        advance = functools.partial(
            windows.advance, self._quiet, self._arrive, halted, lambda: self.samples,
            lambda: self._halt("samples"),
        )  # fmt: skip
        last, children = advance()
        for _ in range(10 * self.topology.graph.number_of_nodes()):  # bounded, as run's
            if self.halted:
                return
            mine = [(*self.began[n], n) for n, r in self.waiting.items() if r.deadline == math.inf]
            listeners = windows.listeners(mine)
            if not listeners:
                return
            for i, n in enumerate(listeners):
                if windows.mine(n):
                    windows.env.after(last, children + i)
                    self.wakeup[n].succeed()
            last, children = advance()

    def _quiet(self) -> bool:
        """Whether nothing else can happen here: every running node listens "until the
        end" and only idle timers are left."""
        return self.listening == self.alive and len(self.env._queue) == self.inert

    def _run_until_quiet(self) -> None:
        """Run until nothing else can happen: every running node listens "until the end" and
        only idle timers are left (run out, they would move the listeners' end to theirs, and
        a crash time after the end would take a listener's final model)."""
        env, queue = self.env, self.env._queue  # SimPy's event heap: its length is all we read
        while queue and not self._quiet():
            env.step()
            if self.halted:
                return

    def _halt(self, reason: str) -> None:
        """End the run now (a ``stop:`` condition was met, ``reason`` its key)."""
        if self.halted is None:
            self.halted = reason
            self.end = self.env.now

    def _probe_at(self, k: int) -> None:
        """Score the run's model at ``k·eval.every_s`` (``metrics.csv``'s ``run`` rows), and
        stop the run if it reached ``stop.accuracy``; an idle timer, so a run that is over
        ends without waiting for it."""
        assert self.probe_s is not None
        timer = self._idle(self.env.timeout(k * self.probe_s - self.env.now))
        if self.windows is not None:  # every rank takes it together
            self.windows.barrier = self.windows.env.scheduled

        def probe(_: simpy.Event) -> None:
            acc = self._probe()
            target = self.stop.accuracy if self.stop is not None else None
            if target is not None and acc is not None and acc >= target:
                self._halt("accuracy")
            self._probe_at(k + 1)

        timer.callbacks.append(probe)

    def _probe(self) -> float | None:
        """Score the run's model now: the server's, else the mean of the peers' (each as it
        last evaluated it); its accuracy, ``None`` before any has one."""
        server = self.topology.server
        latest = None if server is None else self.latest.get(server)
        held = [] if server is not None else [
            (p, s)
            for p in self.topology.peers
            if p not in self.gone and (s := self.latest.get(p)) is not None
        ]  # fmt: skip
        score = functools.partial(self.worker.probe, self.env.now)
        if self.windows is not None:  # this rank's peers; rank 0 scores
            return self.windows.probe(held, latest, self.round_seen, score)
        if server is not None:
            state = latest
        else:
            state = average_states([s for _, s in held]) if held else None
        return None if state is None else score(self.round_seen, state)

    def _idle(self, timer: simpy.Event) -> simpy.Event:
        """Count ``timer`` among the timers that change nothing once the run is over, until
        it fires."""
        self.inert += 1
        timer.callbacks.append(self._fired)
        return timer

    def _fired(self, _: simpy.Event) -> None:
        self.inert -= 1
        if self.windows is not None:
            self.windows.env.idle_step = True

    def _begin(self) -> tuple[Key, int]:
        """A wait's place in the order the waits began: the key of the event it began in,
        and how many waits that event had begun before it."""
        assert self.windows is not None
        active = self.windows.env.active
        key, seq = self._begun
        self._begun = (key, seq + 1) if key is active else (active, 0)
        return self._begun

    @property
    def now(self) -> float:
        """The clock; once the run is over, when the last node ended or the last message
        landed (timers still pending then — a deadline that was not needed, a crash after
        the end — do not count)."""
        return self.end if self.done else self.env.now

    def _crasher(self, process: simpy.Process, node: int) -> Callable[[simpy.Event], None]:
        """The callback that stops ``node`` at its crash time, if it is still running."""

        def crash(_: simpy.Event) -> None:
            if process.is_alive:
                self.gone.add(node)
                self.waiting.pop(node, None)
                process.interrupt("crash")

        return crash

    def _fates(self, stuck: list[int]) -> dict[str, int] | None:
        """With a ``network:`` section, what became of the messages to those of ``stuck``
        that wait without a deadline (undelivered, by fate); ``None`` when none does."""
        blind = [n for n in stuck if n in self.waiting and self.waiting[n].deadline is None]
        if self.network is None or not blind:
            return None
        return _summed([self.dropped.get(n, {}) for n in blind])

    def _describe(self, node: int) -> str:
        recv = self.waiting.get(node)
        if recv is None:
            return "nothing (it ended without Finish)"
        return describe(recv, self.topology.name)

    def _drive(self, node: int, gen: Behaviour) -> Generator[simpy.Event, Any, None]:
        try:
            yield from self.drive(node, gen)
        except simpy.Interrupt:
            gen.close()  # crashed: its state is gone with it
        self.end = max(self.end, self.env.now)
        self.alive -= 1

    @property
    def clock(self) -> float:
        return self.env.now

    def before(self, node: int, eff: Effect) -> Generator[simpy.Event, Any, None]:
        """An offline node's ``Send``, ``Train`` or ``Compute`` waits until it is back."""
        if (
            self.network is not None
            and isinstance(eff, (Send, Train, Compute))
            and not self.network.online(node, self.env.now)
        ):
            back = self.network.next_online(node, self.env.now)
            if back == math.inf:
                self.gone.add(node)
                self.alive -= 1  # it can do nothing more: the run may end without it
                try:
                    yield self.env.event()  # never fires; a crash timer may interrupt it
                finally:
                    self.alive += 1
            yield self.env.timeout(back - self.env.now)

    def sleep(self, node: int, until: float) -> Generator[simpy.Event, Any, None]:
        yield self.env.timeout(until - self.env.now)

    def compute(self, node: int, eff: Train | Compute) -> Generator[simpy.Event, Any, Any]:
        job = end = value = None
        if (
            isinstance(eff, Train)
            and (seconds := self.worker.batchable_seconds(node, eff)) is not None
        ):
            job, end = self.batcher.start(node, eff, seconds)
        else:
            value, seconds = self.worker.perform(node, eff, self.env.now)
            if seconds:
                end = self.env.timeout(seconds)
        if isinstance(eff, Train) and self.windows is not None and self.windows.budget is not None:
            env, samples = self.windows.env, self.worker.work(node, eff)[0]  # counted at its end
            key = env.active if end is None else env.scheduled
            self.windows.announce(self.topology.name(node), key, samples, end)
        if end is not None:
            yield end
        return self._trained(eff, value if job is None else self.batcher.result(job))

    def _trained(self, eff: Train | Compute, value: Any) -> Any:
        """Count a finished training's samples; stop the run at ``stop.samples``."""
        if isinstance(eff, Train) and self.stop is not None:
            self.trained(value)
            budget = self.stop.samples
            if budget is not None and self.samples >= budget and self.windows is None:
                self._halt("samples")  # over ranks, Windows halts every rank together
        return value

    def send(self, node: int, eff: Send) -> None:
        self._send(node, eff)

    def recv(self, node: int, eff: Recv) -> Generator[simpy.Event, Any, list[Message]]:
        got = yield from self._recv(node, eff)
        if self.shards is not None:
            self.shards.read(got)
        return got

    def _recv(self, node: int, recv: Recv) -> Generator[simpy.Event, Any, list[Message]]:
        """Take the messages ``recv`` asks for, waiting (once) until they have all arrived
        or its deadline passed."""
        got = take(self.inbox[node], recv)
        if got is None:
            if recv.deadline is not None and recv.deadline <= self.env.now:
                return take(self.inbox[node], recv, partial=True) or []
            self.waiting[node] = recv
            if self.windows is not None:
                self.began[node] = self._begin()
            self.missing[node] = recv.count - sum(matches(recv, m) for m in self.inbox[node])
            self.wakeup[node] = self.env.event()
            if recv.deadline is None:
                yield self.wakeup[node]
            elif recv.deadline == math.inf:  # woken by a message or by the run's end
                self.listening += 1
                try:
                    yield self.wakeup[node]
                finally:  # or crashed: no longer counted as listening either way
                    self.listening -= 1
            else:
                timer = self.env.timeout(recv.deadline - self.env.now)
                yield self.wakeup[node] | timer
                if not timer.processed:  # met before its deadline: the timer is idle now
                    self._idle(timer)
            del self.waiting[node]
            got = take(self.inbox[node], recv, partial=recv.deadline is not None)
            assert got is not None
        return got

    def _send(self, src: int, eff: Send) -> None:
        net, now = self.network, self.env.now
        if net is None or not net.changes_graph:
            self._link(src, eff.dst)  # a fixed graph: sending to a non-neighbour is an error
        msg = Message(eff.kind, src, eff.dst, eff.round, eff.tensors, eff.meta)
        received, size = deliver(msg, choose(self.compression, eff.kind, eff.codec))
        if self.shards is not None:
            received = self.shards.sent(received)
        if net is None:
            link, lost, jitter = self._link(src, eff.dst), False, 0.0
        else:
            fate, lost, jitter = net.departure(src, eff.dst, eff.round, now)
            if fate is not None:  # the graph changed under the sender: nothing leaves
                self._record(received, size, now, now, fate)
                return
            link = net.link(src, eff.dst)
        self.uplinks.put(src, InFlight(received, size, now, link, lost, jitter))

    def _link(self, src: int, dst: int) -> Link:
        """The topology's link from ``src`` to ``dst``, looked up in its graph once; a sender
        that names a node it has no link to is an error in its method."""
        link = self.links.get((src, dst))
        if link is None:
            try:
                link = self.links[src, dst] = self.topology.link(src, dst)
            except KeyError:
                name = self.topology.name
                raise RunError(
                    f"{name(src)} sent to {name(dst)}, which is not its neighbour"
                ) from None
        return link

    def _record(self, msg: Message, size: int, sent: float, at: float, fate: str) -> None:
        name = self.topology.name
        self.ledger.record(sent, msg.round, name(msg.src), name(msg.dst), msg.kind, size, at, fate)
        if fate != "delivered":
            dropped = self.dropped.setdefault(msg.dst, {})
            dropped[fate] = dropped.get(fate, 0) + 1

    def _away(self, item: InFlight, delay: float) -> bool:
        """``--shard-events``: a message for another rank's peer goes to that rank, with
        the key of its arrival ``delay`` from now (:mod:`p2pfl.runtime.windows`)."""
        windows = self.windows
        if windows is None or windows.mine(item.msg.dst):
            return False
        windows.outbox[windows.owner(item.msg.dst)].append((windows.env.reserve(delay), item))
        return True

    def _arrive(self, item: InFlight) -> None:
        msg, size, sent, lost = item.msg, item.size, item.sent, item.lost
        src, dst, now = msg.src, msg.dst, self.env.now
        self.end = max(self.end, now)
        if self.network is None:
            self._record(msg, size, sent, now, "delivered")
        else:
            fate = self.network.fate(src, dst, sent, now, lost)
            self._record(msg, size, sent, now, fate)
            if fate != "delivered":
                return
        if self.shards is not None and dst in self.servers:
            self.shards.read([msg])
        if self.serves(dst, msg):
            return
        self.inbox[dst].append(msg)
        recv = self.waiting.get(dst)
        if recv is not None and matches(recv, msg):
            self.missing[dst] -= 1
            if not self.missing[dst]:
                self.wakeup[dst].succeed()
