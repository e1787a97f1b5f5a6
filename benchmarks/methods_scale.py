"""Every method at two population sizes: does its time grow linearly with the peers?

Each method runs as a user runs it (``p2pfl run``, one thread, a fresh process per run) on
the same workload, at N and 4N peers: Fashion-MNIST, 5 images a peer drawn with replacement
(so any population fits the data), logistic regression, 2 rounds (1 cycle for FedSeq and
FedELMY; the one-shot methods have one round), scored at the end only. Server methods run on
a star, the others on a ring; the one-shot methods, whose centre merges every peer's
statistics, and FedFisher (its server optimisation touches every peer's Fisher at each of
its steps, here 200) at smaller N. The table gives each run's own time (``wall_time_s``) and
the exponent of its growth, log(t_4N / t_N) / log 4: 1 is linear; a method above
``SUPERLINEAR`` is marked, as AD-PSGD's passive peers were when each scanned every peer
(35.6 s at 10⁴ peers, 13.4 s once fixed; CHANGELOG).

    OMP_NUM_THREADS=1 python benchmarks/methods_scale.py [--peers 1000] [--only adpsgd gossip]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import p2pfl_command, report  # noqa: E402

SUPERLINEAR = 1.25
"""The growth exponent above which a method is marked: more than 4^1.25 = 5.7x the time
for 4x the peers."""

METHODS: dict[str, tuple[str, dict[str, Any], int]] = {
    # name: (topology, algorithm section, divisor of --peers)
    "fedavg": ("star", {"rounds": 2}, 1),
    "fedprox": ("star", {"rounds": 2}, 1),
    "fedasync": ("star", {"rounds": 2}, 1),
    "fedbuff": ("star", {"rounds": 2}, 1),
    "dfedavgm": ("ring", {"rounds": 2}, 1),
    "dfedsam": ("ring", {"rounds": 2}, 1),
    "gossip": ("ring", {"rounds": 2}, 1),
    "pushsum": ("ring", {"rounds": 2}, 1),
    "adpsgd": ("ring", {"rounds": 2}, 1),
    "fedseq": ("ring", {"cycles": 1}, 1),
    "fedelmy": ("ring", {"cycles": 1}, 2),
    "regmean": ("star", {"select": "final"}, 4),
    "fisher_merge": ("star", {"select": "final"}, 4),
    "maecho": ("star", {}, 4),
    "fedfisher": ("star", {"select": "final", "steps": 200}, 40),
}

SETS = [
    "model={name: logreg}",
    "partition={name: iid, samples_per_peer: 5, replace: true, val_fraction: 0}",
    "eval={every: 2, per_peer: false}",
]


def timed_run(name: str, peers: int, work: Path) -> tuple[float, float]:
    """``p2pfl run`` of ``name`` on ``peers`` peers: the run's own time and the command's."""
    topology, keys, _ = METHODS[name]
    algorithm = json.dumps({"name": name, **keys})
    sets = [*SETS, f"peers.count={peers}", f"topology={{kind: {topology}}}"]
    args = ["run", "experiments/population-dfedavgm.yaml", f"--set=algorithm={algorithm}"]
    args += [f"--set={s}" for s in sets]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    wall, summary = p2pfl_command(args, env, work / f"{name}-{peers}")
    assert summary is not None
    return summary["wall_time_s"], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000, help="N (each method's own share)")
    parser.add_argument("--only", nargs="+", choices=sorted(METHODS), help="these methods")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="methods-scale-") as tmp:
        for name in args.only or METHODS:
            small = max(2, args.peers // METHODS[name][2])
            (t1, _), (t4, c4) = (timed_run(name, n, Path(tmp)) for n in (small, 4 * small))
            growth = math.log(t4 / t1) / math.log(4)
            mark = "superlinear" if growth > SUPERLINEAR else ""
            rows.append([name, METHODS[name][0], small, t1, 4 * small, t4, growth, c4, mark])
            print(f"{name}: {t1:.2f} s at {small}, {t4:.2f} s at {4 * small}", flush=True)
    columns = ["method", "graph", "N", "run s", "4N", "run s (4N)", "exponent", "command s (4N)"]
    report("methods_scale", [*columns, "mark"], rows, {"sets": SETS, "methods": METHODS})


if __name__ == "__main__":
    main()
