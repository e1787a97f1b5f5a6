"""A sweep on 1 and on N workers (``p2pfl run SWEEP.yaml --workers N``: N cells at a time).

Four seeds of 20 LeNet-5 peers on Fashion-MNIST (Dirichlet 0.5), DFedAvgM on a ring, two
rounds: four cells of a few seconds each, as a user sweeps seeds. Each repeat runs the
whole command with ``--workers 1`` and then ``--workers N``, one thread per process, and
checks that both wrote the same ``sweep.csv`` and the same ``cells.csv`` but for wall times.

    python benchmarks/sweep.py [--workers 2] [--seeds 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import p2pfl_command, report  # noqa: E402


def experiment(seeds: int) -> dict:
    return {
        "name": "sweep-bench",
        "dataset": {"name": "fashion_mnist", "test_subset": 2000},
        "partition": {"name": "dirichlet", "alpha": 0.5},
        "model": {"name": "lenet"},
        "topology": {"kind": "ring"},
        "peers": {"count": 20},
        "algorithm": {"name": "dfedavgm", "rounds": 2},
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        "eval": {"every": 2, "per_peer": False},
        "sweep": {"seed": list(range(seeds))},
    }


def timeless(out: Path) -> tuple[list[dict[str, str]], bytes]:
    """The sweep's cells.csv rows without their wall times, and its sweep.csv."""
    with (out / "cells.csv").open() as f:
        cells = [{k: v for k, v in row.items() if k != "wall_time_s"} for row in csv.DictReader(f)]
    return cells, (out / "sweep.csv").read_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    config = experiment(args.seeds)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    times: dict[int, list[float]] = {1: [], args.workers: []}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        exp = Path(tmp) / "sweep.yaml"
        exp.write_text(yaml.safe_dump(config))
        for _ in range(args.repeats):
            for n in times:
                out = Path(tmp) / f"w{n}"
                cmd = ["run", str(exp), "--force", "--quiet", "--out", str(out)]
                cmd += ["--workers", str(n)]
                times[n].append(p2pfl_command(cmd, env)[0])
            assert timeless(Path(tmp) / "w1") == timeless(Path(tmp) / f"w{args.workers}")
    one, many = (statistics.median(times[n]) for n in times)
    rows = [["whole command", args.seeds, one, many, one / many]]
    columns = ["what", "cells", "workers_1_s", f"workers_{args.workers}_s", "speedup"]
    extra = {"config": config, "workers": args.workers, "identical_tables": True, "times": times}
    report("sweep", columns, rows, extra | {"load_before": load_before})
    print(f"load average before {load_before}, after {os.getloadavg()}")


if __name__ == "__main__":
    main()
