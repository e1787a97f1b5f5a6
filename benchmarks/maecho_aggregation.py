"""MA-Echo aggregation time: the aggregator's work for the paper's MLP, 2 and 5 peers.

MLP 784-400-200-100-10 without bias; each peer has its own seeded weights and projection
matrices computed by the real peer code (``local_statistics``, then float32 as on the wire)
from Gaussian inputs, 60000/N samples per peer as on Fashion-MNIST (the time depends on the
data only through the projectors' rank, at most the number of mini-batches). Timed:
``aggregate`` with τ = 60, η = 1.6 (the default recipe), with the QP weighting (C = 1) and
with row normalisation, against plain averaging. The goal is under 5 s for 5 peers with the
default recipe. Reports wall time and the process's CPU time (on a shared machine, the work
apart from the waiting).

    python benchmarks/maecho_aggregation.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

from p2pfl.data.federated import PeerData  # noqa: E402
from p2pfl.learning.models import build_model  # noqa: E402
from p2pfl.learning.state import average_states  # noqa: E402
from p2pfl.methods.maecho import (  # noqa: E402
    Contribution,
    aggregate,
    local_statistics,
    pack,
    unpack,
)

MODEL = {"name": "mlp", "hidden": [400, 200, 100], "bias": False}
VARIANTS = {
    "fedavg": None,
    "maecho": {},
    "maecho qp": {"qp_c": 1.0},
    "maecho norm": {"norm": True},
}


def contributions(peers: int, samples: int) -> list[Contribution]:
    out = []
    for i in range(peers):
        torch.manual_seed(i)
        model = build_model(MODEL, (1, 28, 28), 10)
        x, y = torch.randn(samples, 1, 28, 28), torch.arange(samples) % 10
        stats = local_statistics(
            model, PeerData(x, y, x[:0], y[:0]), torch.device("cpu"),
            seed=i, batch_size=64, damping=0.5, ridge=0.01**0.8, ridge_conv=1e-4,
        )  # fmt: skip
        received = unpack(pack(stats, None), stats.classifier)  # float32, as on the wire
        out.append(Contribution({k: v.clone() for k, v in model.state_dict().items()}, received))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for peers in (2, 5):
        contribs = contributions(peers, 60_000 // peers)
        for variant, options in VARIANTS.items():
            walls, cpus = [], []
            for _ in range(args.repeats):
                start, cpu = time.perf_counter(), time.process_time()
                if options is None:
                    average_states([c.state for c in contribs])
                else:
                    aggregate(contribs, tau=60, eta=1.6, **options)
                walls.append(time.perf_counter() - start)
                cpus.append(time.process_time() - cpu)
            rows.append(
                [peers, variant, statistics.median(walls), min(walls), statistics.median(cpus)]
            )
    five = next(r[2] for r in rows if r[0] == 5 and r[1] == "maecho")
    report(
        "maecho_aggregation",
        ["peers", "variant", "median_s", "min_s", "cpu_s"],
        rows,
        {"model": MODEL, "tau": 60, "eta": 1.6, "samples": "60000 / peers", "goal_s": 5.0},
    )
    print(f"5 peers, default recipe: {five:.2f} s median wall (goal < 5 s)")


if __name__ == "__main__":
    main()
