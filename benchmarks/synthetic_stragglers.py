"""The Synthetic(1, 1) stragglers table and figure of docs/workloads.md, from the sweep
``experiments/synthetic-stragglers.yaml`` (``runs/synthetic-stragglers``).

Per setting, over the seeds (mean ± sample std): the server's final test accuracy, its mean
over the last 10 rounds, the mean absolute change of accuracy from one round to the next from
round 11 on, the worst drop below the best accuracy so far from round 11 on, and the final
test loss, read from each run's ``metrics.csv`` (also for
``experiments/synthetic-stragglers-long.yaml``, 100 rounds). Writes the figure (accuracy and
loss per round, mean of the seeds).

    python benchmarks/synthetic_stragglers.py [RUNS_DIR] [FIGURE]
"""

from __future__ import annotations

import csv
import statistics as st
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = [
    "FedAvg, no stragglers",
    "FedAvg, 90% stragglers dropped",
    "FedProx mu=0, 90% stragglers (partial work)",
    "FedProx mu=1, 90% stragglers (partial work)",
    "FedProx mu=1, no stragglers",
]


def setting(cell: str) -> str:
    """The setting a sweep cell's directory name stands for (``algorithm=...,seed=N``)."""
    algorithm = cell.split(",")[0]
    stragglers = "stragglers-fraction-0.9" in algorithm
    if algorithm.startswith("algorithm=fedavg"):
        return "FedAvg, 90% stragglers dropped" if stragglers else "FedAvg, no stragglers"
    mu = algorithm.split("_mu-")[1].split("_")[0]
    work = "90% stragglers (partial work)" if stragglers else "no stragglers"
    return f"FedProx mu={mu}, {work}"


def stat(values: list[float]) -> str:
    """Mean ± sample std (the value alone for one run)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{st.mean(values):.3f} ± {st.stdev(values):.3f}"


def series(run: Path) -> tuple[list[float], list[float]]:
    """The server's test accuracy and loss per round."""
    with (run / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["peer"] == "server"]
    acc = [float(r["value"]) for r in rows if r["metric"] == "accuracy"]
    loss = [float(r["value"]) for r in rows if r["metric"] == "loss"]
    return acc, loss


def main(root: Path, figure: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    print(
        "| setting | final accuracy | mean of the last 10 rounds | mean abs. change per round "
        "(rounds 11 on) | worst drop | final test loss |"
    )
    print("|---|---|---|---|---|---|")
    cells = [d for d in root.iterdir() if d.is_dir() and (d / "summary.json").is_file()]
    for label in ORDER:
        runs = sorted(d for d in cells if setting(d.name) == label)
        if not runs:
            continue
        accs, losses = zip(*(series(run) for run in runs), strict=True)
        final = [a[-1] for a in accs]
        last = [st.mean(a[-10:]) for a in accs]
        change = [st.mean(abs(a[i] - a[i - 1]) for i in range(10, len(a))) for a in accs]
        drop = [max(max(a[:i]) - a[i] for i in range(10, len(a))) for a in accs]
        loss = [s[-1] for s in losses]
        row = " | ".join(stat(v) for v in (final, last, change, drop, loss))
        print(f"| {label} ({len(runs)} seeds) | {row} |")
        n = min(len(a) for a in accs)
        rounds = range(1, n + 1)
        axes[0].plot(rounds, [st.mean(a[i] for a in accs) for i in range(n)], label=label)
        axes[1].plot(rounds, [st.mean(s[i] for s in losses) for i in range(n)], label=label)
    axes[0].set(xlabel="round", ylabel="test accuracy (mean of 3 seeds)", title="Synthetic(1, 1)")
    axes[1].set(xlabel="round", ylabel="test loss (mean of 3 seeds)", yscale="log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        Path(args[0] if args else "runs/synthetic-stragglers"),
        Path(args[1] if len(args) > 1 else "docs/figures/synthetic-stragglers.png"),
    )
