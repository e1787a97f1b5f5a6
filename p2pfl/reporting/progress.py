"""Time to accuracy: when a run first reached each accuracy of ``eval.targets``.

A run's **accuracy series** is read after the run from its ``metrics.csv`` (so it is the same
for a simulated run, a ``--transport zmq`` run and a merged one): the ``accuracy`` rows of

1. the run's model, scored every ``eval.every_s`` seconds (rows of peer ``run``), if any;
2. else the server's (peer ``server``: a star's output model, scored each round), if any;
3. else, per round ``k``, the mean of the peers' rows of round ``k`` (``eval.peers``' sample
   where one is set), at the latest of their times. For an asynchronous method the peers'
   rows of one round are scored at different times on models of different ages, so this
   mean is a poor measure of the run's progress: set ``eval.every_s`` for such methods.

and in every case the ``final`` row (the output model scored at the run's end), last.

``time_to_accuracy`` (``summary.json``) gives, per target ``a`` (its key ``str(a)``: ``"0.7"``),
the first point of the series, in time order, whose accuracy is ``>= a``: its ``time_s``
(simulated seconds; over ZeroMQ, wall seconds since the common start), its ``round``, and
``bytes``, what every message of ``comm.csv`` sent at or before that time (its ``time``
column: lost messages count, the sender spent them) adds up to; ``null`` if no point reaches
``a``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from p2pfl.core.errors import ConfigError
from p2pfl.reporting.tables import Table, read_table

SOURCES = {"run": "the run's model", "server": "server", "peers": "mean over peers"}
"""Where a series comes from (:func:`accuracy_series`), and how a figure's legend says it."""


@dataclass(frozen=True)
class Point:
    """One point of a run's accuracy series."""

    time: float
    round: int
    accuracy: float


def check_targets(targets: Sequence[Any]) -> None:
    """``eval.targets``: distinct accuracies in (0, 1] (a ``ConfigError`` keyed ``targets``)."""
    for t in targets:
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t <= 1:
            raise ConfigError("targets", f"each target must be an accuracy in (0, 1], got {t!r}")
    seen: set[float] = set()
    for t in targets:
        if float(t) in seen:
            raise ConfigError("targets", f"{t!r} is given twice")
        seen.add(float(t))


def target_key(target: float) -> str:
    """A target's key in ``summary.json`` and its sweep columns: ``0.7`` -> ``"0.7"``."""
    return repr(float(target))


def accuracy_series(rows: Iterable[Mapping[str, str]]) -> tuple[list[Point], str]:
    """The accuracy series of ``metrics.csv``'s rows (read as text, as ``csv.DictReader``
    gives them), in time order, and its source: ``run``, ``server`` or ``peers``."""
    by_peer: dict[str, list[Point]] = defaultdict(list)
    peers: dict[int, list[Point]] = defaultdict(list)
    for r in rows:
        if r["metric"] != "accuracy":
            continue
        point = Point(float(r["time"]), int(r["round"]), float(r["value"]))
        if r["peer"].isdigit():
            peers[point.round].append(point)
        else:
            by_peer[r["peer"]].append(point)
    if by_peer["run"]:
        source, series = "run", by_peer["run"]
    elif by_peer["server"]:
        source, series = "server", by_peer["server"]
    else:
        source = "peers"
        series = [
            Point(max(p.time for p in ps), k, math.fsum(p.accuracy for p in ps) / len(ps))
            for k, ps in sorted(peers.items())
        ]
    ordered = sorted(series, key=lambda p: p.time)  # stable: ties keep their order
    return ordered + sorted(by_peer["final"], key=lambda p: p.time), source


class Sent:
    """Bytes of the messages sent by a time: ``times`` and ``sizes`` are ``comm.csv``'s
    ``time`` and ``bytes`` columns (or, given its delivered rows' ``arrival`` column, the
    bytes that had arrived by then)."""

    def __init__(self, times: np.ndarray, sizes: np.ndarray) -> None:
        order = np.argsort(times, kind="stable")
        self.times = np.asarray(times, dtype=np.float64)[order]
        self.totals = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64)[order])])

    def by(self, time: float) -> int:
        """Bytes of every message sent (or arrived) at or before ``time``."""
        return int(self.totals[np.searchsorted(self.times, time, side="right")])


def reached(
    series: Sequence[Point], sent: Sent, targets: Iterable[float]
) -> dict[str, dict[str, Any] | None]:
    """Per target (ascending): the first point of ``series`` at or above it, as ``time_s``,
    ``bytes`` and ``round``; None where no point is."""
    out: dict[str, dict[str, Any] | None] = {}
    for target in sorted(float(t) for t in targets):
        first = next((p for p in series if p.accuracy >= target), None)
        out[target_key(target)] = (
            None
            if first is None
            else {"time_s": first.time, "bytes": sent.by(first.time), "round": first.round}
        )
    return out


def time_to_accuracy(out: Path, targets: Iterable[float]) -> dict[str, dict[str, Any] | None]:
    """``summary.json``'s ``time_to_accuracy`` of the run in ``out``, from its
    ``metrics.csv`` and ``comm.csv``."""
    series, _ = accuracy_series(read_table(out / "metrics.csv"))
    comm = out / "comm.csv"
    table = read_table(comm) if comm.is_file() else Table({"time": [], "bytes": []})
    return reached(series, Sent(table.floats("time"), table.ints("bytes")), targets)
