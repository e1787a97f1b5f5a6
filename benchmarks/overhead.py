"""Simulator overhead: a run's wall time against the time spent training and evaluating.

FedAvg, 20 peers on a star, 5 rounds, MLP on digits. The floor is the wall time spent
inside the trainer (local training, evaluation, local statistics): no runtime can beat it.
Overhead = (run wall time - floor) / floor; the goal is at most 10%.

    python benchmarks/overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

from p2pfl.config import resolve  # noqa: E402
from p2pfl.experiment import build, run  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for i in range(args.repeats + 1):  # the first run warms up torch and the data cache
        setup = build(resolve(CONFIG, Path("overhead.yaml")))
        with tempfile.TemporaryDirectory() as out:
            summary = run(setup, Path(out))
        wall, floor = summary["wall_time_s"], summary["compute_wall_s"]
        if i:
            rows.append([i, wall, floor, (wall - floor) / floor])
    ratio = statistics.median(r[3] for r in rows)
    report(
        "overhead",
        ["repeat", "wall_s", "train_eval_s", "overhead"],
        rows,
        {"median_overhead": ratio, "goal": 0.10, "config": CONFIG},
    )
    print(f"median overhead {100 * ratio:.1f}% of the training-and-evaluation floor (goal <= 10%)")


if __name__ == "__main__":
    main()
