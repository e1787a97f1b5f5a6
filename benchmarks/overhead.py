"""Simulator overhead: a run's wall time against the time spent training and evaluating.

FedAvg, 20 peers on a star, 5 rounds. The core case is a small MLP (64 hidden units) on
digits, where a local training takes a few milliseconds, so the simulator's own work
(serializing every message, SimPy events, the method's Python code, the ledger) weighs the
most; the second case is the Fashion-MNIST MLP (200 hidden units, 12,000 samples), where
trainings are longer. The floor is the wall time spent inside the trainer (local
training, evaluation, local statistics): no runtime can beat it. Overhead = (run wall time
- floor) / floor; the goal is at most 5% for the core case.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

from p2pfl.app.config import resolve  # noqa: E402
from p2pfl.app.experiment import build, run  # noqa: E402

CONFIG = {
    "name": "overhead",
    "seed": 0,
    "dataset": {"name": "digits"},
    "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
    "model": {"name": "mlp", "hidden": [64]},
    "topology": {"kind": "star"},
    "peers": {"count": 20},
    "algorithm": {"name": "fedavg", "rounds": 5},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
}
CASES = {
    "digits mlp-64 (core)": CONFIG,
    "fmnist mlp-200": CONFIG
    | {"dataset": {"name": "fashion_mnist", "subset": 12000}, "model": {"name": "mlp"}},
}


def overheads(config: dict, repeats: int) -> list[list]:
    """``repeats`` runs of ``config`` (after one warm-up run): wall, floor and overhead."""
    rows = []
    for i in range(repeats + 1):  # the first run warms up torch and the data cache
        setup = build(resolve(config, Path("overhead.yaml")))
        with tempfile.TemporaryDirectory() as out:
            summary = run(setup, Path(out))
        wall, floor = summary["wall_time_s"], summary["compute_wall_s"]
        if i:
            rows.append([i, wall, floor, (wall - floor) / floor])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows, medians = [], {}
    for name, config in CASES.items():
        runs = overheads(config, args.repeats)
        medians[name] = statistics.median(r[3] for r in runs)
        rows += [[name, *r] for r in runs]
    extra = {"median_overhead": medians, "goal": 0.05, "cases": CASES, "load": os.getloadavg()}
    report("overhead", ["case", "repeat", "wall_s", "train_eval_s", "overhead"], rows, extra)
    for name, ratio in medians.items():
        print(f"{name}: median overhead {100 * ratio:.1f}% of the training-and-evaluation floor")
    print(f"goal <= 5% for the core case; load average {extra['load']}")


if __name__ == "__main__":
    main()
