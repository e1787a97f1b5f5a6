"""A population whose *events* are sharded across ranks (``--shard-events``).

With ``--shard`` every rank still runs every node's behaviour (:mod:`p2pfl.runtime.shards`).
With ``--shard-events`` a rank runs only its own peers' behaviours, trainings and messages,
and the ranks advance in *windows* of simulated time, a conservative scheme whose lookahead
is the smallest link latency: a message sent at ``t`` arrives at ``t + latency`` or later, so
once every rank has processed its events before ``T``, none can receive one before
``T + lookahead`` that it has not been sent yet. Each window:

1. every rank says when its next event is (``inf`` when it is quiet: all its running nodes
   listen "until the end" and only idle timers are left), and the smallest is ``T``;
   ``T = inf`` on every rank is the run's end;
2. each rank processes its events before ``T + lookahead``;
3. the messages sent to another rank's peers travel to it, as frames of the wire format
   (nothing is pickled), and what each rank wrote (the rows of ``comm.csv`` and
   ``metrics.csv``, a ``Report``'s baseline, an ``Artifact``'s matrix) travels to rank 0,
   which writes it.

Outputs are byte-identical to one process, because SimPy's order is a key that a rank can
compute on its own (``benchmarks/causal_order.py`` checks it on shipped experiments): an
event scheduled while event ``p`` is processed, or after ``p`` was processed last, as the
``i``-th since ``p`` was taken, has the key ``(time, priority, key(p), i)``; a set-up event
has ``(time, priority, (), i)``. :class:`KeyedEnvironment` orders its queue by that key, a
message carries its arrival's key to its receiver's rank, and rank 0 writes the rows in
key order. The end of a run (every node listening "until the end" is woken, in the order
it began to wait) is computed from the keys the ranks gather.

A rank trains and scores only its own peers, as one process of fewer peers would; with
``peers.batched``, only where a peer's bits do not depend on what trains beside it
(:func:`p2pfl.learning.batched.divisible`). An ``output`` model (a chain's last peer) is
sent to rank 0; the run's model otherwise is the mean of every peer's, summed from rank to
rank as ``--shard`` sums it.

A ``network:`` section needs nothing more: churn and link faults draw from streams per peer
(a sender's rank draws whether a message is lost, which travels with it), crash times and
redrawn graphs from the seed, so the rank of a message's receiver decides its fate as one
process would. ``stop.time_s`` is a timer every rank holds with one key
(:meth:`Windows.advance`); an ``eval.every_s`` probe is a point no window runs past, which
every rank takes together (:meth:`Windows.probe`). Under ``stop.samples`` a window lasts at
most the shortest training of the ``train:`` section, so every training that ends in a
window was announced to every rank before it, and the ranks end together at the one where
every rank's count reaches the budget (:meth:`Windows._take`). What it refuses, before
anything runs (``p2pfl run``): ``eval.matching``, and a link between two ranks' peers
without latency (no lookahead).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import math
import struct
from array import array
from collections.abc import Callable
from typing import Any, cast

import simpy
import torch
import torch.distributed as dist
from simpy.core import EmptySchedule
from simpy.events import NORMAL

from p2pfl.core.errors import ConfigError, RunError
from p2pfl.learning.state import State, ghost
from p2pfl.methods.effects import Finish
from p2pfl.network.dynamics import Network
from p2pfl.network.ledger import Ledger
from p2pfl.network.message import Message
from p2pfl.network.topology import Topology
from p2pfl.network.wire import decode, encode
from p2pfl.reporting.reporters import Reporter
from p2pfl.runtime.ranks import Ranks
from p2pfl.runtime.shards import Shards
from p2pfl.runtime.uplinks import InFlight

Key = tuple[Any, ...]
"""An event's place in SimPy's order: ``(time, priority, parent's key, index)``."""

ROOT: Key = ()
"""The parent of the events scheduled at set-up."""


def order(key: Key) -> list[float]:
    """``key`` as numbers that sort as the key does (a key compares its time, priority,
    parent, then index): the times and priorities from the event up to its first ancestor,
    a mark below every time, then the indices from the first ancestor down."""
    head: list[float] = []
    tail: list[float] = []
    while key:
        head += (key[0], key[1])
        tail.append(key[3])
        key = key[2]
    return [*head, -math.inf, *reversed(tail)]


def key_of(numbers: list[float]) -> Key:
    """The key that :func:`order` gave ``numbers`` for (a message's arrival, received)."""
    mark = numbers.index(-math.inf)
    key: Key = ROOT
    for level, index in enumerate(numbers[mark + 1 :]):
        at = mark - 2 - 2 * level
        key = (numbers[at], int(numbers[at + 1]), key, int(index))
    return key


class KeyedEnvironment(simpy.Environment):
    """SimPy's environment with its queue ordered by the causal key instead of a counter
    global to the process: the same order, computed from each event's cause."""

    def __init__(self) -> None:
        super().__init__()
        self.active: Key = ROOT  # the event being processed, or processed last
        self.children = 0  # events scheduled since it was taken
        self.live: tuple[Key, int] = (ROOT, 0)  # the latest that was not an idle timer
        self.idle_step = False
        self.scheduled: Key = ROOT  # the key of the event scheduled last
        # SimPy's own queue, of (time, priority, key, event) instead of a counter's value
        self.queue: list[tuple[float, int, Key, simpy.Event]] = cast(Any, self._queue)

    def schedule(self, event: simpy.Event, priority: int = NORMAL, delay: float = 0) -> None:
        at = self._now + delay
        key = (at, int(priority), self.active, self.children)
        self.children += 1
        self.scheduled = key
        heapq.heappush(self.queue, (at, int(priority), key, event))

    def reserve(self, delay: float) -> Key:
        """The key of an event scheduled now, ``delay`` later, that another rank processes."""
        key = (self._now + delay, NORMAL, self.active, self.children)
        self.children += 1
        return key

    def insert(self, key: Key, callback: Callable[[simpy.Event], None]) -> None:
        """Queue an event of another rank's making, with its key."""
        event = simpy.Event(self)
        event._ok, event._value = True, None
        event.callbacks = [callback]
        heapq.heappush(self.queue, (key[0], key[1], key, event))

    def after(self, key: Key, children: int) -> None:
        """Schedule what follows as the events after ``key``'s ``children`` first ones
        (the run's end: its listeners woken after the last event of all ranks)."""
        self._now, self.active, self.children = key[0], key, children

    def step(self) -> None:
        try:
            self._now, _, key, event = heapq.heappop(self.queue)
        except IndexError:
            raise EmptySchedule from None
        self.active, self.children, self.idle_step = key, 0, False
        callbacks, event.callbacks = event.callbacks, None  # type: ignore[assignment]
        for callback in callbacks:
            callback(event)
        if not self.idle_step and key > self.live[0]:  # a crash put off ends earlier
            self.live = (key, self.children)
        if not event._ok and not hasattr(event, "_defused"):
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc


def _frames(msgs: list[Message]) -> bytes:
    """Messages as wire frames, each after its length."""
    return b"".join(struct.pack("<Q", len(f)) + f for f in map(encode, msgs))


def _unframes(data: memoryview) -> list[Message]:
    msgs, offset = [], 0
    while offset < len(data):
        (n,) = struct.unpack_from("<Q", data, offset)
        msgs.append(decode(bytearray(data[offset + 8 : offset + 8 + n])))
        offset += 8 + n
    return msgs


def _before(time: float, key: Key) -> bool:
    return key[0] < time


def _arrival(arrive: Callable[[InFlight], None], item: InFlight, _: simpy.Event) -> None:
    arrive(item)


def lookahead(topology: Topology, ranks: Ranks, network: Network | None = None) -> float:
    """The smallest latency of a link between peers of two ranks: the windows' length (a
    graph that changes may link any two peers, by its default link)."""
    owner = lambda n: ranks.owner(n, topology.num_peers)  # noqa: E731
    crossing = [
        topology.link(u, v).latency_s for u, v in topology.graph.edges if owner(u) != owner(v)
    ]
    if network is not None and network.changes_graph:
        crossing.append(topology.default_link.latency_s)
    least = min(crossing, default=math.inf)
    if least <= 0:
        raise ConfigError(
            "--shard-events",
            "a link between two ranks' peers has no latency: the ranks could not run ahead "
            "of each other (give links latency_s > 0, or leave out --shard-events)",
        )
    return least


class Windows:
    """The ranks' windows: which rank runs each node, the messages that cross between them,
    and the rows rank 0 writes in key order."""

    def __init__(
        self, ranks: Ranks, topology: Topology, network: Network | None, layout: State
    ) -> None:
        self.ranks = ranks
        self.rank, self.world = ranks.rank, ranks.world
        self.topology = topology
        self.link = topology.link if network is None else network.link
        self.lookahead = lookahead(topology, ranks, network)
        self.env = KeyedEnvironment()
        self.layout = ghost(layout)  # another rank's peer's model, as this rank sees it
        self.shards = Shards(ranks, topology.num_peers)  # the mean of every rank's peers
        self.barrier: Key | None = None  # the next probe (eval.every_s), every rank's
        self.budget: int | None = None  # stop.samples, a count over every rank's trainings
        self.stop_key: Key | None = None  # stop.time_s's timer, which every rank holds
        self.shortest = math.inf  # under stop.samples: the least training (a window at most)
        self.trainings: list[tuple[Key, int, simpy.Event]] = []  # this rank's, announced
        self._within: Callable[[Key], bool] | None = None  # the window under way, its keys
        self.outbox: list[list[tuple[Key, InFlight]]] = [[] for _ in range(self.world)]
        self.rows: list[tuple[Key, int, int, tuple[Any, ...]]] = []  # key, seq, file, row
        self._row_key: Key | None = None
        self._seq = 0
        self.writers: list[Callable[..., None]] = []  # what rank 0 writes the rows with

    def owner(self, node: int) -> int:
        return self.ranks.owner(node, self.topology.num_peers)

    def mine(self, node: int) -> bool:
        return self.owner(node) == self.rank

    # -- rows, written by rank 0 in key order ----------------------------------------------
    def writer(self, write: Callable[..., None]) -> Callable[..., None]:
        """A stand-in for ``write`` (``Ledger.record``, ``Reporter.log``, a worker's
        baseline or artifact) that keeps each row with the key of the event that wrote it;
        rank 0 calls ``write`` in key order. Every rank asks for its writers in one order."""
        which = len(self.writers)
        self.writers.append(write)

        def keep(*row: Any) -> None:
            key = self.env.active
            if key is not self._row_key:
                self._row_key, self._seq = key, 0
            self.rows.append((key, self._seq, which, row))
            self._seq += 1

        return keep

    # -- the window loop -------------------------------------------------------------------
    def advance(
        self,
        quiet: Callable[[], bool],
        arrive: Callable[[InFlight], None],
        halted: Callable[[], bool],
        trained: Callable[[], int],
        halt: Callable[[], None],
    ) -> tuple[Key, int]:
        """Run windows until every rank is quiet and no message is on its way; return the
        last event of all that was not an idle timer, and its children so far.

        One process stops at the first instant every node listens "until the end" with
        only idle timers left: it takes an idle timer (a listener's crash time) only while
        some node still has something to do. So a rank whose nodes all listen puts its
        timers off until it knows: until a message comes, or until the run's end, when it
        takes those before the last event of all.

        ``stop.time_s`` is a timer that every rank holds, with one key: the rank that takes
        it first ``halted()`` the run (so it was not over, and one process took every timer
        before it), and then every rank takes its events up to that timer, no further:
        what another rank sends arrives in a later window. ``stop.samples``: see
        :meth:`_take` (``trained``: this rank's count; ``halt`` ends its run)."""
        env, queue = self.env, self.env.queue
        take = functools.partial(self._take, quiet=quiet, halted=halted, trained=trained, halt=halt)
        while True:
            mine = -math.inf if halted() else math.inf if quiet() or not queue else queue[0][0]
            start = self._reduced(mine, dist.ReduceOp.MIN)
            if start in (math.inf, -math.inf):
                break
            probe = self.barrier
            if probe is not None and start >= probe[0]:
                self._probe_step(probe, take, quiet, arrive, halted)
                continue
            horizon = start + min(self.lookahead, self.shortest)
            if probe is not None:
                horizon = min(horizon, probe[0])
            take(functools.partial(_before, horizon))
            self._exchange(arrive)
        if start == -math.inf:
            while queue and not halted():
                env.step()
            self._exchange(arrive)
            return ROOT, 0
        last, children = self.last()
        while queue and queue[0][2] < last:
            env.step()
        return last, children

    def _take(
        self,
        within: Callable[[Key], bool],
        quiet: Callable[[], bool],
        halted: Callable[[], bool],
        trained: Callable[[], int],
        halt: Callable[[], None],
    ) -> None:
        """Take this rank's events of a window (``within``: their keys) until it is quiet
        or halted.

        Under ``stop.samples`` the run ends at the training, in key order over every rank,
        whose samples bring the count to the budget. The trainings that end in a window
        began before it and were announced (:meth:`announce`), so the ranks can tell where
        that may be (:meth:`_cut`): each takes its events before it, its rank takes it,
        and if the count of every rank's trainings taken reaches the budget (a crash can
        have ended one announced), every rank ends its run there, as one process would,
        the timers it put off before it taken."""
        env, queue = self.env, self.env.queue
        self._within = within
        while (cut := self._cut(within, trained)) is not None:
            while queue and queue[0][2] < cut and not quiet() and not halted():
                env.step()
            if queue and queue[0][2] == cut and not halted():
                env.step()
            if self.total(trained()) >= cast(int, self.budget):
                while queue and queue[0][2] < cut:
                    env.step()
                halt()
                break
        while queue and within(queue[0][2]) and not quiet() and not halted():
            env.step()
        self._within = None

    def announce(self, name: str, key: Key, samples: int, end: simpy.Event | None) -> None:
        """A training of this rank's began, under ``stop.samples``: its ``samples`` count
        toward the budget at the event ``key`` (``end``; ``None``: it ended at once). It
        must end after the window under way, which the other ranks run without knowing of
        it: a window lasts at most the run's shortest training (:attr:`shortest`)."""
        if not samples:
            return
        if end is None or (self._within is not None and self._within(key)):
            raise RunError(
                f"--shard-events: stop.samples counts every rank's trainings where they "
                f"end, so a window of the ranks lasts at most a training of the train: "
                f"section ({self.shortest:.3g} s), but {name} trained for "
                f"{key[0] - self.env.now:.3g} s (its method's overrides): use --shard"
            )
        self.trainings.append((key, samples, end))

    def _cut(self, within: Callable[[Key], bool], trained: Callable[[], int]) -> Key | None:
        """Where, in this window and before ``stop.time_s``'s timer, every rank's count
        would reach ``stop.samples`` if every training announced ended (``None``: nowhere,
        and always without a budget)."""
        if self.budget is None:
            return None
        self.trainings = [t for t in self.trainings if not t[2].processed]
        stop = self.stop_key
        ahead = [(k, n) for k, n, _ in self.trainings if within(k) and (stop is None or k < stop)]
        if self.total(trained() + sum(n for _, n in ahead)) < self.budget:
            return None  # one sum where no training in the window can reach it
        told = self.gather([trained(), [[order(k), n] for k, n in ahead]])
        count = sum(c for c, _ in told)
        for numbers, samples in sorted(t for _, ts in told for t in ts):
            count += samples
            if count >= self.budget:
                return key_of(numbers)
        return None

    def _probe_step(
        self,
        probe: Key,
        take: Callable[[Callable[[Key], bool]], None],
        quiet: Callable[[], bool],
        arrive: Callable[[InFlight], None],
        halted: Callable[[], bool],
    ) -> None:
        """A probe (``eval.every_s``) at the instant every rank has reached: each rank takes
        its events before it; then, unless the run ended there (every rank quiet, or one
        halted), every rank takes the probe, a collective (:meth:`probe`), with the timers
        it put off before it, as one process takes them while the run is live."""
        env, queue = self.env, self.env.queue
        take(lambda key: key < probe)
        self._exchange(arrive)
        mine = 2.0 if halted() else 0.0 if quiet() else 1.0
        if self._reduced(mine, dist.ReduceOp.MAX) == 1.0:  # live, and not halted
            while queue and queue[0][2] <= probe:
                env.step()

    def probe(
        self,
        held: list[tuple[int, State]],
        server: State | None,
        round_seen: int,
        score: Callable[[int, State], float],
    ) -> float | None:
        """The run's model at a probe, as one process takes it: the server's (rank 0's),
        else the mean of every rank's ``held`` peers' models, summed from rank to rank;
        rank 0 ``score``-s it. Its accuracy on every rank (``None`` before any model)."""
        round_ = int(self.maximum(round_seen))
        state = server if self.rank == 0 else None
        if self.topology.server is None:
            peers = [p for ps in self.gather([p for p, _ in held]) for p in ps]
            mine = dict(held)
            states = [(p, mine.get(p, self.layout)) for p in peers]
            state = self.shards.average(states) if states else None
        acc = score(round_, state) if self.rank == 0 and state is not None else -math.inf
        acc = self.maximum(acc)
        return None if acc == -math.inf else acc

    def finals(self, mine: dict[int, Finish]) -> dict[int, Finish]:
        """Every node's ``Finish``: this rank's, and a ghost of each other rank's (its
        model's layout, no bytes), as a sharded run's results expect; an ``output`` model
        (the run's result: a chain's last peer) travels to rank 0, which scores it."""
        told = self.gather([[n, f.state is not None, f.output] for n, f in mine.items()])
        shape = self.layout  # one for all: a ghost holds no bytes, and nothing writes it
        out: dict[int, Finish] = {}
        for rank, finishes in enumerate(told):
            for node, held, output in finishes:
                if rank == self.rank:
                    out[node] = mine[node]
                else:
                    out[node] = Finish(shape if held else None, output)
        results = [
            Message("model", n, 0, 0, f.state, {})
            for n, f in sorted(mine.items())
            if f.output and f.state is not None
        ]
        sent = [_frames(results) if r == 0 and self.rank else b"" for r in range(self.world)]
        for data in self._swap(sent):
            for msg in _unframes(data):
                out[msg.src] = Finish(msg.tensors, True)
        return dict(sorted(out.items()))

    def last(self) -> tuple[Key, int]:
        """The latest event that was not an idle timer, over all ranks, and its children."""
        key, children = self.env.live
        latest, most = max(self.gather([order(key), children]))
        return key_of(latest), most

    def listeners(self, mine: list[tuple[Key, int, int]]) -> list[int]:
        """Every rank's nodes listening "until the end", in the order they began to wait:
        ``mine`` holds this rank's, each as (the key of the event it began in, its place
        among the waits that event began, node)."""
        told = self.gather([[order(k), s, n] for k, s, n in mine])
        return [node for _, _, node in sorted(w for rows in told for w in rows)]

    def maximum(self, value: float) -> float:
        """The largest ``value`` of every rank's."""
        return self._reduced(value, dist.ReduceOp.MAX)

    def total(self, value: int) -> int:
        """The sum of every rank's ``value`` (exact below 2**53)."""
        return int(self._reduced(value, dist.ReduceOp.SUM))

    def _reduced(self, value: float, op: dist.ReduceOp.RedOpType) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        with self.ranks.together():
            dist.all_reduce(t, op=op)
        return float(t.item())

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON: numbers, strings, lists), in rank order."""
        data = json.dumps(value, separators=(",", ":")).encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.world)]
        with self.ranks.together():
            dist.all_gather(sizes, size)
        most = max(int(s) for s in sizes)
        mine = torch.zeros(most, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(most, dtype=torch.uint8) for _ in range(self.world)]
        with self.ranks.together():
            dist.all_gather(bufs, mine)
        return [json.loads(bytes(b[: int(s)].numpy())) for b, s in zip(bufs, sizes, strict=True)]

    def _exchange(self, arrive: Callable[[InFlight], None]) -> None:
        """Send each rank the messages for its peers, and rank 0 the rows; queue the
        messages that came, write the rows that came (rank 0)."""
        out = [self._pack_messages(r) for r in range(self.world)]
        out[0] = out[0] + self._pack_rows() if self.rank else out[0]
        got = self._swap(out)
        rows = [(order(k) + [s], w, r) for k, s, w, r in self._take_rows()] if not self.rank else []
        for r, data in enumerate(got):
            offset = self._unpack_messages(data, arrive)
            if self.rank == 0 and r:
                rows += self._unpack_rows(data[offset:])
        if self.rank == 0:
            rows.sort(key=lambda row: row[0])
            for _, which, row in rows:
                self.writers[which](*row)

    def _pack_messages(self, r: int) -> bytes:
        """The messages for rank ``r``'s peers: a count, then each as a JSON head (its
        arrival's key, size, send time, whether its link loses it) and its frame."""
        if r == self.rank:
            return b""
        parts: list[bytes | bytearray] = [struct.pack("<Q", len(self.outbox[r]))]
        for key, item in self.outbox[r]:
            head = json.dumps([order(key), item.size, item.sent, item.lost]).encode()
            frame = encode(item.msg)
            parts += [struct.pack("<QQ", len(head), len(frame)), head, frame]
        self.outbox[r] = []
        return b"".join(parts)

    def _unpack_messages(self, data: memoryview, arrive: Callable[[InFlight], None]) -> int:
        if not len(data):
            return 0
        (count,), offset = struct.unpack_from("<Q", data), 8
        for _ in range(count):
            n_head, n_frame = struct.unpack_from("<QQ", data, offset)
            offset += 16
            key, size, sent, lost = json.loads(bytes(data[offset : offset + n_head]))
            offset += n_head
            msg: Message = decode(bytearray(data[offset : offset + n_frame]))
            offset += n_frame
            item = InFlight(msg, size, sent, self.link(msg.src, msg.dst), lost, 0.0)
            self.env.insert(key_of(key), functools.partial(_arrival, arrive, item))
        return offset

    def _pack_rows(self) -> bytes:
        """This rank's rows for rank 0: their count, the length of each one's :func:`order`
        (and its place among its event's rows), those numbers, then the rows as JSON."""
        rows = self._take_rows()
        orders = [order(k) + [s] for k, s, _, _ in rows]
        lengths = array("q", map(len, orders))
        numbers = array("d", itertools.chain.from_iterable(orders))
        body = json.dumps([[w, r] for _, _, w, r in rows], separators=(",", ":")).encode()
        return struct.pack("<Q", len(rows)) + lengths.tobytes() + numbers.tobytes() + body

    def _take_rows(self) -> list[tuple[Key, int, int, tuple[Any, ...]]]:
        rows, self.rows = self.rows, []
        return rows

    def _unpack_rows(self, data: memoryview) -> list[tuple[list[float], int, tuple[Any, ...]]]:
        if not len(data):
            return []
        (count,) = struct.unpack_from("<Q", data)
        lengths = array("q", bytes(data[8 : 8 + 8 * count]))
        start = 8 + 8 * count
        numbers = array("d", bytes(data[start : start + 8 * sum(lengths)]))
        body = json.loads(bytes(data[start + 8 * sum(lengths) :]))
        out, i = [], 0
        for length, (which, row) in zip(lengths, body, strict=True):
            out.append((numbers[i : i + length].tolist(), which, tuple(row)))
            i += length
        return out

    def _swap(self, out: list[bytes]) -> list[memoryview]:
        """Send ``out[r]`` to each rank ``r``; what each rank sent here, in rank order."""
        sizes = torch.tensor([len(b) for b in out], dtype=torch.int64)
        theirs = [torch.empty(self.world, dtype=torch.int64) for _ in range(self.world)]
        with self.ranks.together():
            dist.all_gather(theirs, sizes)
        recvs = {
            r: torch.empty(int(theirs[r][self.rank]), dtype=torch.uint8)
            for r in range(self.world)
            if r != self.rank and int(theirs[r][self.rank])
        }
        with self.ranks.together():
            pending = [
                dist.isend(torch.frombuffer(bytearray(b), dtype=torch.uint8), r)
                for r, b in enumerate(out)
                if r != self.rank and len(b)
            ]
            pending += [dist.irecv(b, r) for r, b in recvs.items()]
            for request in pending:
                if request is not None:
                    request.wait()
        empty = memoryview(b"")
        return [recvs[r].numpy().data if r in recvs else empty for r in range(self.world)]


class KeptLedger(Ledger):
    """``comm.csv``'s rows of this rank's arrivals, kept for rank 0 to write in key order."""

    def __init__(self, windows: Windows, ledger: Ledger) -> None:
        super().__init__()
        self._keep = windows.writer(ledger.record)

    def record(
        self,
        time: float,
        round: int,
        src: str,
        dst: str,
        kind: str,
        nbytes: int,
        arrival: float,
        fate: str = "delivered",
    ) -> None:
        self._keep(time, round, src, dst, kind, nbytes, arrival, fate)


class KeptRows(Reporter):
    """``metrics.csv``'s rows of this rank's peers, kept for rank 0 to write in key order."""

    def __init__(self, windows: Windows, metrics: Reporter) -> None:
        self._keep = windows.writer(metrics.log)

    def log(self, time: float, round: int, peer: str, metric: str, value: float) -> None:
        self._keep(time, round, peer, metric, value)
