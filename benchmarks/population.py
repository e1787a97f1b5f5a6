"""How many peers: memory and time of one simulated run against its population (issue 38).

Two workloads, each run in a fresh child process per population size, so that every
figure is its own:

- ``dfedavgm``: DFedAvgM on a ring, Fashion-MNIST split IID, MLP 784-64-10 (a 203,560-byte
  state), 3 rounds, ``peers.batched: true``, ``eval: {every: 3, per_peer: false}`` and a
  1,000-image test subset (``benchmarks/scale.py``'s: with the whole 10,000-image test set
  the round-3 scores alone are 10^9 FLOP per peer, 10^13 at 10^4 peers);
- ``scale``: ``benchmarks/scale.py``'s DFedAvgM (ring, Dirichlet(0.5), MLP 784-200-10, a
  636,040-byte state): the 1,000-peer figure that must not get slower;
- ``gossip``: gossip learning with multinomial logistic regression (a 31,400-byte state) on
  a random 4-regular graph, 10 periods, the same evaluation; each peer draws 5 distinct
  Fashion-MNIST images of its own (``partition: {name: iid, samples_per_peer: 5, replace:
  true}``), so every population size does the same work per peer, up to 100,000 peers from
  60,000 images.

Each child builds the run (``rss_setup``: the interpreter, torch and the data), runs the
simulation (``_simulate``: the run as ``summary.json``'s ``wall_time_s`` counts it, without
the final scoring and files), then reads, with every peer idle and holding only its final
state: the resident set (``rss_idle``; glibc keeps freed buffers, so it is nearly the peak)
and the same after ``malloc_trim`` (``rss_idle_trimmed``: what is live), the peak resident
set of the whole child
(``rss_peak``, ``getrusage``'s ``ru_maxrss``) and the run's CPU seconds (user + system,
which the machine's load inflates less than wall seconds). The fits are least squares over
every population measured: ``a + b·N`` (``b`` bytes per peer, as a multiple of the state)
and the exponent ``k`` of ``c·N^k`` (1.0: linear growth).

``--base DIR`` runs every child a second time with the package from ``DIR`` (a
``git worktree`` of an older revision), interleaved with this tree's, so before and after are
measured side by side under the same load.

Every child runs under the allocator settings that the ``p2pfl`` command starts under
(``p2pfl.app.cli.ALLOCATOR``: no thread cache or fast bins, so a freed model's block is
reused by the next model); ``--glibc-default`` also runs this tree's children under glibc's
defaults, interleaved, as every run was measured before.

``--mmap-threshold BYTES`` runs the children with glibc's ``MALLOC_MMAP_THRESHOLD_``: blocks
above it are mapped on their own and given back when freed, so short-lived buffers (gossip's
float64 averages, twice a logistic-regression state) do not fragment the heap that the
states live in.

    OMP_NUM_THREADS=1 python benchmarks/population.py [--workload dfedavgm] \
        [--peers 1000 2000 3000 5000 10000] [--base /tmp/wt-old] [--name population] \
        [--mmap-threshold 49152] [--glibc-default]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKLOADS: dict[str, dict[str, Any]] = {
    "dfedavgm": {
        "name": "population-dfedavgm",
        "seed": 0,
        "dataset": {"name": "fashion_mnist", "test_subset": 1000},
        "partition": {"name": "iid"},
        "model": {"name": "mlp", "hidden": [64]},
        "topology": {"kind": "ring"},
        "peers": {"count": 1000, "batched": True},
        "algorithm": {"name": "dfedavgm", "rounds": 3},
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        "eval": {"every": 3, "per_peer": False},
    },
    "scale": {  # benchmarks/scale.py's DFedAvgM: the 1,000-peer figure to keep
        "name": "population-scale",
        "seed": 0,
        "dataset": {"name": "fashion_mnist", "test_subset": 1000},
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 2},
        "model": {"name": "mlp", "hidden": [200]},
        "topology": {"kind": "ring"},
        "peers": {"count": 1000, "batched": True, "link": {"bandwidth_bps": 1e9}},
        "algorithm": {"name": "dfedavgm", "rounds": 3},
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        "eval": {"every": 3, "per_peer": False},
    },
    "gossip": {
        "name": "population-gossip",
        "seed": 0,
        "dataset": {"name": "fashion_mnist", "test_subset": 1000},
        # each peer draws 5 distinct images to train on (what IID gives at 10^4 peers), the
        # peers independently: the same work per peer at any N, 10^5 peers from 60,000
        # images; no validation split (gossip trains with select: last, never reads it)
        "partition": {"name": "iid", "samples_per_peer": 5, "replace": True, "val_fraction": 0},
        "model": {"name": "mlp", "hidden": []},  # logreg (older trees lack its name)
        "topology": {"kind": "random_regular", "d": 4},
        "peers": {"count": 1000, "batched": True},
        "algorithm": {"name": "gossip", "rounds": 10},
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 10, "per_peer": False},
    },
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(workload: str, peers: int, threads: int) -> dict[str, Any]:
    """One run in this (fresh) process; its memory and time figures."""
    import torch

    from p2pfl.app.config import resolve
    from p2pfl.app.experiment import _simulate, build
    from p2pfl.learning.state import state_bytes
    from p2pfl.reporting.reporters import open_reporters

    torch.set_num_threads(threads)
    config = copy.deepcopy(WORKLOADS[workload])
    config["peers"]["count"] = peers
    start = time.perf_counter()
    setup = build(resolve(config, Path(f"{workload}.yaml")))
    build_s = time.perf_counter() - start
    gc.collect()
    before, cpu0 = rss_bytes(), cpu_s()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        reporters = open_reporters(Path(out))
        finals, _, clock, comm, _ = _simulate(setup, Path(out), False, reporters)
        reporters.close()
        wall, cpu = time.perf_counter() - start, cpu_s() - cpu0
        metrics = (Path(out) / "metrics.csv").read_bytes()
    gc.collect()
    idle = rss_bytes()
    ctypes.CDLL(None).malloc_trim(0)  # the heap's free pages back: what is live
    trimmed = rss_bytes()
    states = [f.state for f in finals.values() if f.state is not None]
    data = setup.data
    import p2pfl

    return {
        "package": str(Path(p2pfl.__file__).parent),
        "peers": peers,
        "build_s": build_s,
        "wall_s": wall,
        "cpu_s": cpu,
        "sim_s": clock,
        "messages": comm["messages"],
        "rss_setup": before,
        "rss_idle": idle,
        "rss_idle_trimmed": trimmed,
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "state_bytes": state_bytes(states[0]),
        "held_state_bytes": sum(state_bytes(s) for s in states),
        "dataset_bytes": sum(
            t.untyped_storage().nbytes() for t in {id(t): t for t in _data_tensors(data)}.values()
        ),
        "metrics_crc": _crc(metrics),
    }


def _data_tensors(data: Any) -> list[Any]:
    """The dataset's tensors, each storage once (the peers' splits are views of a few, or
    rows of the dataset's: ``PeerData.rows``, which older trees lack)."""
    seen: dict[int, Any] = {}
    for p in data.peers:
        own = [p.source_x, p.source_y, p.rows] if hasattr(p, "rows") else [p.train_x, p.train_y]
        for t in (*own, p.val_x, p.val_y):
            if t is not None:
                seen.setdefault(t.untyped_storage().data_ptr(), t)
    for t in (data.test_x, data.test_y):
        seen.setdefault(t.untyped_storage().data_ptr(), t)
    return list(seen.values())


