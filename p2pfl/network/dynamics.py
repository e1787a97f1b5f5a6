"""A network that misbehaves: churn, crashes, lossy links, partitions and changing graphs.

The ``network:`` section of an experiment (every key below; all optional)::

    network:
      churn:                      # peers alternate online and offline sessions
        online: {dist: weibull, mean_s: 60, shape: 0.6}
        offline: {dist: exponential, mean_s: 20}
        offline_fraction: 0.3     # or: the long-run share of time offline (sets offline.mean_s)
        peers: [0, 1, 2]          # who churns (default: every data-holding peer)
        trace: sessions.csv       # or: a trace, rows ``time,peer,state`` (state up | down)
      crashes:                    # peers that stop and never return
        at: {3: 40.0}             # peer -> time (s)
        fraction: 0.1             # and/or a seeded fraction of peers ...
        between_s: [0, 100]       # ... crashing at seeded uniform times in this window
      links:
        loss: 0.05                # probability that a message is lost on its link
        per_link: [{between: [0, 1], loss: 0.5}]
        jitter: {dist: exponential, mean_s: 0.005}   # extra latency per message
        partitions: [{groups: [[0, 1], [2, 3]], from_s: 10, to_s: 30}]
      graph:                      # the graph changes during the run
        every: round              # redraw every round, or every N seconds (a number)
        kind: s_out               # any topology kind (its keys beside it), e.g. s_out with s: 3
        schedule: [{at_s: 0, kind: ring}, {at_s: 60, kind: mesh}]   # or fixed graphs with times

Churn starts in its stationary state (a peer is offline at t = 0 with the long-run share, and
its first session is what is left of one under way), so that share holds from the start.
Everything is drawn from the run's seed, in streams of its own per peer (churn, crashes) and
per sender (loss, jitter), so the same seed gives the same network in every runtime. What
happens to a message is decided here, never by a method: see :meth:`Network.fate`.
"""

from __future__ import annotations

import bisect
import csv
import io
import itertools
import math
from array import array
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import networkx as nx
import numpy as np

from p2pfl.core.errors import ConfigError, RunError
from p2pfl.core.options import bind
from p2pfl.core.seeding import derive_seed, numpy_rng
from p2pfl.network.topology import Link, Topology, build_graph, parse_topology

FATES = ("delivered", "lost", "offline", "crashed", "partitioned", "no_link")
"""What can happen to a message (``comm.csv``'s ``fate`` column)."""
MIN_CYCLE_S = 1e-3
"""The shortest mean online + offline cycle of churn: shorter sessions are no churn a
message could meet, and a run of seconds would draw millions of them per peer."""
MAX_SESSIONS = 10_000_000
"""The most churn sessions a run draws, all peers together (80 MB): more ends the run with
one line (sessions far too short for its length), not with a ``MemoryError``."""


