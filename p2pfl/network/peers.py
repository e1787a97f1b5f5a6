"""Peer profiles: where a peer computes, how fast, and its default links.

A profile file (``peers/*.yaml``) describes a population; ``build_population`` turns it into
one :class:`PeerProfile` per peer, drawing the seeded speed spread. Simulated compute time for a
training step is ``FLOPs / (flops_per_s * speed)`` (``compute: model``, deterministic) or the
step's measured wall time divided by ``speed`` (``compute: measured``, not reproducible).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import numpy_rng
from p2pfl.network.topology import DEFAULT_LINK, Link, make_link

DEVICES = ("cpu", "cuda", "auto")
MAX_PEERS = 100_000  # beyond this a run would take hours and gigabytes before training


@dataclass(frozen=True)
class PeerProfile:
    """One peer's compute: its device and its speed relative to ``flops_per_s``."""

    device: str
    speed: float


@dataclass(frozen=True)
class Population:
    """The peers of a run (the ``peers:`` section): one profile per peer plus what they
    share."""

    profiles: list[PeerProfile]
    flops_per_s: float
    compute: Literal["model", "measured"]
    link: Link
    batched: bool = False
    uplink: Literal["fifo", "shared"] = "fifo"


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
) -> Population:
    """The population of a run: its keyword arguments are the keys of the ``peers:`` section
    (and of a profile file); each peer's speed is drawn from the run's ``seed``.

    - ``count``: number of data-holding peers.
    - ``device``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (cuda when available).
    - ``speed``: compute speed of a typical peer, relative to ``flops_per_s``.
    - ``flops_per_s``: FLOP/s of a speed-1 peer in the compute model.
    - ``compute``: ``model`` (FLOP count, deterministic) or ``measured`` (wall time).
    - ``link``: default ``{latency_s, bandwidth_bps}`` for links the topology leaves unset.
    - ``speed_sigma``: each peer's speed is multiplied by a seeded lognormal(0, sigma) draw.
    - ``slow_fraction`` / ``slow_factor``: that fraction of peers (seeded) is slower by the factor.
    - ``batched``: in simulation, trainings that overlap in simulated time run as one batched
      computation (``compute: model``; MLPs with SGD, on CUDA any model ``learning.batched``
      can stack); equal to one by one up to float rounding.
    - ``uplink``: how a peer's messages share its uplink in simulation: ``fifo`` (one at a time,
      in order) or ``shared`` (those under way share it equally, as TCP flows on a shaped
      link do; docs/calibration.md).
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
    rng = numpy_rng(seed, "peer-speeds")
    speeds = speed * rng.lognormal(0.0, speed_sigma, size=count)
    slow = rng.permutation(count)[: round(slow_fraction * count)]
    speeds[slow] *= slow_factor
    profiles = [PeerProfile(device=device, speed=float(s)) for s in speeds]
    return Population(profiles, flops_per_s, compute, shared_link, batched, uplink)
