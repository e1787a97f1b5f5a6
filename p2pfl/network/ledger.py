"""The communication ledger: one row per message, written to ``comm.csv`` as the run goes.

With a ``network:`` section (``fates=True``) each row also says what became of the message
(``delivered``, ``lost``, ``offline``, ...; :data:`p2pfl.network.dynamics.FATES`), and every
message counts its bytes, since the sender spent them whatever its fate.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Any

COMM_COLUMNS = ["time", "round", "src", "dst", "kind", "bytes", "arrival"]


class Ledger:
    """Counts every message that crosses the network choke point (sender, receiver, kind, bytes)."""

    def __init__(self, path: Path | None = None, fates: bool = False) -> None:
        self._file = open(path, "w", newline="") if path else None  # noqa: SIM115
        self._writer = csv.writer(self._file) if self._file else None
        self.fates = fates
        if self._writer:
            self._writer.writerow(COMM_COLUMNS + ["fate"] * fates)
            self.flush()
        self.messages = 0
        self.total_bytes = 0
        self.by_kind: dict[str, dict[str, int]] = defaultdict(lambda: {"messages": 0, "bytes": 0})
        self.by_fate: dict[str, dict[str, int]] = defaultdict(lambda: {"messages": 0, "bytes": 0})

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
        """One message; ``arrival`` is when it arrived, or when its ``fate`` was sealed."""
        self.messages += 1
        self.total_bytes += nbytes
        self.by_kind[kind]["messages"] += 1
        self.by_kind[kind]["bytes"] += nbytes
        self.by_fate[fate]["messages"] += 1
        self.by_fate[fate]["bytes"] += nbytes
        if self._writer:
            row = [_fmt(time), round, src, dst, kind, nbytes, _fmt(arrival)]
            self._writer.writerow(row + [fate] * self.fates)

    def flush(self) -> None:
        if self._file:
            self._file.flush()

    def summary(self) -> dict[str, Any]:
        out = {
            "total_bytes": self.total_bytes,
            "messages": self.messages,
            "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())},
        }
        if self.fates:
            out["by_fate"] = {k: dict(v) for k, v in sorted(self.by_fate.items())}
        return out

    def close(self) -> None:
        if self._file:
            self._file.close()


def summarize_csv(path: Path) -> dict[str, Any]:
    """The ``summary()`` of the ledger a ``comm.csv`` holds (a run cut short writes its
    totals from what is on disk); an unreadable or torn row ends the count there."""
    ledger = Ledger()
    try:
        with open(path, newline="") as f:
            rows = csv.reader(f)
            header = next(rows, [])
            ledger.fates = "fate" in header
            for row in rows:
                t, rnd, src, dst, kind, nbytes, arrival, *fate = row
                ledger.record(
                    float(t), int(rnd), src, dst, kind, int(nbytes), float(arrival), *fate
                )
    except (OSError, ValueError):
        pass
    return ledger.summary()


def _fmt(t: float) -> str:
    return f"{t:.9g}"
