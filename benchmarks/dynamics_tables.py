"""The tables of docs/dynamics.md, from the sweeps it runs (``runs/dynamics-*``, ``runs/el-*``).

Churn (one sweep per method, ``experiments/dynamics-METHOD.yaml``): per method and offline
share, over the seeds, the final accuracy of the run's output model (mean ± sample std), its
change against no churn, the accuracy at the common budget T (the last evaluation at or
before T seconds of simulated time; the mean over peers for decentralized methods, as in the
figures), when the last round ended, and the share of model messages delivered.

Epidemic Learning (``experiments/el-static.yaml`` and ``el-epidemic.yaml``): per s, for the
static s-regular graph and the graph redrawn every round, the first round at which the mean
accuracy of the peers' models reaches each target (per seed; "-" if never), and the mean over
peers of the final accuracy.

    python benchmarks/dynamics_tables.py [--runs runs] [--budget 20] [--targets 0.55 0.6 0.65]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pfl.reporting.plots import Run, curve, read_run  # noqa: E402

METHODS = {
    "fedavg": "FedAvg, deadline 0.7 s (star)",
    "dfedavgm": "DFedAvgM, wait 0.5 s",
    "gossip": "gossip, period 0.5 s",
    "adpsgd": "AD-PSGD, reply timeout 0.5 s",
}


def cells(sweep: Path) -> list[dict[str, str]]:
    with open(sweep / "cells.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["status"] in ("ok", "done")]


def groups(sweep: Path, key: str) -> dict[str, list[tuple[Run, dict]]]:
    """The finished cells of ``sweep`` by the value of ``key``: (run, summary) per seed."""
    out: dict[str, list[tuple[Run, dict]]] = {}
    for row in cells(sweep):
        path = sweep / row["cell"]
        summary = json.loads((path / "summary.json").read_text())
        out.setdefault(row[key], []).append((read_run(path), summary))
    return out


def pm(xs: list[float], digits: int = 3) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.{digits}f} ± {sd:.{digits}f}"


def delivered_share(run: Run) -> float:
    models = [r for r in run.comm if r["kind"] == "model"]
    return sum(r.get("fate", "delivered") == "delivered" for r in models) / len(models)


def churn_table(root: Path, budget: float) -> None:
    print(f"| method | offline | final accuracy | change | peers' accuracy at {budget:g} s "
          "| last round ends (s) | models delivered |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for method, title in METHODS.items():
        sweep = root / f"dynamics-{method}"
        if not (sweep / "cells.csv").is_file():
            continue
        base = None
        for level, members in groups(sweep, "network.churn.offline_fraction").items():
            final = [s["final"]["accuracy"] for _, s in members]
            base = statistics.fmean(final) if base is None else base
            curves = [curve(r)[0] for r, _ in members]
            at_t = [c[c[:, 2] <= budget + 1e-9][-1, 1] for c in curves]
            ends = [float(c[-1, 2]) for c in curves]
            share = [delivered_share(r) for r, _ in members]
            change = statistics.fmean(final) - base
            print(f"| {title} | {float(level):.0%} | {pm(final)} | {change:+.3f} | {pm(at_t)} "
                  f"| {pm(ends, 1)} | {statistics.fmean(share):.1%} |")  # fmt: skip


def first_round(points, target: float) -> int | None:
    reached = [int(rnd) for rnd, acc, *_ in points if acc >= target]
    return reached[0] if reached else None


def el_table(root: Path, targets: list[float]) -> None:
    variants = {"static s-regular": ("el-static", "topology.d"),
                "redrawn every round (s_out)": ("el-epidemic", "network.graph.s")}  # fmt: skip
    heads = " | ".join(f"rounds to {t:.0%}" for t in targets)
    print(f"| s | graph | {heads} | final mean peer accuracy |")
    print("|---|---|" + "---|" * len(targets) + "---|")
    by_s: dict[str, dict[str, list[tuple[Run, dict]]]] = {}
    for name, (sweep, key) in variants.items():
        if (root / sweep / "cells.csv").is_file():
            for s, members in groups(root / sweep, key).items():
                by_s.setdefault(s, {})[name] = members
    for s in sorted(by_s, key=int):
        for name, members in by_s[s].items():
            curves = [curve(r)[0] for r, _ in members]
            cols = []
            for t in targets:
                rounds = [first_round(c, t) for c in curves]
                text = ", ".join("-" if r is None else str(r) for r in rounds)
                done = [r for r in rounds if r is not None]
                mean = f"mean {statistics.fmean(done):.1f}" if len(done) == len(rounds) else ""
                cols.append(f"{text} ({mean})" if mean else text)
            final = [float(c[-1, 1]) for c in curves]
            print(f"| {s} | {name} | {' | '.join(cols)} | {pm(final)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs", help="where the sweeps are")
    parser.add_argument("--budget", type=float, default=20.0)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.55, 0.6, 0.65])
    args = parser.parse_args()
    root = Path(args.runs)
    churn_table(root, args.budget)
    print()
    el_table(root, args.targets)


if __name__ == "__main__":
    main()