@dataclass(frozen=True)
class Distribution:
    """A positive random duration given by its mean: ``exponential`` (memoryless),
    ``weibull`` (``shape`` k; k < 1 is the heavy tail of measured P2P sessions),
    ``lognormal`` (``sigma``), ``uniform`` (on [0, 2·mean]) or ``constant``.

    Args:
        dist: the law: ``exponential``, ``weibull``, ``lognormal``, ``uniform`` or ``constant``.
        mean_s: the mean duration in seconds.
        shape: ``weibull``: the shape k (k < 1: a heavy tail).
        sigma: ``lognormal``: σ of the underlying normal.
    """

    dist: Literal["exponential", "weibull", "lognormal", "uniform", "constant"] = "exponential"
    mean_s: float = 60.0
    shape: float = 1.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        for key in ("mean_s", "shape", "sigma"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, "must be > 0")
        if self.dist == "weibull":  # what draw() computes from it must be a number
            try:
                math.gamma(1 + 1 / self.shape)
            except OverflowError:
                raise ConfigError(
                    "shape", f"{self.shape:g} is too small (Γ(1 + 1/k) overflows)"
                ) from None
        if self.dist == "lognormal" and not math.isfinite(self.sigma * self.sigma):
            raise ConfigError("sigma", f"{self.sigma:g} is too large (sigma² overflows)")

    def draw(self, rng: np.random.Generator) -> float:
        m = self.mean_s
        if self.dist == "exponential":
            return float(rng.exponential(m))
        if self.dist == "weibull":
            return float(m / math.gamma(1 + 1 / self.shape) * rng.weibull(self.shape))
        if self.dist == "lognormal":
            return float(rng.lognormal(math.log(m) - self.sigma**2 / 2, self.sigma))
        if self.dist == "uniform":
            return float(rng.uniform(0.0, 2 * m))
        return m

    def residual(self, rng: np.random.Generator) -> float:
        """What is left of a session under way at a random instant (density (1 − F(t))/mean):
        the first session of a run that starts in its stationary state. A session caught
        under way is drawn length-biased (density ℓ·f(ℓ)/mean), then cut at a uniform point;
        the exponential is memoryless: a fresh draw."""
        m = self.mean_s
        if self.dist == "exponential":
            return self.draw(rng)
        if self.dist == "weibull":  # length-biased: scale · Gamma(1 + 1/k)^(1/k)
            scale = m / math.gamma(1 + 1 / self.shape)
            caught = scale * rng.gamma(1 + 1 / self.shape) ** (1 / self.shape)
        elif self.dist == "lognormal":  # length-biased: its log's mean moves up by σ²
            caught = rng.lognormal(math.log(m) + self.sigma**2 / 2, self.sigma)
        elif self.dist == "uniform":  # length-biased on [0, 2m]: density ∝ ℓ
            caught = 2 * m * math.sqrt(rng.random())
        else:
            caught = m
        return float(caught * rng.random())


def _distribution(options: Any, key: str) -> Distribution:
    if not isinstance(options, dict):
        raise ConfigError(key, "must be a mapping {dist, mean_s, shape, sigma}")
    try:
        return Distribution(**bind(Distribution, options))
    except ConfigError as e:
        raise e.within(key) from None


@dataclass(frozen=True)
class Churn:
    """The ``network.churn`` keys (see the module docstring).

    Args:
        online: online-session lengths, a distribution ``{dist, mean_s, ...}`` (null: exponential,
            mean 60 s).
        offline: offline-session lengths, the same keys.
        offline_fraction: instead of ``offline.mean_s``: the share of time offline, in [0, 1) (0: no
            churn).
        peers: which peers churn (null: every peer; a server never does).
        trace: instead of drawn sessions: a CSV file of ``time,peer,state`` rows (``up`` or
            ``down``), found like ``topology.file``.
    """

    online: dict | None = None
    offline: dict | None = None
    offline_fraction: float | None = None
    peers: list[int] | None = None
    trace: str | None = None

    def __post_init__(self) -> None:
        if self.offline_fraction is not None and not 0 <= self.offline_fraction < 1:
            raise ConfigError("offline_fraction", "must be in [0, 1)")
        if self.trace is None and self.offline is None and self.offline_fraction is None:
            raise ConfigError("offline", "missing: give offline, offline_fraction or a trace")
        if self.trace is not None and (self.online or self.offline or self.offline_fraction):
            raise ConfigError("trace", "a trace replaces online/offline/offline_fraction")
        on, off = self.sessions()  # checks both distributions
        cycle = on.mean_s + off.mean_s
        if self.trace is None and self.offline_fraction != 0 and not cycle >= MIN_CYCLE_S:
            raise ConfigError(
                "", f"online and offline sessions average {on.mean_s:.3g} + {off.mean_s:.3g} s: "
                f"a cycle must average at least {MIN_CYCLE_S:g} s (raise their mean_s)",
            )  # fmt: skip

    def sessions(self) -> tuple[Distribution, Distribution]:
        """The online and offline session-length distributions."""
        on = _distribution(self.online or {}, "online")
        off = _distribution(self.offline or {"mean_s": 1.0}, "offline")
        if self.offline_fraction is not None:
            f = self.offline_fraction
            off = Distribution(off.dist, max(on.mean_s * f / (1 - f), 1e-12), off.shape, off.sigma)
        return on, off


