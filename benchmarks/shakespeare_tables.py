"""The tables of docs/workloads.md's Shakespeare section, from the sweep it runs
(``experiments/shakespeare-sweep.yaml`` into ``runs/shakespeare-sweep``).

Per method, over the seeds (mean ± sample std): the accuracy on the 20 roles' test windows
after rounds 5, 10 and 20 (FedAvg: the server's model; DFedAvgM and gossip: the mean over
the peers' models, as the figures draw it), the final accuracy of the run's output model
(``summary.json``), the bytes sent per round and in all, and the bytes delivered when the
accuracy first reached each target ("-" if some seed never did).

    python benchmarks/shakespeare_tables.py [--sweep runs/shakespeare-sweep] [--targets 0.25 0.3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pfl.reporting.plots import curve, read_run, series  # noqa: E402

ROUNDS = (5, 10, 20)


def spread(values: list[float], digits: int = 3) -> str:
    """``mean ± std`` (sample std; just the mean for one value)."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", type=Path, default=Path("runs/shakespeare-sweep"))
    parser.add_argument("--targets", type=float, nargs="*", default=[0.25, 0.3])
    args = parser.parse_args()
    cells: dict[str, list[tuple[dict, np.ndarray, np.ndarray]]] = defaultdict(list)
    for cell in sorted(p for p in args.sweep.iterdir() if (p / "summary.json").is_file()):
        summary = json.loads((cell / "summary.json").read_text())
        if summary.get("status") == "ok":
            run = read_run(cell)
            cells[summary["algorithm"]].append((summary, curve(run)[0], series(run)[0]))
    head = ["method", "seeds", *(f"acc @ round {r}" for r in ROUNDS), "final (output model)"]
    head += ["MB / round", "MB in all", *(f"MB to {t:g}" for t in args.targets)]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for method in ("fedavg", "dfedavgm", "gossip"):
        runs = cells.get(method, [])
        if not runs:
            continue
        row = [method, str(len(runs))]
        for r in ROUNDS:
            row.append(spread([float(c[c[:, 0] == r][0, 1]) for _, c, _ in runs]))
        row.append(spread([s["final"]["accuracy"] for s, _, _ in runs]))
        total = [s["comm"]["total_bytes"] / 1e6 for s, _, _ in runs]
        rounds = [int(c[-1, 0]) for _, c, _ in runs]
        row.append(spread([t / n for t, n in zip(total, rounds, strict=True)], 2))
        row.append(spread(total, 1))
        for target in args.targets:
            reached = [t[t[:, 1] >= target] for _, _, t in runs]
            if all(len(x) for x in reached):
                row.append(spread([float(x[0, 2]) / 1e6 for x in reached], 1))
            else:
                row.append(f"- ({sum(len(x) > 0 for x in reached)}/{len(runs)} seeds)")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
