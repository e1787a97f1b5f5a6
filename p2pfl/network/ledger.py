"""The communication ledger: one row per message, written to ``comm.csv`` as the run goes."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Any

COMM_COLUMNS = ["time", "round", "src", "dst", "kind", "bytes", "arrival"]


class Ledger:
    """Counts every message that crosses the network choke point (sender, receiver, kind, bytes)."""

    def __init__(self, path: Path | None = None) -> None:
        self._file = open(path, "w", newline="") if path else None  # noqa: SIM115
        self._writer = csv.writer(self._file) if self._file else None
        if self._writer:
            self._writer.writerow(COMM_COLUMNS)
            self.flush()
        self.messages = 0
        self.total_bytes = 0
        self.by_kind: dict[str, dict[str, int]] = defaultdict(lambda: {"messages": 0, "bytes": 0})

    def record(
        self, time: float, round: int, src: str, dst: str, kind: str, nbytes: int, arrival: float
    ) -> None:
        self.messages += 1
        self.total_bytes += nbytes
        self.by_kind[kind]["messages"] += 1
        self.by_kind[kind]["bytes"] += nbytes
        if self._writer:
            self._writer.writerow([_fmt(time), round, src, dst, kind, nbytes, _fmt(arrival)])

    def flush(self) -> None:
        if self._file:
            self._file.flush()

    def summary(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "messages": self.messages,
            "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())},
        }

    def close(self) -> None:
        if self._file:
            self._file.close()


def _fmt(t: float) -> str:
    return f"{t:.9g}"
