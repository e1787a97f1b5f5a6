"""Scale: resident memory against the number of simulated peers, in one process each.

FedAvg (star, 10% of the peers per round) and DFedAvgM (ring) on Fashion-MNIST split
Dirichlet(0.5), MLP 784-200-10, for 10, 100 and 1,000 peers. Each run is a fresh child
process, so its memory is its own. After the run every peer is idle and holds only its
model state (its ``Finish``); the child then reads its resident set size (RSS, also after
``malloc_trim``, which hands freed heap pages back) and its peak RSS. The memory per idle
peer is the RSS slope between the smallest and the largest run, against the model's size
in bytes (a peer's persistent state); the goal is at most 1.5x.

Each run is made three times: with glibc's default allocator settings, whose mmap threshold
grows as large buffers are freed, so freed model-sized buffers stay in the heap and in the
RSS; and with ``MALLOC_MMAP_THRESHOLD_=262144``, which keeps every buffer of 256 KiB or more
in its own mapping, handed back to the system when freed (at the cost of page faults);
and a third time under the settings every ``p2pfl`` command starts under
(``p2pfl.app.cli.ALLOCATOR``: no thread cache or fast bins, so a freed model's block is
reused by the next model).

torch computes on ``--threads`` threads (default 1; issue 16's 1,000-peer goal is about every
core, so ``--threads 2`` on this 2-core machine).

    OMP_NUM_THREADS=1 python benchmarks/scale.py [--peers 10 100 1000] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

from p2pfl.app.cli import ALLOCATOR  # noqa: E402

CONFIG = {
    "name": "scale",
    "seed": 0,
    "dataset": {"name": "fashion_mnist", "test_subset": 1000},
    "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 2},
    "model": {"name": "mlp", "hidden": [200]},
    "peers": {"count": 10, "batched": True, "link": {"bandwidth_bps": 1e9}},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
    "eval": {"per_peer": False},
}
ALLOCATORS = {
    "default": {"GLIBC_TUNABLES": ""},
    "mmap>=256KiB": {"GLIBC_TUNABLES": "", "MALLOC_MMAP_THRESHOLD_": "262144"},
    "p2pfl command": {"GLIBC_TUNABLES": ALLOCATOR},
}
METHODS = {
    "fedavg": ({"kind": "star"}, {"name": "fedavg", "participation": 0.1}),
    "dfedavgm": ({"kind": "ring"}, {"name": "dfedavgm"}),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(method: str, peers: int, rounds: int, threads: int) -> dict:
    """One run in this process; returns its memory figures (called in a fresh process)."""
    import torch

    from p2pfl.app.config import resolve
    from p2pfl.app.experiment import _simulate, build
    from p2pfl.learning.state import state_bytes
    from p2pfl.reporting.reporters import open_reporters

    torch.set_num_threads(threads)
    config = copy.deepcopy(CONFIG)
    config["topology"], config["algorithm"] = copy.deepcopy(METHODS[method])
    config["algorithm"]["rounds"] = rounds
    config["peers"]["count"] = peers
    config["eval"]["every"] = rounds
    setup = build(resolve(config, Path("scale.yaml")))
    gc.collect()
    before = rss_bytes()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        reporters = open_reporters(Path(out))
        finals, _, clock, *_ = _simulate(setup, Path(out), False, reporters)
        reporters.close()
    wall = time.perf_counter() - start
    gc.collect()
    held = rss_bytes()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = rss_bytes()
    states = [f.state for f in finals.values() if f.state is not None]
    return {
        "rss_setup": before,
        "rss_idle": held,
        "rss_idle_trimmed": trimmed,
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "state_bytes": state_bytes(states[0]),
        "held_state_bytes": sum(state_bytes(s) for s in states),
        "wall_s": wall,
        "sim_s": clock,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "PEERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.rounds, args.threads)))
        return
    mib = 1 << 20
    rows, extra = [], {"config": CONFIG, "methods": METHODS, "threads": args.threads}
    extra["load_before"] = os.getloadavg()
    for method in METHODS:
        for allocator, env in ALLOCATORS.items():
            runs = {}
            for n in args.peers:
                cmd = [sys.executable, __file__, "--child", method, str(n), "--rounds",
                       str(args.rounds), "--threads", str(args.threads)]  # fmt: skip
                out = subprocess.run(
                    cmd, check=True, capture_output=True, text=True, env=os.environ | env
                ).stdout
                runs[n] = r = json.loads(out.splitlines()[-1])
                rows.append(
                    [method, allocator, n, r["rss_setup"] / mib, r["rss_idle"] / mib,
                     r["rss_idle_trimmed"] / mib, r["rss_peak"] / mib,
                     r["held_state_bytes"] / mib, r["wall_s"], r["sim_s"]]
                )  # fmt: skip
            lo, hi = runs[min(args.peers)], runs[max(args.peers)]
            span = max(args.peers) - min(args.peers)
            if not span:  # one peer count: times and memory, but no slope per peer
                continue
            extra[f"{method}/{allocator}"] = {
                key: (hi[key] - lo[key]) / span / hi["state_bytes"]
                for key in ("rss_idle", "rss_idle_trimmed", "rss_peak")
            } | {"state_bytes": hi["state_bytes"]}
    extra["load_after"] = os.getloadavg()
    columns = ["method", "allocator", "peers", "rss_setup_mib", "rss_idle_mib",
               "rss_trimmed_mib", "rss_peak_mib", "peer_states_mib", "wall_s", "sim_s"]  # fmt: skip
    report("scale", columns, rows, extra | {"goal_per_peer_over_state": 1.5})
    for method in METHODS:
        for allocator in ALLOCATORS:
            if (r := extra.get(f"{method}/{allocator}")) is None:
                continue
            print(
                f"{method}, {allocator}: memory per idle peer {r['rss_idle']:.2f}x its state "
                f"({r['state_bytes']} bytes), after malloc_trim {r['rss_idle_trimmed']:.2f}x, "
                f"peak {r['rss_peak']:.2f}x (goal: idle <= 1.5x)"
            )
    print(f"load average before {extra['load_before']}, after {extra['load_after']}")


if __name__ == "__main__":
    main()
