"""Peer profiles: where a peer computes, how fast, and how fast its links are.

A profile file (``peers/*.yaml``) describes a population; ``build_population`` turns it into
one :class:`PeerProfile` per peer, drawing the seeded spreads. Simulated compute time for a
training step is ``FLOPs / (flops_per_s * speed)`` (``compute: model``, deterministic) or the
step's measured wall time divided by ``speed`` (``compute: measured``, not reproducible).

Heterogeneous devices (docs/calibration.md, "Heterogeneous devices"):

- a peer's compute speed, uplink and downlink are each a typical value (``speed``,
  ``up_bps``, ``down_bps``: the median) times a seeded draw of a spread (``speed_dist``,
  ``up_dist``, ``down_dist``): ``{name: lognormal, sigma: S}`` or the heavy tail
  ``{name: pareto, alpha: A}`` (:class:`Lognormal`, :class:`Pareto`);
- or every peer's FLOP/s and bandwidths come from a CSV file (``devices``,
  :func:`read_devices`).

A message from peer i to peer j moves at min(up_i, down_j) (``Topology.rated``); a run with
any per-peer spread writes the drawn values to ``peers.csv`` (:func:`save_peers`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any, Literal

import numpy as np

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import bind
from p2pfl.core.seeding import numpy_rng
from p2pfl.core.yaml_io import find_file
from p2pfl.network.topology import DEFAULT_LINK, Link, make_link

DEVICES = ("cpu", "cuda", "auto")
MAX_PEERS = 100_000  # beyond this a run would take hours and gigabytes before training
DEVICES_HEADER = "peer,flops_per_s,up_bps,down_bps"
MAX_DEVICES_BYTES = 32 * 2**20  # 100,000 peers take about 5 MB


@dataclass(frozen=True)
class PeerProfile:
    """One peer's compute: its device and its speed relative to ``flops_per_s``
    (``flops_per_s``: its own FLOP/s where a ``devices`` file gives it, else ``None``)."""

    device: str
    speed: float
    flops_per_s: float | None = None


@dataclass(frozen=True)
class Population:
    """The peers of a run (the ``peers:`` section): one profile per peer plus what they
    share. ``up_bps`` / ``down_bps``: each peer's uplink and downlink in bits per second,
    empty where not set (the links' bandwidth applies); ``heterogeneous``: a per-peer
    spread or file is configured (the run writes ``peers.csv``)."""

    profiles: list[PeerProfile]
    flops_per_s: float
    compute: Literal["model", "measured"]
    link: Link
    batched: bool = False
    uplink: Literal["fifo", "shared"] = "fifo"
    up_bps: tuple[float, ...] = ()
    down_bps: tuple[float, ...] = ()
    heterogeneous: bool = False

    @property
    def rates(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(up, down) per peer, for :func:`p2pfl.network.topology.build_topology`."""
        return self.up_bps, self.down_bps

    def peer_flops(self, peer: int) -> float:
        """Peer ``peer``'s FLOP/s in the compute model."""
        prof = self.profiles[peer]
        return prof.flops_per_s or self.flops_per_s * prof.speed


# Spreads: each draws multipliers with median 1 (the typical value is the median).


@dataclass(frozen=True)
class Lognormal:
    """exp(sigma·Z), Z standard normal: median 1, quantile q at exp(sigma·Φ⁻¹(q))."""

    sigma: float

    def check(self) -> None:
        if not 0 <= self.sigma <= 10:
            raise ConfigError("sigma", f"must be in [0, 10], got {self.sigma}")

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.lognormal(0.0, self.sigma, size=size)

    def quantile(self, q: float) -> float:
        return math.exp(self.sigma * NormalDist().inv_cdf(q))


@dataclass(frozen=True)
class Pareto:
    """A heavy tail of slow peers: the time a peer takes per unit of work (per FLOP, per
    bit) is Pareto(alpha) with median 1, so the multiplier is 2^(1/alpha) / X with X
    classic Pareto (scale 1). Median 1; no peer is over 2^(1/alpha) times faster than the
    median; a fraction k^-alpha / 2 is over k times slower. Quantile q at (2q)^(1/alpha)."""

    alpha: float

    def check(self) -> None:
        if not 0.1 <= self.alpha <= 100:
            raise ConfigError("alpha", f"must be in [0.1, 100], got {self.alpha}")

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return 2.0 ** (1.0 / self.alpha) / (1.0 + rng.pareto(self.alpha, size=size))

    def quantile(self, q: float) -> float:
        return (2.0 * q) ** (1.0 / self.alpha)


SPREADS: dict[str, type[Lognormal] | type[Pareto]] = {"lognormal": Lognormal, "pareto": Pareto}


def spread(options: Any) -> Lognormal | Pareto:
    """A ``{name: lognormal, sigma: S}`` or ``{name: pareto, alpha: A}`` mapping, checked
    (errors keyed relative to the mapping)."""
    if not isinstance(options, dict):
        raise ConfigError("", "must be {name: lognormal, sigma: S} or {name: pareto, alpha: A}")
    name = options.get("name")
    if name not in SPREADS:
        raise ConfigError("name", f"must be {' or '.join(SPREADS)}, got {name!r}")
    cls = SPREADS[name]
    rest = {k: v for k, v in options.items() if k != "name"}
    made = cls(**bind(cls, rest, also=("name",)))
    made.check()
    return made


def _draw(dist: Lognormal | Pareto, rng: np.random.Generator, count: int, key: str) -> np.ndarray:
    drawn = dist.draw(rng, count)
    if not (np.isfinite(drawn).all() and (drawn > 0).all()):
        raise ConfigError(key, "draws a value of 0 or infinity for some peer; narrow the spread")
    return drawn


def build_population(
    seed: int,
    /,
    *,
    count: int,
    device: str = "cpu",
    speed: float = 1.0,
    flops_per_s: float = 5e9,
    compute: Literal["model", "measured"] = "model",
    link: dict[str, Any] | None = None,
    speed_sigma: float = 0.0,
    slow_fraction: float = 0.0,
    slow_factor: float = 0.1,
    batched: bool = False,
    uplink: Literal["fifo", "shared"] = "fifo",
    speed_dist: dict[str, Any] | None = None,
    up_bps: float | None = None,
    up_dist: dict[str, Any] | None = None,
    down_bps: float | None = None,
    down_dist: dict[str, Any] | None = None,
    devices: str | None = None,
) -> Population:
    """The population of a run: its keyword arguments are the keys of the ``peers:`` section
    (and of a profile file); each peer's speed and bandwidths are drawn from the run's
    ``seed``.

    - ``count``: number of data-holding peers.
    - ``device``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (cuda when available).
    - ``speed``: compute speed of a typical (median) peer, relative to ``flops_per_s``.
    - ``flops_per_s``: FLOP/s of a speed-1 peer in the compute model.
    - ``compute``: ``model`` (FLOP count, deterministic) or ``measured`` (wall time).
    - ``link``: default ``{latency_s, bandwidth_bps}`` for links the topology leaves unset.
    - ``speed_sigma``: each peer's speed is multiplied by a seeded lognormal(0, sigma) draw
      (the same draws as ``speed_dist: {name: lognormal, sigma: ...}``).
    - ``slow_fraction`` / ``slow_factor``: that fraction of peers (seeded) is slower by the factor.
    - ``batched``: in simulation, trainings that overlap in simulated time run as one batched
      computation (``compute: model``; MLPs with SGD, on CUDA any model ``learning.batched``
      can stack); equal to one by one up to float rounding.
    - ``uplink``: how a peer's messages share its uplink in simulation: ``fifo`` (one at a time,
      in order) or ``shared`` (those under way share it equally, as TCP flows on a shaped
      link do; docs/calibration.md).
    - ``speed_dist``: each peer's speed is ``speed`` times a seeded draw of this spread.
    - ``up_bps`` / ``down_bps``: a typical (median) peer's uplink / downlink in bit/s; a
      message from peer i to peer j moves at min(up_i, down_j) instead of its link's
      bandwidth (a ``links:`` entry of the topology that sets ``bandwidth_bps`` keeps it).
    - ``up_dist`` / ``down_dist``: each peer's uplink / downlink is the median times a seeded
      draw of this spread.
    - ``devices``: a CSV file ``peer,flops_per_s,up_bps,down_bps`` giving every peer's
      compute and bandwidths (instead of the keys above).
    """
    if not 1 <= count <= MAX_PEERS:
        raise ConfigError("count", f"must be in 1..{MAX_PEERS:,}, got {count:,}")
    if not (device in DEVICES or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ConfigError("device", f"must be cpu, cuda, cuda:N or auto, got {device!r}")
    for key, value in (
        ("speed", speed),
        ("flops_per_s", flops_per_s),
        ("slow_factor", slow_factor),
    ):
        if value <= 0:
            raise ConfigError(key, "must be > 0")
    if uplink not in ("fifo", "shared"):
        raise ConfigError("uplink", f"must be fifo or shared, got {uplink!r}")
    if speed_sigma < 0:
        raise ConfigError("speed_sigma", "must be >= 0")
    if not 0 <= slow_fraction <= 1:
        raise ConfigError("slow_fraction", "must be in [0, 1]")
    try:
        shared_link = make_link(link or {}, DEFAULT_LINK)
    except ConfigError as e:
        raise e.within("link") from None
    spreads: dict[str, Lognormal | Pareto] = {}
    for key, options in (
        ("speed_dist", speed_dist),
        ("up_dist", up_dist),
        ("down_dist", down_dist),
    ):
        if options is not None:
            try:
                spreads[key] = spread(options)
            except ConfigError as e:
                raise e.within(key) from None
    for key, rate in (("up_bps", up_bps), ("down_bps", down_bps)):
        if rate is not None and rate <= 0:
            raise ConfigError(key, "must be > 0")
    for dist, median in (("up_dist", up_bps), ("down_dist", down_bps)):
        if dist in spreads and median is None:
            raise ConfigError(dist, f"needs {dist[:-5]}_bps, the median it spreads around")
    if "speed_dist" in spreads and speed_sigma:
        raise ConfigError("speed_dist", "give speed_dist or speed_sigma, not both")
    if devices is not None:
        given = [k for k, v in (
            ("speed_sigma", speed_sigma), ("slow_fraction", slow_fraction),
            ("speed_dist", speed_dist), ("up_bps", up_bps), ("up_dist", up_dist),
            ("down_bps", down_bps), ("down_dist", down_dist),
        ) if v] + (["speed"] if speed != 1.0 else [])  # fmt: skip
        if given:
            raise ConfigError(
                "devices", f"gives every peer's compute and bandwidths; drop {', '.join(given)}"
            )
        flops, ups, downs = read_devices(devices, count)
        profiles = [PeerProfile(device=device, speed=f / flops_per_s, flops_per_s=f) for f in flops]
        return Population(
            profiles, flops_per_s, compute, shared_link, batched, uplink, ups, downs, True
        )
    rng = numpy_rng(seed, "peer-speeds")
    if "speed_dist" in spreads:
        speeds = speed * _draw(spreads["speed_dist"], rng, count, "speed_dist")
    else:
        speeds = speed * rng.lognormal(0.0, speed_sigma, size=count)
    slow = rng.permutation(count)[: round(slow_fraction * count)]
    speeds[slow] *= slow_factor
    profiles = [PeerProfile(device=device, speed=float(s)) for s in speeds]
    ups, downs = (
        _rates(seed, median, spreads.get(f"{side}_dist"), count, side)
        for side, median in (("up", up_bps), ("down", down_bps))
    )
    heterogeneous = bool(speed_sigma or slow_fraction or spreads or up_bps or down_bps)
    return Population(
        profiles, flops_per_s, compute, shared_link, batched, uplink, ups, downs, heterogeneous
    )


def _rates(
    seed: int, median: float | None, dist: Lognormal | Pareto | None, count: int, side: str
) -> tuple[float, ...]:
    """Each peer's uplink (``side`` "up") or downlink ("down"): ``median`` times a draw of
    ``dist`` from the run's seed (a stream of its own per side), or ``median`` for all;
    empty where not set."""
    if median is None:
        return ()
    if dist is None:
        return (float(median),) * count
    drawn = _draw(dist, numpy_rng(seed, f"peer-{side}link"), count, f"{side}_dist")
    return tuple(float(median * m) for m in drawn)


NEW_KEYS = ("speed_dist", "up_bps", "up_dist", "down_bps", "down_dist", "devices")
"""Keys a resolved ``peers:`` section lists only when given: without them, ``config.yaml``
is as it was before they existed."""


def resolve_peers(options: dict[str, Any], file: Path) -> dict[str, Any]:
    """Check a ``peers:`` mapping's keys against :func:`build_population` and fill its
    defaults; a ``devices`` file is found like ``topology.file`` and made absolute (the
    resolved config runs from anywhere).

    - ``profile``: a peer profile file (``peers/*.yaml``: ``uniform``, ``heterogeneous``,
      ``gpu``, ``phones``) whose keys the inline keys override; found like ``topology.file``.
    """
    name = options.get("devices")
    if isinstance(name, str):
        path = find_file(name, file)
        if path is None:
            raise ConfigError("devices", f"no such devices file {name!r}")
        options = options | {"devices": str(path.resolve())}
    bound = bind(build_population, options, 1, also=("profile",))
    return {k: v for k, v in bound.items() if not (k in NEW_KEYS and v is None)}


def read_devices(path: str, count: int) -> tuple[list[float], tuple[float, ...], tuple[float, ...]]:
    """A devices file's FLOP/s, uplinks and downlinks, one row per peer 0..count-1.

    The file is UTF-8 CSV: lines starting with ``#`` and blank lines are skipped, the first
    other line is the header ``peer,flops_per_s,up_bps,down_bps``, then one row per peer, in
    any order, each peer exactly once, every value a positive finite number. Anything else
    is a ``ConfigError`` naming the file and line."""

    def bad(message: str) -> ConfigError:
        return ConfigError("devices", f"{path}: {message}")

    try:
        size = Path(path).stat().st_size
        if size > MAX_DEVICES_BYTES:
            raise bad(f"is {size:,} bytes, over {MAX_DEVICES_BYTES:,}")
        text = Path(path).read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise ConfigError("devices", f"no such devices file {path!r}") from None
    except IsADirectoryError:
        raise bad("is a directory, not a CSV file") from None
    except UnicodeDecodeError as e:
        raise bad(f"is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise bad(f"cannot be read: {e.strerror or e}") from None
    lines = [
        (n, line.strip())
        for n, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not lines:
        raise bad(f"is empty; its first line must be the header {DEVICES_HEADER!r}")
    n, header = lines[0]
    if [c.strip() for c in header.split(",")] != DEVICES_HEADER.split(","):
        shown = header if len(header) <= 80 else f"{header[:80]}..."
        raise bad(f"line {n}: the header must be {DEVICES_HEADER!r}, got {shown!r}")
    rows: dict[int, tuple[float, float, float]] = {}
    where: dict[int, int] = {}
    for n, line in lines[1:]:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 4:
            raise bad(f"line {n}: {len(cells)} fields; the header has 4")
        if not (cells[0].isascii() and cells[0].isdigit()) or int(cells[0]) >= count:
            shown = cells[0] if len(cells[0]) <= 20 else f"{cells[0][:20]}..."
            raise bad(f"line {n}: unknown peer {shown!r}: peers are 0..{count - 1}")
        peer = int(cells[0])
        if peer in rows:
            raise bad(f"line {n}: peer {peer} is listed twice (also line {where[peer]})")
        values = []
        for column, cell in zip(DEVICES_HEADER.split(",")[1:], cells[1:], strict=True):
            try:
                value = float(cell)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                shown = cell if len(cell) <= 20 else f"{cell[:20]}..."
                raise bad(f"line {n}: {column} must be a positive number, got {shown!r}")
            values.append(value)
        rows[peer], where[peer] = (values[0], values[1], values[2]), n
    missing = [p for p in range(count) if p not in rows]
    if missing:
        listed = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise bad(f"lists no row for {len(missing)} of the {count} peers: {listed}")
    ordered = [rows[p] for p in range(count)]
    return (
        [r[0] for r in ordered],
        tuple(r[1] for r in ordered),
        tuple(r[2] for r in ordered),
    )


def save_peers(population: Population, path: Path) -> None:
    """``peers.csv``: each peer's drawn compute and bandwidths (``peer, speed, flops_per_s,
    up_bps, down_bps``; an empty bandwidth: not set, the links' own applies). Floats are
    written exactly (shortest round-trip form)."""

    def cell(values: Sequence[float], peer: int) -> str:
        return repr(values[peer]) if values else ""

    with open(path, "w") as f:
        f.write("peer,speed,flops_per_s,up_bps,down_bps\n")
        for p, prof in enumerate(population.profiles):
            f.write(
                f"{p},{prof.speed!r},{population.peer_flops(p)!r},"
                f"{cell(population.up_bps, p)},{cell(population.down_bps, p)}\n"
            )
