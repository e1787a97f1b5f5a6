"""What a ``p2pfl`` command costs besides its run: start-up (imports, data, figure) and exit.

Each case is a whole command as a user types it (one thread unless ``--threads``), timed
from outside, with its CPU seconds (user + system, the children it waited for included);
the run's own ``wall_time_s`` (from ``summary.json``) is taken off, which leaves what the
command adds. ``import torch`` alone is the floor of every case that runs; ``plot`` and
``report`` read a quick-start run made once, and need no torch; with ``--run DIR`` they
read that finished run too (the shipped 10⁵-peer gossip run: 10⁶ messages).
``--against DIR`` times a second checkout (another commit: ``git worktree add DIR REV``) in
the same loop, alternating with this one, so the two are measured side by side.

    .venv/bin/python benchmarks/startup.py [--repeats 3] [--against DIR] [--threads 0]
        [--cases WORD ...] [--run DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import vs_flower
from common import ROOT, p2pfl_command, report

CASES = {
    "python -c 'import torch'": ["-c", "import torch"],
    "help": ["--help"],
    "quickstart (digits, 10 peers)": ["run", "experiments/quickstart.yaml"],
    "fedavg-fmnist, 1 round (Fashion-MNIST, 10 peers)": [
        "run", "experiments/fedavg-fmnist.yaml", "--set", "algorithm.rounds=1",
    ],
    "the same, --workers 2": [
        "run", "experiments/fedavg-fmnist.yaml", "--set", "algorithm.rounds=1", "--workers", "2",
    ],
    "the same with LeNet-5, one worker": [
        "run", "experiments/fedavg-fmnist.yaml", "--set", "algorithm.rounds=1",
        "--set", "model={name: lenet}",
    ],
    "the race against Flower (vs_flower.py), --workers 2": [
        "run", "{race}", "--workers", "2",  # vs_flower.CONFIG, written to a file
    ],
    "p2pfl plot of the quick-start's run": ["plot", "{quickstart}", "--out", "{tmp}/plots"],
    "p2pfl report of the quick-start's run": [
        "report", "{quickstart}", "--out", "{tmp}/report.html",
    ],
}  # fmt: skip
GIVEN_RUN = {
    "p2pfl plot of --run": ["plot", "{run}", "--out", "{tmp}/plots"],
    "p2pfl report of --run": ["report", "{run}", "--out", "{tmp}/report.html"],
}
"""The cases of ``--run DIR``."""


def command(checkout: Path, args: list[str], threads: int) -> tuple[float, float, float]:
    """One command in ``checkout`` (its own ``p2pfl`` package): its wall time, its run's
    ``wall_time_s`` (0 for a command that runs nothing) and its CPU seconds. A case that
    starts with ``-c`` is ``python -c CODE``, not ``p2pfl``."""
    env = environment(checkout, threads)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    if args[0] == "-c":
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], env=env, cwd=checkout, check=True)
        wall, summary = time.perf_counter() - start, None
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "out") if args[0] == "run" else None
            wall, summary = p2pfl_command(args, env, out, checkout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, summary["wall_time_s"] if summary else 0.0, cpu


def environment(checkout: Path, threads: int) -> dict[str, str]:
    """The command's environment: ``checkout``'s package first, ``threads`` torch threads
    (0: torch's default, one per core)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return (
        env | {"PYTHONPATH": str(checkout)} | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", type=Path, help="a second checkout, timed alongside")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: one per core)")
    parser.add_argument("--cases", nargs="+", help="only the cases whose name holds one of these")
    parser.add_argument("--run", type=Path, help="a finished run the plot and report cases read")
    args = parser.parse_args()
    cases = {
        name: cmd for name, cmd in (CASES | (GIVEN_RUN if args.run else {})).items()
        if not args.cases or any(word in name for word in args.cases)
    }  # fmt: skip
    checkouts = {"this": ROOT} | ({"against": args.against.resolve()} if args.against else {})
    config = copy.deepcopy(vs_flower.CONFIG)
    config["peers"]["batched"] = True
    times: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        race = Path(tmp, "race.yaml")
        race.write_text(json.dumps(config))  # JSON is YAML
        quickstart = Path(tmp, "quickstart")  # what the plot and report cases read
        if any(r"{quickstart}" in a for cmd in cases.values() for a in cmd):
            p2pfl_command(["run", "experiments/quickstart.yaml"], environment(ROOT, 1), quickstart)
        fill = {"{race}": str(race), "{quickstart}": str(quickstart), "{tmp}": tmp}
        fill["{run}"] = str(args.run.resolve() if args.run else "")
        for _ in range(args.repeats):
            for case, cmd in cases.items():
                for key, value in fill.items():
                    cmd = [a.replace(key, value) for a in cmd]
                for name, checkout in checkouts.items():
                    sample = command(checkout, cmd, args.threads)
                    times.setdefault((case, name), []).append(sample)
    rows = []
    for (case, name), runs in times.items():
        wall = statistics.median(w for w, _, _ in runs)
        run = statistics.median(r for _, r, _ in runs)
        cpu = statistics.median(c for _, _, c in runs)
        least = min(w for w, _, _ in runs)
        this = statistics.median(w for w, _, _ in times[case, "this"])
        rows.append([case, name, wall, least, cpu, run, wall - run, wall / this])
    extra = {
        "repeats": args.repeats, "against": str(args.against), "threads": args.threads,
        "run": str(args.run),
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }  # fmt: skip
    columns = ["case", "checkout", "command_s", "least_command_s", "cpu_s", "run_s", "added_s",
               "command_vs_this"]  # fmt: skip
    report("startup", columns, rows, extra)


if __name__ == "__main__":
    main()
