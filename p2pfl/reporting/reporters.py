"""Where a run's metric rows go: ``metrics.csv`` always, TensorBoard on request.

Every evaluation, logged statistic and final score is one row ``time, round, peer, metric,
value``, handed to a :class:`Reporter`. A run's reporters are the CSV one plus those named
in ``eval.reporters`` (``[tensorboard]``); a plug-in adds one with
``@REPORTERS.register("name")`` on a subclass, constructed with the run directory.

Over ZeroMQ each node writes only its own ``peers/NAME/metrics.csv``; the launcher replays
the merged rows, in time order, into the run's reporters, so both runtimes report the same.
:func:`ended_well` reads a run directory's ``summary.json`` back, for a sweep that skips its
done cells and for the figures.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import Registry

METRIC_COLUMNS = ["time", "round", "peer", "metric", "value"]


def ended_well(out: Path) -> dict[str, Any] | None:
    """The ``summary.json`` of the run in ``out`` if it says ``"status": "ok"``; None if it is
    missing, unreadable or says otherwise (a run that failed, or was interrupted)."""
    try:
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("status") == "ok" else None


class Reporter:
    """Receives a run's metric rows as they come."""

    def __init__(self, out: Path) -> None:
        """Open the reporter's files in the run directory ``out``."""

    @classmethod
    def check(cls) -> None:
        """Raise a :class:`ConfigError` if this reporter cannot run here (a missing package)."""

    def log(self, time: float, round: int, peer: str, metric: str, value: float) -> None:
        """One row: at ``time`` (simulated, or wall-clock seconds since the common start over
        ZeroMQ) in ``round``, node ``peer`` (a peer id, ``server`` or ``final``) measured
        ``metric`` = ``value``."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release what the reporter holds."""


REPORTERS: Registry[type[Reporter]] = Registry("reporter")


@REPORTERS.register("csv")
class CsvReporter(Reporter):
    """``metrics.csv``: one ``time, round, peer, metric, value`` row per call, flushed at once
    so a failed run keeps what it wrote. Always on."""

    def __init__(self, out: Path) -> None:
        self._file = (out / "metrics.csv").open("w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(METRIC_COLUMNS)
        self._file.flush()

    def log(self, time: float, round: int, peer: str, metric: str, value: float) -> None:
        self._writer.writerow([f"{time:.9g}", round, peer, metric, f"{value:.8g}"])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@REPORTERS.register("tensorboard")
class TensorBoardReporter(Reporter):
    """TensorBoard event files in ``tensorboard/`` (``tensorboard --logdir RUN_DIR``).

    A row becomes the scalar ``METRIC/NODE`` (``accuracy/peer_3``, ``loss/server``,
    ``accuracy/final``) at step = round; its time goes into the event's time stamp, so
    TensorBoard's "relative" axis shows simulated seconds. Values are stored as float32.
    """

    def __init__(self, out: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # optional: the tensorboard extra

        self._writer: Any = SummaryWriter(log_dir=str(out / "tensorboard"))

    @classmethod
    def check(cls) -> None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(
                "", "the tensorboard reporter needs the tensorboard package: "
                "pip install 'p2pfl[tensorboard]'",
            ) from None  # fmt: skip

    def log(self, time: float, round: int, peer: str, metric: str, value: float) -> None:
        node = f"peer_{peer}" if peer.isdigit() else peer
        self._writer.add_scalar(f"{metric}/{node}", value, round, walltime=time)

    def close(self) -> None:
        self._writer.close()


class Reporters(Reporter):
    """A run's reporters together: each row goes to every one of them."""

    def __init__(self, reporters: Sequence[Reporter]) -> None:
        self._reporters = list(reporters)

    def log(self, time: float, round: int, peer: str, metric: str, value: float) -> None:
        for reporter in self._reporters:
            reporter.log(time, round, peer, metric, value)

    def close(self) -> None:
        for reporter in self._reporters:
            reporter.close()


def check_reporters(names: Sequence[str]) -> None:
    """The ``eval.reporters`` list: every name registered and usable here (key ``reporters``)."""
    for name in names:
        try:
            REPORTERS.get(name).check()
        except ConfigError as e:
            raise ConfigError("reporters", e.message) from None


def open_reporters(out: Path, names: Sequence[str] = ()) -> Reporters:
    """The CSV reporter and those named (``csv`` named again is the same one) for ``out``."""
    unique = dict.fromkeys(["csv", *names])
    return Reporters([REPORTERS.get(name)(out) for name in unique])
