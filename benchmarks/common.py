"""Small helpers shared by the benchmarks: a results table on stdout and a JSON file."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def report(name: str, columns: list[str], rows: list[list[Any]], extra: dict[str, Any]) -> Path:
    """Print ``rows`` as an aligned table and write everything to ``results/NAME.json``."""
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    records = [dict(zip(columns, r, strict=True)) for r in rows]
    path.write_text(json.dumps({"machine": machine(), "rows": records} | extra, indent=2) + "\n")
    print(f"-> {path}")
    return path