def _crc(data: bytes) -> str:
    import zlib

    return f"{zlib.crc32(data):08x}"


def fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares ``y = a + b·x``, its R², and the exponent ``k`` of ``y = c·x^k``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    r2 = 1 - sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True)) / ss if ss else 1.0
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mlx, mly = sum(lx) / n, sum(ly) / n
    k = sum((u - mlx) * (v - mly) for u, v in zip(lx, ly, strict=True)) / sum(
        (u - mlx) ** 2 for u in lx
    )
    return {"a": a, "b": b, "r2": r2, "k": k}


def main() -> None:
    from common import report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="dfedavgm")
    parser.add_argument("--peers", type=int, nargs="+", default=[1000, 2000, 3000, 5000, 10000])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--base", type=Path, help="also run the package from this directory")
    parser.add_argument(
        "--base-peers", type=int, default=None, help="run --base only up to this many peers"
    )
    parser.add_argument(
        "--name", default=None, help="results/NAME.json (default: population-WORKLOAD)"
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="run the children with MALLOC_MMAP_THRESHOLD_=BYTES (glibc: larger blocks are "
        "mapped and returned when freed; gossip: 49152, above a logreg state, below its "
        "float64 average)",
    )
    parser.add_argument(
        "--glibc-default",
        action="store_true",
        help="also run this tree under glibc's default allocator settings, not the p2pfl "
        "command's (ALLOCATOR), side by side",
    )
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "PEERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.threads)))
        return
    from p2pfl.app.cli import ALLOCATOR  # not in a child: --base trees lack it

    here = Path(__file__).resolve().parents[1]
    trees = {"this": here} | ({"base": args.base.resolve()} if args.base else {})
    if args.glibc_default:
        trees["glibc-default"] = here
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "GLIBC_TUNABLES": ALLOCATOR}
    if args.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    loads = {"before": os.getloadavg()}
    for n in args.peers:
        for tree, root in trees.items():
            if tree == "base" and args.base_peers is not None and n > args.base_peers:
                continue
            cmd = [sys.executable, __file__, "--child", args.workload, str(n),
                   "--threads", str(args.threads)]  # fmt: skip
            out = subprocess.run(
                cmd, check=True, capture_output=True, text=True, cwd=root,
                env=env | {"PYTHONPATH": str(root)}
                | ({"GLIBC_TUNABLES": ""} if tree == "glibc-default" else {}),
            ).stdout  # fmt: skip
            r = json.loads(out.splitlines()[-1]) | {"load": os.getloadavg()[0]}
            runs[tree].append(r)
            print(f"{tree} {n}: wall {r['wall_s']:.1f} s, cpu {r['cpu_s']:.1f} s, peak "
                  f"{r['rss_peak'] / 2**30:.2f} GiB, idle {r['rss_idle'] / 2**30:.2f} GiB, "
                  f"load {r['load']:.1f}", flush=True)  # fmt: skip
    loads["after"] = os.getloadavg()
    gib = 1 << 30
    rows = []
    for tree, rs in runs.items():
        for r in rs:
            goal = 1.5 * r["peers"] * r["state_bytes"] + r["rss_setup"]
            rows.append(
                [tree, r["peers"], r["wall_s"], r["cpu_s"], r["rss_setup"] / gib,
                 r.get("rss_idle_trimmed", r["rss_idle"]) / gib, r["rss_peak"] / gib, goal / gib,
                 (r.get("rss_idle_trimmed", r["rss_idle"]) - r["rss_setup"]) / r["peers"]
                 / r["state_bytes"],
                 (r["rss_peak"] - r["rss_setup"]) / r["peers"] / r["state_bytes"],
                 r["load"], r["metrics_crc"]]
            )  # fmt: skip
    fits: dict[str, Any] = {}
    for tree, rs in runs.items():
        if len({r["peers"] for r in rs}) < 2:  # one population size: no fit
            continue
        xs = [float(r["peers"]) for r in rs]
        fits[tree] = {
            key: fit(xs, [float(r[key]) for r in rs])
            for key in ("rss_idle", "rss_idle_trimmed", "rss_peak", "wall_s", "cpu_s")
            if all(key in r for r in rs)
        }
        state = rs[0]["state_bytes"]
        for key in ("rss_idle_trimmed", "rss_peak"):
            if key not in fits[tree]:
                continue
            f = fits[tree][key]
            print(f"{tree}: {key} = {f['a'] / gib:.3f} GiB + N x {f['b'] / 1e3:.1f} kB "
                  f"({f['b'] / state:.2f}x the state), R^2 {f['r2']:.4f}, "
                  f"~N^{f['k']:.2f}")  # fmt: skip
        for key in ("wall_s", "cpu_s"):
            f = fits[tree][key]
            print(f"{tree}: {key} = {f['a']:.2f} s + N x {f['b'] * 1e3:.3f} ms, "
                  f"R^2 {f['r2']:.4f}, ~N^{f['k']:.2f}")  # fmt: skip
    columns = ["tree", "peers", "wall_s", "cpu_s", "setup_gib", "live_gib", "peak_gib",
               "goal_gib", "live_per_state", "peak_per_state", "load", "metrics_crc"]  # fmt: skip
    extra = {"workload": WORKLOADS[args.workload], "runs": runs, "fits": fits, "loads": loads,
             "trees": {k: str(v) for k, v in trees.items()},
             "malloc_mmap_threshold": args.mmap_threshold}  # fmt: skip
    report(args.name or f"population-{args.workload}", columns, rows, extra)
    print(f"load average before {loads['before']}, after {loads['after']}")


if __name__ == "__main__":
    main()
