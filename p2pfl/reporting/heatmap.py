"""Matrix pictures shared by every report: partition counts, pool distances, ..."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ANNOTATE_MAX_CELLS = 400  # beyond this many cells the values are not written in
LABEL_MAX = 60  # beyond this many rows (columns) the figure stops growing and ticks thin out


def save_heatmap(
    matrix: np.ndarray,
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    colorbar: str = "",
) -> None:
    """A heat-map PNG of ``matrix`` (:func:`heatmap_figure`)."""
    heatmap_figure(matrix, title, xlabel, ylabel, colorbar).savefig(path, dpi=100)


def heatmap_figure(
    matrix: np.ndarray, title: str, xlabel: str, ylabel: str, colorbar: str = ""
) -> Figure:
    """A heat-map of ``matrix`` with a colour bar; values written in when it is small."""
    from matplotlib.figure import Figure  # renders with Agg, no pyplot state
    from matplotlib.ticker import MaxNLocator

    rows, cols = matrix.shape
    size = (1.5 + 0.5 * min(cols, LABEL_MAX), 1.2 + 0.4 * min(rows, LABEL_MAX))
    fig = Figure(figsize=size, layout="constrained")  # 1,000 peers: not 40,000 pixels tall
    ax = fig.add_subplot()
    image = ax.imshow(matrix, cmap="viridis", aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=colorbar)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    for axis, n in ((ax.xaxis, cols), (ax.yaxis, rows)):
        if n <= LABEL_MAX:
            axis.set_ticks(range(n))
        else:
            axis.set_major_locator(MaxNLocator(nbins=20, integer=True))
    if matrix.size <= ANNOTATE_MAX_CELLS:
        threshold = (matrix.max() + matrix.min()) / 2
        integer = np.issubdtype(matrix.dtype, np.integer)
        for (i, c), v in np.ndenumerate(matrix):
            text = str(v) if integer else f"{v:.3g}"
            color = "black" if v > threshold else "white"
            ax.text(c, i, text, ha="center", va="center", fontsize=7, color=color)
    return fig


def save_matrix_csv(matrix: np.ndarray, path: Path, row: str = "row", col: str = "col") -> None:
    """``matrix`` as CSV: a header ``row, col_0, col_1, ...`` then one line per row."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([row, *(f"{col}_{j}" for j in range(matrix.shape[1]))])
        for i, values in enumerate(matrix.tolist()):
            writer.writerow([i, *values])