@dataclass(frozen=True)
class Crashes:
    """The ``network.crashes`` keys: ``at`` (peer -> time) and a seeded ``fraction``.

    Args:
        at: ``{peer: time}``: peers that stop at that time and never return.
        fraction: a seeded fraction of the peers also crashes...
        between_s: ...at seeded uniform times in this window.
    """

    at: dict[int, float] | None = None
    fraction: float = 0.0
    between_s: list[float] = field(default_factory=lambda: [0.0, 100.0])

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ConfigError("fraction", "must be in [0, 1]")
        if len(self.between_s) != 2 or not 0 <= self.between_s[0] <= self.between_s[1]:
            raise ConfigError("between_s", "must be [from, to] with 0 <= from <= to")
        for peer, t in (self.at or {}).items():
            if not isinstance(peer, int) or isinstance(peer, bool):
                raise ConfigError(f"at.{peer}", "peers are integers 0..N-1")
            if not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0:
                raise ConfigError(f"at.{peer}", f"must be a time >= 0, got {t!r}")


@dataclass(frozen=True)
class Partition:
    """Peers in different ``groups`` cannot reach each other from ``from_s`` to ``to_s``.

    Args:
        groups: lists of peers; peers in different groups cannot reach each other (a peer in no
            group reaches everyone).
        from_s: when the partition starts, in seconds.
        to_s: when it ends (the interval is [from_s, to_s)).
    """

    groups: list[list[int]]
    from_s: float = 0.0
    to_s: float = math.inf

    def __post_init__(self) -> None:
        if not 0 <= self.from_s < self.to_s:
            raise ConfigError("to_s", "must be > from_s >= 0")
        seen: set[int] = set()
        for group in self.groups:
            for peer in group:
                if peer in seen:
                    raise ConfigError("groups", f"peer {peer} is in two groups")
                seen.add(peer)


@dataclass(frozen=True)
class LinkFaults:
    """The ``network.links`` keys: loss, per-link loss, latency jitter, partitions.

    Args:
        loss: the probability that a message is lost on its link.
        per_link: ``[{between: [u, v], loss: p}]``: a link's own loss probability.
        jitter: extra latency per message, a distribution as in ``churn.online``.
        partitions: ``[{groups, from_s, to_s}]``: network partitions (see
            ``network.links.partitions[]``).
    """

    loss: float = 0.0
    per_link: list[dict] | None = None
    jitter: dict | None = None
    partitions: list[dict] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.loss <= 1:
            raise ConfigError("loss", "must be in [0, 1]")
        for i, entry in enumerate(self.per_link or []):
            key = f"per_link.{i}"
            if not isinstance(entry, dict) or set(entry) != {"between", "loss"}:
                raise ConfigError(key, "must be {between: [u, v], loss: p}")
            ends, p = entry["between"], entry["loss"]
            if not isinstance(ends, list) or len(ends) != 2:
                raise ConfigError(f"{key}.between", f"must be two peers [u, v], got {ends!r}")
            if not isinstance(p, (int, float)) or not 0 <= p <= 1:
                raise ConfigError(f"{key}.loss", "must be in [0, 1]")
        if self.jitter is not None:
            _distribution(self.jitter, "jitter")
        self.parsed_partitions()

    def parsed_partitions(self) -> list[Partition]:
        out = []
        for i, p in enumerate(self.partitions or []):
            if not isinstance(p, dict):
                raise ConfigError(f"partitions.{i}", "must be {groups, from_s, to_s}")
            try:
                out.append(Partition(**bind(Partition, p)))
            except ConfigError as e:
                raise e.within(f"partitions.{i}") from None
        return out


