"""Simulator overhead: a run's wall time against the time spent training and evaluating.

FedAvg, 20 peers on a star, 5 rounds. The core case is a small MLP (64 hidden units) on
digits, where a local training takes a few milliseconds, so the simulator's own work
(serializing every message, SimPy events, the method's Python code, the ledger) weighs the
most; the second case is the Fashion-MNIST MLP (200 hidden units, 12,000 samples), where
trainings are longer. The floor is the wall time spent inside the trainer (local
training, evaluation, local statistics): no runtime can beat it. Overhead = (run wall time
- floor) / floor; the goal is at most 10% for the core case (issue 16). With
``--torch-optim`` every run is followed by the same run with ``torch.optim`` as the local
optimizer (as before p2pfl wrote out its CPU updates), side by side.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py [--repeats 5] [--torch-optim]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import report  # noqa: E402

import p2pfl  # noqa: E402
from p2pfl.learning import training  # noqa: E402
from p2pfl.learning.training import TrainConfig  # noqa: E402

OPTIMIZER = training.optimizer

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


def torch_optim(params: list, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The local optimizer as it was before p2pfl wrote out torch's CPU updates."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def overheads(config: dict, repeats: int, with_torch_optim: bool) -> list[list]:
    """``repeats`` runs of ``config`` (after one warm-up run): wall, floor and overhead; with
    ``with_torch_optim`` each run is followed by one whose local optimizer is torch.optim."""
    rows = []
    for i in range(repeats + 1):  # the first run warms up torch and the data cache
        for name, make in [("p2pfl", training.optimizer)] + (
            [("torch.optim", torch_optim)] if with_torch_optim else []
        ):
            training.optimizer = make  # type: ignore[assignment]
            with tempfile.TemporaryDirectory() as out:
                summary = p2pfl.run(config, out=out).summary
            wall, floor = summary["wall_time_s"], summary["compute_wall_s"]
            if i:
                rows.append([name, i, wall, floor, (wall - floor) / floor])
    training.optimizer = OPTIMIZER
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--torch-optim", action="store_true", help="alternate with torch.optim as the optimizer"
    )
    args = parser.parse_args()
    rows, medians, walls = [], {}, {}
    for name, config in CASES.items():
        runs = overheads(config, args.repeats, args.torch_optim)
        for opt in sorted({r[0] for r in runs}):
            mine = [r for r in runs if r[0] == opt]
            medians[f"{name}, {opt}"] = statistics.median(r[4] for r in mine)
            walls[f"{name}, {opt}"] = statistics.median(r[2] for r in mine)
        rows += [[name, *r] for r in runs]
    extra = {
        "median_overhead": medians, "median_wall_s": walls, "goal": 0.10, "cases": CASES,
        "load": os.getloadavg(),
    }  # fmt: skip
    columns = ["case", "optimizer", "repeat", "wall_s", "train_eval_s", "overhead"]
    report("overhead", columns, rows, extra)
    for name, ratio in medians.items():
        print(
            f"{name}: median overhead {100 * ratio:.1f}% of the training-and-evaluation floor, "
            f"median wall {walls[name]:.3f} s"
        )
    print(f"goal <= 10% for the core case; load average {extra['load']}")


if __name__ == "__main__":
    main()
