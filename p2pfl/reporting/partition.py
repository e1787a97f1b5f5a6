"""The picture of a partition: ``partition.csv`` and ``partition.png`` of a run."""

from __future__ import annotations

import csv
from pathlib import Path

from p2pfl.data.federated import FederatedData
from p2pfl.reporting.heatmap import save_heatmap


def save_partition(data: FederatedData, out_dir: Path) -> None:
    """Write ``partition.csv`` (per-peer class counts and totals) and ``partition.png`` (a
    peers x classes heat-map) to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = data.counts
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
