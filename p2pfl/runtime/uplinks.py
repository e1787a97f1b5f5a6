"""How the messages a peer sends share its uplink in simulated time (``peers.uplink``).

A message handed to the network waits on its sender's uplink, leaves it after its transfer
time (8·bytes / the link's bandwidth), then arrives ``latency_s`` (plus its jitter) later:

- :class:`FifoUplinks` (``fifo``): one transfer at a time, in the order they were sent.
- :class:`SharedUplinks` (``shared``): the transfers under way share the uplink equally
  (processor sharing: each moves at its link's bandwidth / their number), as TCP flows leaving
  one shaped link do (docs/calibration.md).

A transfer is a few timeouts with callbacks, not a SimPy process per message: the same
simulated times at a tenth of the cost.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import simpy

from p2pfl.network.message import Message
from p2pfl.network.topology import Link


class InFlight(NamedTuple):
    """A message on its way: what the receiver decodes, the frame's size, when it was sent,
    its link, whether the link loses it, and its latency jitter."""

    msg: Message
    size: int
    sent: float
    link: Link
    lost: bool
    jitter: float


class Uplinks:
    """Every sender's uplink; ``arrive`` is called with each message when it arrives."""

    def __init__(
        self,
        env: simpy.Environment,
        nodes: list[int],
        arrive: Callable[[InFlight], None],
        idle: Callable[[simpy.Event], simpy.Event],
        away: Callable[[InFlight, float], bool],
    ) -> None:
        self.env = env
        self.arrive = arrive
        self.away = away  # takes a message whose receiver another rank runs (--shard-events)
        self.idle = idle  # marks a timer that can change nothing once the run is over
        self.queue: dict[int, deque[InFlight]] = {n: deque() for n in nodes}  # head in transfer

    def put(self, src: int, item: InFlight) -> None:
        """Hand a message to ``src``'s uplink."""
        raise NotImplementedError

    def _land(self, item: InFlight) -> None:
        """Its last bit has left: it arrives ``latency_s`` (plus jitter) later."""
        delay = item.link.latency_s + item.jitter
        if self.away(item, delay):
            return
        arrival = self.env.timeout(delay)
        arrival.callbacks.append(lambda _: self.arrive(item))


class FifoUplinks(Uplinks):
    """One transfer at a time per uplink, in order: each holds it for its transfer time from
    the moment it frees."""

    def put(self, src: int, item: InFlight) -> None:
        queue = self.queue[src]
        queue.append(item)
        if len(queue) == 1:
            self._transmit(src)

    def _transmit(self, src: int) -> None:
        head = self.queue[src][0]
        done = self.env.timeout(head.link.transfer_s(head.size))
        done.callbacks.append(lambda _: self._transmitted(src))

    def _transmitted(self, src: int) -> None:
        self._land(self.queue[src].popleft())
        if self.queue[src]:
            self._transmit(src)


class SharedUplinks(Uplinks):
    """The transfers under way on an uplink share it equally; one timer per uplink, for the
    next transfer to finish (re-armed, and the old one ignored, whenever one starts or ends)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # each transfer's bits still to send (in the order of the queue), and when counted
        self.left: dict[int, list[float]] = {n: [] for n in self.queue}
        self.counted: dict[int, float] = {n: 0.0 for n in self.queue}
        self.armed: dict[int, simpy.Event] = {}  # each uplink's live timer

    def put(self, src: int, item: InFlight) -> None:
        self._count(src)
        self.queue[src].append(item)
        self.left[src].append(8.0 * item.size)
        self._next_done(src)

    def _count(self, src: int) -> None:
        """Take off each transfer's bits sent since they were last counted."""
        now, left = self.env.now, self.left[src]
        share = (now - self.counted[src]) / max(len(left), 1)
        for i, item in enumerate(self.queue[src]):
            left[i] -= share * item.link.bandwidth_bps
        self.counted[src] = now

    def _next_done(self, src: int) -> None:
        """Arm the uplink's timer for the transfer that will finish first."""
        stale = self.armed.pop(src, None)
        if stale is not None and not stale.processed:
            self.idle(stale)  # re-armed: the old timer will be ignored
        if not self.left[src]:
            return
        k = len(self.left[src])
        due = min(
            max(bits, 0.0) * k / item.link.bandwidth_bps
            for bits, item in zip(self.left[src], self.queue[src], strict=True)
        )
        timer = self.armed[src] = self.env.timeout(due)
        timer.callbacks.append(lambda ev: self._done(src, ev))

    def _done(self, src: int, timer: simpy.Event) -> None:
        """The uplink's timer: the transfers whose last bit has left arrive ``latency_s`` later."""
        if self.armed.get(src) is not timer:  # a timer re-armed since
            return
        self._count(src)
        left, queue, now = self.left[src], self.queue[src], self.env.now
        # done: the bits left are rounding, or too few to move the clock (late in a long
        # run, a float step of it is worth more bits than the first test allows)
        done = [i for i, (bits, item) in enumerate(zip(left, queue, strict=True))
                if bits <= 1e-9 * 8.0 * item.size
                or now + bits * len(left) / item.link.bandwidth_bps == now]  # fmt: skip
        for i in done:  # in the order they were sent
            self._land(queue[i])
        for i in reversed(done):
            del queue[i], left[i]
        self._next_done(src)
