"""Churn: the wall time of a 1,000-peer simulated run with churn against the same run without.

FedAvg with a round deadline (``deadline_s``) on a star of 1,000 peers, 10 % of them per round,
Fashion-MNIST (60 samples per peer, IID), a tiny MLP (784-8-10) with ``compute: model`` (the
simulated clock comes from FLOPs, so both runs are deterministic and neither waits on a
measured time). Two cases, run side by side in one invocation, in alternating order,
``--repeats`` times each (the median is reported):

- ``plain``: no ``network:`` section — the simulator exactly as before the network model;
- ``churn``: ``network.churn`` with every peer alternating online and offline sessions
  (exponential, online mean 20 s, 30 % of the time offline) and jitter on every link, so
  every ``Send``/``Train`` asks whether its node is online, every message gets a fate, the
  server asks who is reachable each round (a ``Neighbours`` over 1,000 peers) and the
  sessions of 1,000 peers are drawn as the clock advances; ``availability.csv`` is written.

What makes the comparison fair: churn changes who trains, and a training is most of a
run's cost, so a run whose churn cut the trainings would look cheaper. Here the server
samples its 100 peers among those online (as it does with ``deadline_s`` in both cases), so
both runs train about the same number of local models: the table shows the trainings (model
uploads sent) and messages of each; the tiny model and the model-based clock make the
simulator's own work (the part churn adds to) weigh as much as it can. The table also gives
the extra wall time per message (the cost per network event), which does not depend on how
much training a run does.

The goal: churn costs at most 10 % more wall time (ratio <= 1.10).

    OMP_NUM_THREADS=1 python benchmarks/churn.py [--repeats 5] [--peers 1000] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

import p2pfl  # noqa: E402
from p2pfl.app.config import resolve  # noqa: E402
from p2pfl.app.experiment import _simulate, build  # noqa: E402
from p2pfl.reporting.reporters import open_reporters  # noqa: E402

CONFIG: dict[str, Any] = {
    "name": "churn-bench",
    "seed": 0,
    "dataset": {"name": "fashion_mnist", "subset": 60000, "test_subset": 500},
    "partition": {"name": "iid"},
    "model": {"name": "mlp", "hidden": [8]},
    "topology": {"kind": "star"},
    "peers": {"count": 1000, "compute": "model"},
    "algorithm": {"name": "fedavg", "rounds": 20, "participation": 0.1, "deadline_s": 1.0},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
    "eval": {"every": 20, "per_peer": False},
}
NETWORK = {
    "churn": {"online": {"dist": "exponential", "mean_s": 20.0}, "offline_fraction": 0.3},
    "links": {"jitter": {"dist": "exponential", "mean_s": 0.002}},
}
CASES = {"plain": None, "churn": NETWORK}


def config(case: str, peers: int) -> dict[str, Any]:
    c = copy.deepcopy(CONFIG)
    c["peers"]["count"] = peers
    if CASES[case] is not None:
        c["network"] = copy.deepcopy(CASES[case])
    return c


def once(case: str, peers: int) -> dict[str, Any]:
    """One run of ``case``: its summary (``wall_time_s`` is the run alone: no build, no
    partition figure) and the trainings (model uploads) in its ``comm.csv``."""
    with tempfile.TemporaryDirectory() as out:
        result = p2pfl.run(config(case, peers), out=out)
        comm = result.comm
    uploads = (comm["kind"] == "model") & (comm["src"] != "server")
    return result.summary | {"trainings": int(uploads.sum())}


def profiled(case: str, peers: int) -> tuple[str, float, float]:
    """cProfile of one simulation of ``case`` (the runtime and its outputs, as in a run):
    the top functions by own time, the total and the own time spent in the network model
    (``p2pfl/network/dynamics.py``)."""
    setup = build(resolve(config(case, peers), Path("churn.yaml")))
    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory() as out:
        reporters = open_reporters(Path(out))
        prof.enable()
        _simulate(setup, Path(out), False, reporters)
        prof.disable()
        reporters.close()
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]
    network = sum(
        row[2] for (file, _, _), row in stats.stats.items()  # type: ignore[attr-defined]
        if file.endswith("dynamics.py")
    )  # fmt: skip
    text = io.StringIO()
    stats.stream = text  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(15)
    return text.getvalue(), total, network


def row(case: str, s: dict[str, Any]) -> dict[str, Any]:
    fates = s["comm"].get("by_fate", {})
    return {
        "case": case,
        "wall_s": s["wall_time_s"],
        "train_eval_s": s["compute_wall_s"],
        "sim_overhead_s": s["wall_time_s"] - s["compute_wall_s"],
        "messages": s["comm"]["messages"],
        "trainings": s["trainings"],
        "not_delivered": sum(v["messages"] for k, v in fates.items() if k != "delivered"),
        "sim_time_s": s["sim_time_s"],
        "accuracy": s["final"]["accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--profile", action="store_true", help="cProfile one run of each case")
    args = parser.parse_args()
    once("plain", args.peers)  # warm-up: torch, the data cache
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    for i in range(args.repeats):
        order = list(CASES) if i % 2 == 0 else list(reversed(CASES))  # alternate: fair to load
        for case in order:
            runs[case].append(row(case, once(case, args.peers)))
    columns = list(runs["plain"][0])
    rows = [[r[k] for k in columns] for case in CASES for r in runs[case]]
    median = {
        case: {k: statistics.median(r[k] for r in runs[case]) for k in columns if k != "case"}
        for case in CASES
    }
    plain, churn = median["plain"], median["churn"]
    ratio = churn["wall_s"] / plain["wall_s"]
    per_message_us = (churn["wall_s"] - plain["wall_s"]) / churn["messages"] * 1e6
    extra = {
        "config": CONFIG,
        "network": NETWORK,
        "peers": args.peers,
        "median": median,
        "ratio": ratio,
        "sim_overhead_ratio": churn["sim_overhead_s"] / plain["sim_overhead_s"],
        "extra_us_per_message": per_message_us,
        "goal": 1.10,
        "load": os.getloadavg(),
    }
    if args.profile:
        for case in CASES:
            text, total, network = profiled(case, args.peers)
            extra[f"profile_{case}"] = {"total_s": total, "network_model_s": network}
            print(f"--- cProfile, {case}: {total:.2f} s in all, {network:.3f} s own time in "
                  f"the network model (dynamics.py); top 15 by own time ---\n{text}")  # fmt: skip
    report("churn", ["run", *columns[1:]], [[f"{r[0]}", *r[1:]] for r in rows], extra)
    print(
        f"{args.peers} peers: median wall {plain['wall_s']:.2f} s without churn, "
        f"{churn['wall_s']:.2f} s with churn: ratio {ratio:.3f} (goal <= 1.10); "
        f"{churn['trainings']:.0f} vs {plain['trainings']:.0f} trainings; "
        f"{per_message_us:+.1f} us per message; load average {extra['load']}"
    )


if __name__ == "__main__":
    main()
