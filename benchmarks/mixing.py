"""Mixing: the time of one ``average_states`` of three states, the step every DFedAvgM peer
takes once a round (10⁴ peers on a ring: 30,000 of them in a 3-round run).

Each model's states are drawn as a pool of ``--states`` of them (more than the caches
hold, as a population's are) and each mix takes three neighbours from it. Every case runs
in a fresh process at one thread; ``--base DIR`` runs the same cases with the package from
``DIR`` too, interleaved, and checks that both give the same bits. ``--together C ...``
also mixes the ring ``C`` peers at a time, the pool held as one tensor per parameter
(``[peers, ...]``, the layout a population stored that way would have): the same float64
sums in the same order, so the same bits, in ``C`` times fewer calls over ``C`` times more
memory each.

    OMP_NUM_THREADS=1 python benchmarks/mixing.py [--base DIR] [--repeats 3] [--together 4 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, report  # noqa: E402

MODELS = {
    "mlp 784-64-10": {"name": "mlp", "hidden": [64]},
    "logreg 784-10": {"name": "logreg"},
    "cnn_s (BatchNorm)": {"name": "cnn_s"},
}

POOL = """
import hashlib, json, sys, time
import torch
from p2pfl.learning.models import build_model
from p2pfl.learning.state import average_states, clone_state
torch.set_num_threads(1)
options, count = json.loads(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
base = clone_state(build_model(options, (1, 28, 28), 10).state_dict())
pool = [
    {k: v + torch.randn_like(v) if v.is_floating_point() else v.clone() for k, v in base.items()}
    for _ in range(count)
]
digest = hashlib.sha256()
"""
"""A child's start: the pool of states (the same draws in every case) and the digest of the
first 8 means."""

TIMED = """
print(json.dumps({"us": (time.perf_counter() - start) / count * 1e6, "sha": digest.hexdigest()}))
"""
"""A child's end: its time per mix since ``start`` and the digest."""

CHILD = (
    POOL
    + """
start = time.perf_counter()
for i in range(count):
    mean = average_states([pool[i - 1], pool[i], pool[(i + 1) % count]])
    if i < 8:
        digest.update(b"".join(t.numpy().tobytes() for t in mean.values()))
"""
    + TIMED
)

TOGETHER = (
    POOL
    + """
c = int(sys.argv[3])
# peer i's ring neighbours i-1, i, i+1 are rows i, i+1, i+2 of the pool wrapped by one row
ring = {k: torch.stack([pool[-1][k], *(p[k] for p in pool), pool[0][k]]) for k in base}
del pool
wide = {k: torch.empty((c, *v.shape), dtype=torch.float64) for k, v in base.items()}
acc = {k: torch.empty((c, *v.shape), dtype=torch.float64) for k, v in base.items()}
start = time.perf_counter()
for s in range(0, count, c):
    n = min(c, count - s)
    mean = {}
    for k, v in base.items():
        a, w = acc[k][:n], wide[k][:n]
        a.zero_()
        for o in range(3):
            a.add_(w.copy_(ring[k][s + o : s + o + n]), alpha=1 / 3)
        mean[k] = (a if v.is_floating_point() else a.round()).to(v.dtype)
    for i in range(s, min(s + n, 8)):
        digest.update(b"".join(t[i - s].numpy().tobytes() for t in mean.values()))
"""
    + TIMED
)


def mix(tree: Path, options: dict, count: int, together: int = 0) -> dict:
    """One process: ``count`` mixes of ``options``' model with the package in ``tree``, one
    at a time, or ``together`` at a time from one tensor per parameter."""
    env = os.environ | {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    code, more = (TOGETHER, [str(together)]) if together else (CHILD, [])
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(options), str(count), *more],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="also run the package from this directory")
    parser.add_argument("--states", type=int, default=4000, help="states in each pool")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--together", type=int, nargs="*", default=[], help="also mix C ring peers at a time"
    )
    args = parser.parse_args()
    trees = {"this": ROOT} | ({"base": args.base.resolve()} if args.base else {})
    cases = {tree: (path, 0) for tree, path in trees.items()}
    cases |= {f"together {c}": (ROOT, c) for c in args.together}
    rows = []
    for label, options in MODELS.items():
        times: dict[str, list[float]] = {case: [] for case in cases}
        digests = set()
        for _ in range(args.repeats):
            for case, (path, together) in cases.items():
                got = mix(path, options, args.states, together)
                times[case].append(got["us"])
                digests.add(got["sha"])
        row = [label, statistics.median(times["this"])]
        if args.base:
            base = statistics.median(times["base"])
            row += [base, base / row[1]]
        row += [statistics.median(times[f"together {c}"]) for c in args.together]
        row += ["yes" if len(digests) == 1 else "NO"]
        rows.append(row)
    columns = ["model", "us_per_mix"]
    if args.base:
        columns += ["base_us_per_mix", "speedup"]
    columns += [f"us_per_mix_{c}_together" for c in args.together] + ["same_bits"]
    report(
        "mixing",
        columns,
        rows,
        {"states": args.states, "repeats": args.repeats, "together": args.together},
    )


if __name__ == "__main__":
    main()
