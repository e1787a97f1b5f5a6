"""Could each rank order its own events as one process does? SimPy's order as a causal key.

Issue 38 asks for a population sharded across ranks in which each rank simulates only its
own peers' events, the ranks advancing in windows as long as the smallest link latency (the
lookahead of a conservative scheme), with outputs byte-identical to one process. SimPy
processes events by (time, priority, insertion counter), the counter global to the process,
and in a synchronous method almost every event shares its instant with others. This script
checks, on shipped experiments run in one process, that the *causal key*

    key(e) = (time, priority, key(p), i)

orders every event exactly as SimPy does; ``p`` is the event being processed when ``e`` was
scheduled, or the one processed last (as when the runtime wakes its listeners at a run's
end, between two events), and ``i`` the number of events scheduled since ``p`` was taken
before ``e``; an event scheduled at set-up, before any is processed, is ``(time, priority,
(), its index among those)``. A rank
can compute that key for its own events, given the keys that come with the messages it
receives: ``--shard-events`` (``p2pfl/runtime/windows.py``) orders each rank's events so
(docs/performance.md, "Sharding the events"). It also measures what such a scheme would synchronize:
its windows, the events pending at each window's start (keys to rename there, so that they
stay short), the longest causal chain, and the messages between peers of different ranks.

    OMP_NUM_THREADS=1 python benchmarks/causal_order.py [EXPERIMENT ...] [--peers N]
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
import tempfile
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import simpy
from simpy.core import EmptySchedule

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, report  # noqa: E402

import p2pfl  # noqa: E402
from p2pfl.runtime import sim  # noqa: E402
from p2pfl.runtime.ranks import Ranks  # noqa: E402
from p2pfl.runtime.uplinks import InFlight  # noqa: E402

EXPERIMENTS = [
    "quickstart",
    "fedavg-fmnist",
    "fedbuff-straggler",
    "population-dfedavgm",
    "population-gossip",
]
"""Shipped experiments that are not sweeps: FedAvg on a star of 10 peers (digits and
Fashion-MNIST), FedBuff's asynchronous server, and the two large populations (DFedAvgM on a
ring, gossip on a random regular graph; ``--peers`` sets their size)."""

Key = tuple[Any, ...]


class Recorder:
    """What one run's events show: each event's key checked against the one processed
    before it, the event times and queue lengths (for the windows), the causal depth, and
    the messages that would cross between ranks."""

    def __init__(self) -> None:
        self.keys: dict[int, tuple[Key, int]] = {}  # SimPy's counter -> (key, depth)
        self.active: tuple[Key, int] | None = None  # the event being or last processed
        self.children = 0  # events scheduled since it was taken
        self.roots = 0  # events scheduled at set-up
        self.events = self.out_of_order = self.same_instant = self.depth = 0
        self.times = array("d")
        self.queued = array("l")  # the queue's length when each event was taken
        self.depths = array("l")
        self.crossing = {2: 0, 4: 0}
        self.latency = math.inf

    def schedule(self, env: simpy.Environment, event: simpy.Event, priority: int, delay: float):
        count = next(env._eid)  # type: ignore[attr-defined]
        at = env._now + delay  # type: ignore[attr-defined]
        if self.active is None:
            key, depth = (at, int(priority), (), self.roots), 0
            self.roots += 1
        else:
            parent, above = self.active
            key, depth = (at, int(priority), parent, self.children), above + 1
            self.children += 1
        self.keys[count] = (key, depth)
        heapq.heappush(env._queue, (at, priority, count, event))  # type: ignore[attr-defined]

    def step(self, env: simpy.Environment) -> None:
        """SimPy's ``Environment.step`` (simpy 4; the runtime never stops SimPy with
        ``StopSimulation``), with the key of each event checked."""
        queue = env._queue  # type: ignore[attr-defined]
        try:
            env._now, _, count, event = heapq.heappop(queue)  # type: ignore[attr-defined]
        except IndexError:
            raise EmptySchedule from None
        key, depth = self.keys.pop(count)
        if self.active is not None:
            last = self.active[0]
            self.out_of_order += not last < key
            self.same_instant += last[:2] == key[:2]
        self.events += 1
        self.depth = max(self.depth, depth)
        self.times.append(key[0])
        self.queued.append(len(queue) + 1)
        self.depths.append(depth)
        self.active, self.children = (key, depth), 0
        callbacks, event.callbacks = event.callbacks, None
        for callback in callbacks:
            callback(event)
        if not event._ok and not hasattr(event, "_defused"):
            raise type(event._value)(*event._value.args) from event._value

    def windows(self) -> tuple[int, list[int], int]:
        """The conservative scheme's windows ([T, T + lookahead), T the first event not yet
        processed): their number, the events pending at each one's start, and the longest
        causal chain within one."""
        starts: list[int] = []
        end, within, base = -math.inf, 0, 0
        for i, t in enumerate(self.times):
            if t >= end:
                starts.append(self.queued[i])
                end, base = t + self.latency, self.depths[i]
            within = max(within, self.depths[i] - base)
        return len(starts), starts, within


@contextmanager
def recording() -> Iterator[Recorder]:
    """SimPy and the simulation runtime patched to record, for the runs inside."""
    rec = Recorder()
    saved = simpy.Environment.schedule, simpy.Environment.step, sim.SimRuntime._arrive
    arrive = saved[2]
    splits = [Ranks(0, world) for world in rec.crossing]  # --shard's blocks, without joining

    def schedule(env: simpy.Environment, event: simpy.Event, priority: int = 1, delay: float = 0):
        rec.schedule(env, event, priority, delay)

    def step(env: simpy.Environment) -> None:
        rec.step(env)

    def land(runtime: sim.SimRuntime, item: InFlight) -> None:
        peers, src, dst = runtime.topology.num_peers, item.msg.src, item.msg.dst
        for ranks in splits:
            rec.crossing[ranks.world] += ranks.owner(src, peers) != ranks.owner(dst, peers)
        rec.latency = min(rec.latency, item.link.latency_s)
        arrive(runtime, item)

    simpy.Environment.schedule = schedule  # type: ignore[method-assign]
    simpy.Environment.step = step  # type: ignore[method-assign]
    sim.SimRuntime._arrive = land  # type: ignore[method-assign]
    try:
        yield rec
    finally:
        simpy.Environment.schedule, simpy.Environment.step, sim.SimRuntime._arrive = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", nargs="*", default=EXPERIMENTS)
    parser.add_argument("--peers", type=int, default=10000, help="the populations' size")
    args = parser.parse_args()
    rows: list[list[Any]] = []
    for name in args.experiments:
        path = ROOT / "experiments" / f"{name}.yaml"
        sets = {"peers__count": args.peers} if name.startswith("population") else {}
        with tempfile.TemporaryDirectory() as tmp, recording() as rec:
            p2pfl.run(path, out=Path(tmp) / "run", **sets)
        count, pending, within = rec.windows()
        rows.append([
            name, rec.events, rec.out_of_order, round(100 * rec.same_instant / rec.events, 2),
            rec.latency, count, round(sum(pending) / count), max(pending), rec.depth, within,
            rec.crossing[2], rec.crossing[4],
        ])  # fmt: skip
        print(f"{name}: {rec.events} events, {rec.out_of_order} out of order", flush=True)
    columns = [
        "experiment", "events", "out of order", "same instant %", "lookahead s", "windows",
        "pending mean", "pending max", "depth", "depth in window", "cross 2", "cross 4",
    ]  # fmt: skip
    report("causal_order", columns, rows, {"peers": args.peers})


if __name__ == "__main__":
    main()
