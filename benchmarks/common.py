"""Small helpers shared by the benchmarks: a results table on stdout and a JSON file."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


def p2pfl_command(
    args: list[str], env: Mapping[str, str], out: Path | None = None, cwd: Path = ROOT
) -> tuple[float, dict[str, Any] | None]:
    """``python -m p2pfl ARGS`` as a user runs it (``--out OUT --quiet`` added when ``out``
    is given), timed from outside: its wall time and the run's ``summary.json`` (None
    without ``out``). A command that fails ends the benchmark with its error output."""
    extra = ["--out", str(out), "--quiet"] if out is not None else []
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "p2pfl", *args, *extra], cwd=cwd, env=dict(env),
        capture_output=True, text=True,
    )  # fmt: skip
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{cwd}: p2pfl {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return wall, None if out is None else json.loads((out / "summary.json").read_text())


def core_gflops(repeats: int = 100) -> float:
    """How fast one core multiplies now: GFLOP/s of the product that scores an MLP-200 on
    1,000 Fashion-MNIST images ([1000, 784] by [784, 200], best of ``repeats``). The shared
    machine's speed moves between days (33 to 118 measured), so every result records it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(1000, 784), torch.randn(784, 200)
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * 1000 * 784 * 200 / best / 1e9


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "core_gflops": round(core_gflops(), 1),
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
    here = machine()
    path.write_text(json.dumps({"machine": here, "rows": records} | extra, indent=2) + "\n")
    print(f"one core: {here['core_gflops']} GFLOP/s -> {path}")
    return path
