"""Evaluation results: ``metrics.csv`` rows written (and flushed) as the run goes."""

from __future__ import annotations

import csv
from pathlib import Path

METRIC_COLUMNS = ["time", "round", "peer", "metric", "value"]


class MetricsLog:
    """Appends ``time, round, peer, metric, value`` rows, flushed as they come."""

    def __init__(self, path: Path | None = None, append: bool = False) -> None:
        self._file = open(path, "a" if append else "w", newline="") if path else None  # noqa: SIM115
        self._writer = csv.writer(self._file) if self._file else None
        if self._writer and self._file and not append:
            self._writer.writerow(METRIC_COLUMNS)
            self._file.flush()

    def log(self, time: float, round: int, peer: str, metric: str, value: float) -> None:
        if self._writer and self._file:
            self._writer.writerow([f"{time:.9g}", round, peer, metric, f"{value:.8g}"])
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
