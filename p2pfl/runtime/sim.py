"""The simulation runtime: method behaviours as SimPy processes on one shared clock.

- ``Send`` passes the message through the wire format's choke point (``wire.deliver``:
  the frame's exact size, and what the receiver decodes from it; the frame itself is only
  built when a codec packs the message), queues it on the sender's uplink (one transfer
  at a time, FIFO), holds the uplink for 8·bytes/bandwidth seconds, then the message
  arrives ``latency_s`` later and is recorded in the ledger.
- ``Recv`` blocks until enough matching messages are in the node's mailbox; arrivals are
  counted against the waiting ``Recv``, so a node wakes once, when it has them all.
- ``Train`` and ``Compute`` advance the node's clock by their modelled (or measured) time.
  With ``peers.batched``, trainings overlapping in simulated time run as one batched call
  (:mod:`p2pfl.runtime.train_batcher`); the clock and the event order are unchanged.
- ``Evaluate``, ``Report``, ``Artifact``, ``Log`` and ``Finish`` take no simulated time.

Event order is deterministic, so the same config and seed replay bit for bit. If every
process is blocked while some node still waits, the run fails naming who waits for what.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Generator
from typing import Any

import simpy

from p2pfl.core.errors import RunError
from p2pfl.methods.effects import Behaviour, Finish, Recv, Send, Train
from p2pfl.network.codecs import Compression, choose
from p2pfl.network.ledger import Ledger
from p2pfl.network.message import Message
from p2pfl.network.topology import Link, Topology
from p2pfl.network.wire import deliver
from p2pfl.runtime.mailbox import describe, matches, take
from p2pfl.runtime.train_batcher import TrainBatcher
from p2pfl.runtime.worker import Worker


class SimRuntime:
    """Runs one behaviour per node on a SimPy clock with the topology's link model."""

    def __init__(
        self,
        topology: Topology,
        worker: Worker,
        ledger: Ledger,
        compression: Compression | None = None,
    ) -> None:
        self.env = simpy.Environment()
        self.compression = compression
        self.topology = topology
        self.worker = worker
        self.ledger = ledger
        nodes = list(topology.graph.nodes)
        self.inbox: dict[int, list[Message]] = {n: [] for n in nodes}
        self.wakeup: dict[int, simpy.Event] = {}
        self.missing: dict[int, int] = {}  # matching messages a waiting node still lacks
        # each sender's uplink: (message, frame size, send time, link), the head in transfer
        self.uplink: dict[int, deque[tuple[Message, int, float, Link]]] = {
            n: deque() for n in nodes
        }
        self.waiting: dict[int, Recv] = {}
        self.finals: dict[int, Finish] = {}
        self.batcher = TrainBatcher(self.env, worker)

    def run(self, behaviours: dict[int, Behaviour]) -> dict[int, Finish]:
        """Drive every node's behaviour to its end; return each node's ``Finish``."""
        for node, gen in behaviours.items():
            self.env.process(self._drive(node, gen))
        # Objects made before the run (torch, the data) stay out of the cyclic collector's
        # scans while it runs: a full collection over them costs 0.1-0.3 s each time.
        gc.freeze()
        try:
            self.env.run()
        finally:
            gc.unfreeze()
        stuck = sorted(set(behaviours) - set(self.finals))
        if stuck:
            what = "; ".join(
                f"{self.topology.name(n)} waits for {self._describe(n)}" for n in stuck
            )
            raise RunError(f"deadlock: {what}")  # the caller adds the time
        return self.finals

    @property
    def now(self) -> float:
        return self.env.now

    def _describe(self, node: int) -> str:
        recv = self.waiting.get(node)
        if recv is None:
            return "nothing (it ended without Finish)"
        return describe(recv, self.topology.name)

    def _drive(self, node: int, gen: Behaviour) -> Generator[simpy.Event, Any, None]:
        value: Any = None
        while True:
            try:
                eff = gen.send(value)
            except StopIteration:
                return
            value = None
            if isinstance(eff, Send):
                self._send(node, eff)
            elif isinstance(eff, Recv):
                value = yield from self._recv(node, eff)
            elif isinstance(eff, Finish):
                self.finals[node] = eff
            elif (
                isinstance(eff, Train)
                and (seconds := self.worker.batchable_seconds(node, eff)) is not None
            ):
                value = yield from self.batcher.train(node, eff, seconds)
            else:
                value, seconds = self.worker.perform(node, eff, self.env.now)
                if seconds:
                    yield self.env.timeout(seconds)

    def _recv(self, node: int, recv: Recv) -> Generator[simpy.Event, Any, list[Message]]:
        """Take the messages ``recv`` asks for, waiting (once) until they have all arrived."""
        got = take(self.inbox[node], recv)
        if got is None:
            self.waiting[node] = recv
            self.missing[node] = recv.count - sum(matches(recv, m) for m in self.inbox[node])
            self.wakeup[node] = self.env.event()
            yield self.wakeup[node]
            del self.waiting[node]
            got = take(self.inbox[node], recv)
            assert got is not None
        return got

    def _send(self, src: int, eff: Send) -> None:
        if not self.topology.graph.has_edge(src, eff.dst):
            raise RunError(
                f"{self.topology.name(src)} sent to {self.topology.name(eff.dst)}, "
                "which is not its neighbour"
            )
        msg = Message(eff.kind, src, eff.dst, eff.round, eff.tensors, eff.meta)
        received, size = deliver(msg, choose(self.compression, eff.kind, eff.codec))
        queue = self.uplink[src]
        queue.append((received, size, self.env.now, self.topology.link(src, eff.dst)))
        if len(queue) == 1:
            self._transmit(src)

    # A transfer is two timeouts with callbacks, not a SimPy process per message: the same
    # simulated times (uplink held for transfer_s from the moment it frees, then latency_s),
    # at a tenth of the cost.
    def _transmit(self, src: int) -> None:
        """Put the head of ``src``'s uplink queue on the wire."""
        _, size, _, link = self.uplink[src][0]
        done = self.env.timeout(link.transfer_s(size))
        done.callbacks.append(lambda _: self._transmitted(src))

    def _transmitted(self, src: int) -> None:
        """The head's last bit has left ``src``: it arrives ``latency_s`` later, and the
        uplink takes the next message."""
        msg, size, sent, link = self.uplink[src].popleft()
        arrival = self.env.timeout(link.latency_s)
        arrival.callbacks.append(lambda _: self._arrive(msg, size, sent))
        if self.uplink[src]:
            self._transmit(src)

    def _arrive(self, msg: Message, size: int, sent: float) -> None:
        src, dst = msg.src, msg.dst
        name = self.topology.name
        self.ledger.record(sent, msg.round, name(src), name(dst), msg.kind, size, self.env.now)
        self.inbox[dst].append(msg)
        recv = self.waiting.get(dst)
        if recv is not None and matches(recv, msg):
            self.missing[dst] -= 1
            if not self.missing[dst]:
                self.wakeup[dst].succeed()
