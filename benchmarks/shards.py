"""A population sharded across ranks (``--shard``, ``--shard-events``): memory and time per rank
against the number of ranks.

Runs one of ``benchmarks/population.py``'s workloads (default: DFedAvgM on a ring of 10,000
peers, MLP 784-64-10) as a user types it, ``p2pfl run EXP --workers N --shard`` (each rank
holds its peers' models, every rank simulates every peer) and ``--shard-events`` (each rank
also simulates only its own peers), for each N (N = 1: one process, no flag). It samples
every rank's memory every 0.1 s from outside: its peak proportional set size (PSS: pages
shared with the other ranks, forked from rank 0 with torch and the data, count a 1/k share
in each of k), its peak resident set (RSS), and the sum of the ranks' PSS at the moment it
peaked (the run's memory on this host). It also gives the run's wall and CPU seconds (every
rank's user + system) and checks that every run wrote the bytes of one process
(``comm.csv``, ``metrics.csv``, ``summary.json`` minus wall times).

    OMP_NUM_THREADS=1 python benchmarks/shards.py [--workload dfedavgm] [--peers 10000] \
        [--ranks 1 2 4] [--modes shard shard-events]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, report  # noqa: E402
from population import WORKLOADS  # noqa: E402

GiB = 2**30


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (the ranks; not the partition figure's child)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "p2pfl-figure":
                    continue
            found.append(pid)
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:  # it ended meanwhile
            continue
    return found


def _memory(pid: int) -> tuple[int, int] | None:
    """``pid``'s (PSS, RSS) in bytes, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = {
                k: int(v.split()[0]) << 10
                for k, v in (
                    x.split(":", 1)
                    for x in f
                    if ":" in x and x.split(":", 1)[1].strip().endswith("kB")
                )
            }
    except (OSError, ValueError):
        return None
    return fields.get("Pss", 0), fields.get("Rss", 0)


class Sampler(threading.Thread):
    """Every rank's peak PSS and RSS, and the peak of their PSS summed, sampled every 0.1 s."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.pss: dict[int, int] = {}
        self.rss: dict[int, int] = {}
        self.total = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            now = 0
            for pid in _tree(self.root):
                if (m := _memory(pid)) is None:
                    continue
                self.pss[pid] = max(self.pss.get(pid, 0), m[0])
                self.rss[pid] = max(self.rss.get(pid, 0), m[1])
                now += m[0]
            self.total = max(self.total, now)


def measure(exp: Path, ranks: int, out: Path, mode: str = "shard") -> dict[str, Any]:
    """One run of ``exp`` on ``ranks`` ranks (sharded by ``--MODE`` where more than one)."""
    cmd = [sys.executable, "-m", "p2pfl", "run", str(exp), "--out", str(out), "--quiet"]
    cmd += ["--force"]
    if ranks > 1:
        cmd += ["--workers", str(ranks), f"--{mode}"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    err = proc.stderr.read() if proc.stderr else ""
    if status:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "mode": mode if ranks > 1 else "one process",
        "ranks": ranks,
        "wall_s": wall,
        "run_wall_s": summary["wall_time_s"],
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "rank_pss_peak": max(sampler.pss.values()),
        "rank_rss_peak": max(sampler.rss.values()),
        "pss_peak_total": sampler.total,
        "processes": len(sampler.pss),
        "accuracy": summary["final"]["accuracy"],
    }


def _outputs(out: Path) -> tuple[bytes, bytes, dict[str, Any]]:
    summary = json.loads((out / "summary.json").read_text())
    for key in ("wall_time_s", "compute_wall_s"):
        summary.pop(key)
    return (out / "comm.csv").read_bytes(), (out / "metrics.csv").read_bytes(), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="dfedavgm", choices=sorted(WORKLOADS))
    parser.add_argument("--peers", type=int, default=10_000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["shard", "shard-events"])
    parser.add_argument("--name", default="shards")
    args = parser.parse_args()
    config = WORKLOADS[args.workload] | {"name": f"shards-{args.workload}"}
    config["peers"] = config["peers"] | {"count": args.peers}
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="p2pfl-shards") as tmp:
        exp = Path(tmp) / "exp.yaml"
        exp.write_text(yaml.safe_dump(config, sort_keys=False))
        first = None
        plan = [(m, n) for n in args.ranks for m in (args.modes if n > 1 else ["shard"])]
        for mode, n in plan:
            out = Path(tmp) / f"{mode}-{n}"
            r = measure(exp, n, out, mode)
            same = first is None or _outputs(out) == first
            first = first or _outputs(out)
            r["same_bytes"] = same
            runs.append(r)
            rows.append(
                [
                    r["mode"], n, f"{r['run_wall_s']:.1f}", f"{r['cpu_s']:.1f}",
                    f"{r['rank_pss_peak'] / GiB:.2f}", f"{r['rank_rss_peak'] / GiB:.2f}",
                    f"{r['pss_peak_total'] / GiB:.2f}", "yes" if same else "NO",
                ]
            )  # fmt: skip
            print(rows[-1], flush=True)
    columns = [
        "mode", "ranks", "run wall s", "CPU s (all ranks)", "peak PSS per rank GiB",
        "peak RSS per rank GiB", "peak PSS, ranks summed GiB", "bytes of 1 process",
    ]  # fmt: skip
    report(
        args.name, columns, rows,
        {"workload": args.workload, "peers": args.peers, "runs": runs, "load": os.getloadavg()},
    )  # fmt: skip


if __name__ == "__main__":
    main()
