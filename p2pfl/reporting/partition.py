"""The picture of a partition: ``partition.csv`` and ``partition.png`` of a run.

Nothing here imports torch (its data arrive as a counts matrix), so a child forked before
torch is imported can draw them (:class:`p2pfl.runtime.children.Standby`)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from p2pfl.reporting.heatmap import save_heatmap

if TYPE_CHECKING:
    from p2pfl.data.federated import FederatedData


def save_partition(data: FederatedData, out_dir: Path) -> None:
    """Write ``partition.csv`` (per-peer class counts and totals) and ``partition.png`` (a
    peers x classes heat-map) to ``out_dir``."""
    save_counts(data.counts, out_dir)


def save_counts(counts: np.ndarray, out_dir: Path) -> None:
    """:func:`save_partition` from the partition's ``counts`` (peers x classes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "partition.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["peer", *(f"class_{c}" for c in range(counts.shape[1])), "total"])
        for i, row in enumerate(counts):
            writer.writerow([i, *row.tolist(), int(row.sum())])

    peers, classes = counts.shape
    save_heatmap(
        counts,
        out_dir / "partition.png",
        title=f"Samples per peer and class ({peers} peers, {int(counts.sum())} samples)",
        xlabel="class",
        ylabel="peer",
        colorbar="samples",
    )


def prepare() -> None:
    """Import what :func:`save_counts` draws with (matplotlib: 0.3-1 s), ahead of it."""
    import matplotlib.figure  # noqa: F401
    import matplotlib.ticker  # noqa: F401
