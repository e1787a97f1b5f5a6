"""A training-bound simulation on 1 and on N ranks (``p2pfl run --workers N``), side by side.

100 LeNet-5 peers on Fashion-MNIST (Dirichlet 0.5), DFedAvgM on a ring, one local epoch per
round, evaluated once at the end: the peers' trainings are the work. Each repeat runs the
command line with ``--workers 1`` and then ``--workers N`` (wall time of the whole command,
process start and data loading included, and the run's own ``wall_time_s``), and checks that
both runs wrote the same ``comm.csv`` and ``metrics.csv``. One thread per rank.
``--against DIR`` runs a second checkout's commands too (another commit: ``git worktree add
DIR REV``), alternating with this one's, so the two are measured side by side.

    python benchmarks/workers.py [--workers 2] [--peers 100] [--rounds 3] [--repeats 2]
                                [--against DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, p2pfl_command, report  # noqa: E402


def experiment(peers: int, rounds: int) -> dict:
    return {
        "name": "workers",
        "seed": 0,
        "dataset": {"name": "fashion_mnist", "test_subset": 2000},
        "partition": {"name": "dirichlet", "alpha": 0.5},
        "model": {"name": "lenet"},
        "topology": {"kind": "ring"},
        "peers": {"count": peers},
        "algorithm": {"name": "dfedavgm", "rounds": rounds},
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        "eval": {"every": rounds, "per_peer": False},
    }


def run(exp: Path, out: Path, workers: int, checkout: Path) -> tuple[float, float]:
    """(command wall time, the run's own wall_time_s)."""
    args = ["run", str(exp), "--force", "--workers", str(workers)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    wall, summary = p2pfl_command(args, env, out, checkout)
    assert summary is not None
    return wall, summary["wall_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--against", type=Path, help="a second checkout, run alongside")
    args = parser.parse_args()
    config = experiment(args.peers, args.rounds)
    checkouts = {"this": ROOT} | ({"against": args.against.resolve()} if args.against else {})
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        exp = Path(tmp) / "workers.yaml"
        exp.write_text(yaml.safe_dump(config))
        for _ in range(args.repeats):
            for name, checkout in checkouts.items():
                for n in (1, args.workers):
                    out = Path(tmp) / f"{name}-w{n}"
                    times.setdefault((name, n), []).append(run(exp, out, n, checkout))
                for file in ("comm.csv", "metrics.csv"):
                    one = (Path(tmp) / f"{name}-w1" / file).read_bytes()
                    assert one == (Path(tmp) / f"{name}-w{args.workers}" / file).read_bytes(), file
    rows = []
    for name in checkouts:
        for what, k in (("whole command", 0), ("the run (wall_time_s)", 1)):
            t1 = statistics.median(t[k] for t in times[name, 1])
            tn = statistics.median(t[k] for t in times[name, args.workers])
            rows.append([name, what, args.peers, args.rounds, t1, tn, t1 / tn])
    columns = ["checkout", "what", "peers", "rounds", "workers_1_s"]
    columns += [f"workers_{args.workers}_s", "speedup"]
    extra = {"config": config, "workers": args.workers, "identical_outputs": True}
    extra |= {"against": str(args.against)}
    report("workers", columns, rows, extra | {"load_before": load_before, "goal_speedup": 1.8})
    print(f"load average before {load_before}, after {os.getloadavg()}")


if __name__ == "__main__":
    main()