@dataclass(frozen=True)
class GraphChanges:
    """The ``network.graph`` keys: a generator redrawn ``every`` round or N seconds
    (``kind`` and its keys, as in ``topology:``), or a ``schedule`` of graphs from times.

    Args:
        every: redraw the graph every ``round`` or every N simulated seconds; the graph's ``kind``
            and its keys sit beside it, e.g. ``{every: round, kind: s_out, s: 3}``.
        schedule: instead: fixed graphs from given times, ``[{at_s: 0, kind: ring}, {at_s: 60, kind:
            mesh}]``.
    """

    every: Literal["round"] | float | None = None
    schedule: list[dict] | None = None
    draw: dict[str, Any] = field(default_factory=dict)  # kind and its keys

    def __post_init__(self) -> None:
        if (self.every is None) == (self.schedule is None):
            raise ConfigError("every", "give either every (with kind) or schedule")
        if self.every is not None:
            if not isinstance(self.every, str) and not self.every > 0:
                raise ConfigError("every", "must be 'round' or a number of seconds > 0")
            if "kind" not in self.draw:
                raise ConfigError("kind", "missing: the graph to redraw")
        elif self.draw:
            raise ConfigError(sorted(self.draw)[0], "goes in a schedule entry, not beside it")
        times: list[float] = []
        for i, e in enumerate(self.schedule or []):
            t = e.get("at_s") if isinstance(e, dict) else None
            if not isinstance(t, (int, float)) or t < 0:
                raise ConfigError(f"schedule.{i}.at_s", "every entry needs a time at_s >= 0")
            times.append(t)
        if times and (times[0] != 0 or times != sorted(set(times))):
            raise ConfigError("schedule", "times must start at 0 and increase")
        for i, e in enumerate(self.schedule or []):
            try:
                parse_topology({k: v for k, v in e.items() if k != "at_s"})
            except ConfigError as err:
                raise err.within(f"schedule.{i}") from None
        if self.draw:
            parse_topology(self.draw)


@dataclass(frozen=True)
class NetworkConfig:
    """The whole ``network:`` section.

    Args:
        churn: peers that come and go (see ``network.churn``).
        crashes: peers that stop for good (see ``network.crashes``).
        links: lossy links, jitter and partitions (see ``network.links``).
        graph: a graph that changes during the run (see ``network.graph``).
    """

    churn: dict | None = None
    crashes: dict | None = None
    links: dict | None = None
    graph: dict | None = None


def _part(cls: Any, options: Any, key: str, rest: tuple[str, ...] = ()) -> Any:
    if not isinstance(options, dict):
        raise ConfigError(key, "must be a mapping")
    try:
        if cls is GraphChanges:
            own = {k: v for k, v in options.items() if k in ("every", "schedule")}
            draw = {k: v for k, v in options.items() if k not in own}
            keys = bind(GraphChanges, own, also=rest) | {"draw": draw}
            return GraphChanges(**keys)
        return cls(**bind(cls, options))
    except ConfigError as e:
        raise e.within(key) from None


def resolve_network(options: dict[str, Any]) -> dict[str, Any]:
    """Check a ``network:`` mapping (all that needs no peer count) and return it as given."""
    config = NetworkConfig(**bind(NetworkConfig, options))
    if config.churn is not None:
        _part(Churn, config.churn, "churn")
    if config.crashes is not None:
        _part(Crashes, config.crashes, "crashes")
    if config.links is not None:
        _part(LinkFaults, config.links, "links")
    if config.graph is not None:
        _part(GraphChanges, config.graph, "graph", ("kind",))
    return options


def _peer(value: Any, n: int, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n:
        raise ConfigError(key, f"{value!r} is not a peer (0..{n - 1})")
    return value


def read_trace(path: Path, n: int) -> dict[int, list[tuple[float, bool]]]:
    """A churn trace: CSV rows ``time,peer,state`` (``up``/``down``, header optional); a
    row that breaks them is a ``ConfigError`` naming the file and its line."""
    events: dict[int, list[tuple[float, bool]]] = {}
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError("trace", f"cannot read {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError("trace", f"{path} line {line}: not UTF-8 text") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        for row in reader:
            where = f"{path} line {reader.line_num}"
            if reader.line_num == 1 and row[:1] == ["time"]:
                continue
            if len(row) != 3:
                raise ConfigError("trace", f"{where}: expected time,peer,state, got {row}")
            try:
                t, peer = float(row[0]), int(row[1])
            except ValueError:
                raise ConfigError("trace", f"{where}: time and peer must be numbers") from None
            if not 0 <= peer < n:
                raise ConfigError("trace", f"{where}: unknown peer {peer} (peers are 0..{n - 1})")
            if not 0 <= t < math.inf or row[2] not in ("up", "down"):
                raise ConfigError(
                    "trace", f"{where}: needs a finite time >= 0 and state up or down, got {row}"
                )
            events.setdefault(peer, []).append((t, row[2] == "up"))
    except csv.Error as e:
        raise ConfigError("trace", f"{path} line {reader.line_num}: not a CSV row ({e})") from None
    return {p: sorted(ev) for p, ev in events.items()}


class _Sessions:
    """One peer's online/offline switches, drawn lazily as far as the run asks; ``drawn``
    counts the sessions of the whole run (at most :data:`MAX_SESSIONS`)."""

    def __init__(
        self,
        on: Distribution,
        off: Distribution,
        rng: np.random.Generator,
        p_off: float,
        drawn: itertools.count[int],
    ) -> None:
        self.on, self.off, self.rng, self.drawn = on, off, rng, drawn
        self.start_online = bool(rng.random() >= p_off)  # the stationary state at t = 0
        self.switches = array("d")  # times at which the state flips
        self.horizon = 0.0

    def _extend(self, t: float) -> None:
        while self.horizon <= t:
            if next(self.drawn) >= MAX_SESSIONS:
                raise RunError(
                    f"network.churn: over {MAX_SESSIONS:,} sessions drawn by t={t:.6g} s: "
                    "they are far too short for this run (raise their mean_s)"
                )
            online = self.start_online == (len(self.switches) % 2 == 0)
            session = self.on if online else self.off
            first = not self.switches  # under way at t = 0: what is left of it
            self.horizon += session.residual(self.rng) if first else session.draw(self.rng)
            self.switches.append(self.horizon)

    def online(self, t: float) -> bool:
        self._extend(t)
        flips = bisect.bisect_right(self.switches, t)
        return self.start_online == (flips % 2 == 0)

    def next_up(self, t: float) -> float:
        """The first time >= t at which the peer is online."""
        if self.online(t):
            return t
        return self.switches[bisect.bisect_right(self.switches, t)]


class _Trace(_Sessions):
    """Sessions given by a trace: online before its first event, then as listed."""

    def __init__(self, events: list[tuple[float, bool]]) -> None:
        self.start_online = True
        self.switches = array("d")
        state = True
        for t, up in events:
            if up != state:
                self.switches.append(t)
                state = up
        self.horizon = math.inf

    def _extend(self, t: float) -> None:
        return

    def next_up(self, t: float) -> float:
        if self.online(t):
            return t
        i = bisect.bisect_right(self.switches, t)
        return self.switches[i] if i < len(self.switches) else math.inf


class Network:
    """The misbehaving network of one run: who is online, what reaches whom, which graph."""

    def __init__(self, options: dict[str, Any], topology: Topology, seed: int) -> None:
        config = NetworkConfig(**bind(NetworkConfig, options))
        self.topology = topology
        self.seed = seed
        n = topology.num_peers
        self.sessions: dict[int, _Sessions] = {}
        if config.churn is not None:
            churn: Churn = _part(Churn, config.churn, "churn")
            if churn.trace is not None:
                try:
                    trace = read_trace(Path(churn.trace), n)
                except ConfigError as e:
                    raise e.within("churn") from None
                for peer, events in trace.items():
                    self.sessions[peer] = _Trace(events)
            else:
                on, off = churn.sessions()
                p_off = off.mean_s / (on.mean_s + off.mean_s)
                if churn.offline_fraction == 0:
                    p_off = 0.0
                peers = churn.peers if churn.peers is not None else topology.peers
                for i, peer in enumerate(peers):
                    _peer(peer, n, f"churn.peers.{i}")
                drawn = itertools.count()  # sessions drawn, all peers together
                if churn.offline_fraction != 0:
                    for peer in peers:
                        rng = numpy_rng(seed, "churn", peer)
                        self.sessions[peer] = _Sessions(on, off, rng, p_off, drawn)
        self.crash_at: dict[int, float] = {}
        if config.crashes is not None:
            crashes: Crashes = _part(Crashes, config.crashes, "crashes")
            rng = numpy_rng(seed, "crashes")
            count = round(crashes.fraction * n)
            chosen = rng.permutation(n)[:count]
            low, high = crashes.between_s
            times = rng.uniform(low, high, size=count)
            self.crash_at = {int(p): float(t) for p, t in zip(chosen, times, strict=True)}
            for peer, t in (crashes.at or {}).items():
                self.crash_at[_peer(peer, n, f"crashes.at.{peer}")] = float(t)
        faults: LinkFaults = _part(LinkFaults, config.links or {}, "links")
        self.loss = faults.loss
        self.link_loss: dict[frozenset[int], float] = {}
        for i, entry in enumerate(faults.per_link or []):
            ends = [_peer(v, n, f"links.per_link.{i}.between") for v in entry["between"]]
            self.link_loss[frozenset(ends)] = float(entry["loss"])
        self.jitter = _distribution(faults.jitter, "links.jitter") if faults.jitter else None
        self.partitions = faults.parsed_partitions()
        for i, part in enumerate(self.partitions):
            for g, group in enumerate(part.groups):
                for k, peer in enumerate(group):
                    _peer(peer, n, f"links.partitions.{i}.groups.{g}.{k}")
        self._send_rngs: dict[int, np.random.Generator] = {}
        self.changes: GraphChanges | None = None
        if config.graph is not None:
            self.changes = _part(GraphChanges, config.graph, "graph", ("kind",))
            self._check_graphs()

    @property
    def misbehaves(self) -> bool:
        """Whether anything can go wrong: a section that says everything is reliable and
        static (no churn, no crash, no loss, ...) is the same as no section at all."""
        return bool(
            self.sessions or self.crash_at or self.loss or any(self.link_loss.values())
            or self.jitter or self.partitions or self.changes
        )  # fmt: skip

    # -- who is online -----------------------------------------------------------------
    def crashed(self, node: int, t: float) -> bool:
        return t >= self.crash_at.get(node, math.inf)

    def online(self, node: int, t: float) -> bool:
        if self.crashed(node, t):
            return False
        s = self.sessions.get(node)
        return s is None or s.online(t)

    def next_online(self, node: int, t: float) -> float:
        """When ``node`` is next online (``t`` if it is now; ``inf`` if it crashes first)."""
        s = self.sessions.get(node)
        up = t if s is None else s.next_up(t)
        return math.inf if self.crashed(node, up) else up

    def availability(self, node: int, end: float) -> list[tuple[float, float]]:
        """The intervals in [0, end] during which ``node`` was online."""
        crash = min(self.crash_at.get(node, math.inf), end)
        s = self.sessions.get(node)
        if s is None:
            return [(0.0, crash)] if crash > 0 else []
        try:
            s.online(crash)  # draws the sessions that far
        except RunError:  # the run ended on too many sessions: those it drew
            crash = min(crash, s.horizon)
        out, start = [], 0.0 if s.start_online else None
        for t in s.switches:
            if t >= crash:
                break
            if start is None:
                start = t
            else:
                out.append((start, t))
                start = None
        if start is not None and start < crash:
            out.append((start, crash))
        return out

    # -- what reaches whom -------------------------------------------------------------
    def partitioned(self, a: int, b: int, t: float) -> bool:
        for part in self.partitions:
            if part.from_s <= t < part.to_s:
                ga = next((i for i, g in enumerate(part.groups) if a in g), None)
                gb = next((i for i, g in enumerate(part.groups) if b in g), None)
                if ga is not None and gb is not None and ga != gb:
                    return True
        return False

    def on_send(self, src: int, dst: int) -> tuple[bool, float]:
        """The sender's draws for one message: whether its link loses it, and its jitter.

        Drawn from the sender's own stream in the order it sends, so both runtimes agree."""
        p = self.link_loss.get(frozenset((src, dst)), self.loss)
        if not p and self.jitter is None:
            return False, 0.0
        rng = self._send_rngs.get(src)
        if rng is None:
            rng = self._send_rngs[src] = numpy_rng(self.seed, "link-faults", src)
        lost = bool(rng.random() < p) if p else False
        return lost, self.jitter.draw(rng) if self.jitter else 0.0

    def departure(
        self, src: int, dst: int, round: int | None, t: float
    ) -> tuple[str | None, bool, float]:
        """What the network decides as a message of ``round`` leaves ``src`` at ``t``:
        ``no_link`` if the graph in force has no such edge (nothing leaves, nothing is
        drawn), else ``None`` with the sender's draws (``on_send``: lost, jitter)."""
        if self.changes_graph and not self.adjacent(src, dst, round, t):
            return "no_link", False, 0.0
        return None, *self.on_send(src, dst)

    def fate(
        self, src: int, dst: int, sent: float, arrival: float, lost: bool, receiver: bool = True
    ) -> str:
        """What happened to a message sent at ``sent`` that would arrive at ``arrival``
        (the one place a message's fate is decided, after ``departure``). ``receiver=False``:
        the sender's part only (over sockets, where an offline receiver drops what reaches
        it itself): ``delivered`` then means it goes."""
        if self.partitioned(src, dst, sent):
            return "partitioned"
        if lost:
            return "lost"
        if self.crashed(dst, arrival):
            return "crashed"
        if receiver and not self.online(dst, arrival):
            return "offline"
        return "delivered"

    # -- which graph -------------------------------------------------------------------
    @property
    def changes_graph(self) -> bool:
        return self.changes is not None

    def _check_graphs(self) -> None:
        """Build the first graphs now, so a bad generator or file fails before the run."""
        assert self.changes is not None
        if self.changes.schedule is not None:
            for i in range(len(self.changes.schedule)):
                self._scheduled(i)
        else:
            self._drawn(1)

    def graph(self, round: int | None, t: float) -> nx.Graph:
        """The graph in force for a message of ``round`` sent at ``t``."""
        ch = self.changes
        if ch is None:
            return self.topology.graph
        if ch.schedule is not None:
            times = [e["at_s"] for e in ch.schedule]
            return self._scheduled(bisect.bisect_right(times, t) - 1)
        if ch.every == "round":
            return self.topology.graph if not round else self._drawn(round)
        assert isinstance(ch.every, float)
        return self._drawn(int(t // ch.every) + 1)

    @cache  # noqa: B019 -- one Network per run; the graphs are the run's own
    def _drawn(self, index: int) -> nx.Graph:
        assert self.changes is not None
        seed = derive_seed(self.seed, "graph", index)
        try:
            return build_graph(self.changes.draw, self.topology.num_peers, seed)
        except ConfigError as e:
            raise e.within("graph") from None

    @cache  # noqa: B019
    def _scheduled(self, index: int) -> nx.Graph:
        assert self.changes is not None and self.changes.schedule is not None
        entry = {k: v for k, v in self.changes.schedule[index].items() if k != "at_s"}
        seed = derive_seed(self.seed, "graph", index)
        try:
            return build_graph(entry, self.topology.num_peers, seed)
        except ConfigError as e:
            raise e.within(f"graph.schedule.{index}") from None

    def adjacent(self, src: int, dst: int, round: int | None, t: float) -> bool:
        return self.graph(round, t).has_edge(src, dst)

    def link(self, src: int, dst: int) -> Link:
        """The link a message takes: the topology's, or its default for a drawn edge (at the
        peers' own bandwidths where set, :meth:`Topology.rated`)."""
        if self.topology.graph.has_edge(src, dst):
            return self.topology.link(src, dst)
        return self.topology.rated(src, dst, self.topology.default_link)

    def neighbours(self, node: int, round: int | None, t: float, incoming: bool) -> list[int]:
        """The neighbours ``node`` believes reachable now (what a membership service would
        say): those of the graph in force, online and on its side of any partition."""
        g = self.graph(round, t)
        if g.is_directed():
            near = g.predecessors(node) if incoming else g.successors(node)
        else:
            near = g.neighbors(node)
        return sorted(j for j in near if self.online(j, t) and not self.partitioned(node, j, t))
