"""The tables and figure of docs/adversaries.md, from the sweeps it runs (``runs/adversary-*``).

Per sweep (``experiments/adversary-fedavg.yaml``, ``adversary-ring.yaml``,
``adversary-random_regular.yaml``, ``adversary-ring-noniid.yaml``) and aggregator, over the
seeds: the final accuracy of the run's output model (the server's model on the star; the mean
of the honest peers' final models on a graph) against the share of attackers (mean ± sample
std), the mean of the honest peers' own accuracies on graphs, and the bytes each defence sent.
Per attack sweep (``adversary-attacks.yaml``, ``adversary-attacks-star.yaml``): the final
accuracy per attack and aggregator. Writes ``docs/figures/adversaries.png`` (accuracy against
the share of attackers, one panel per share sweep).

    python benchmarks/adversary_tables.py [--runs runs] [--figure docs/figures/adversaries.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dynamics_tables import cells, pm  # noqa: E402

SWEEPS = {
    "adversary-fedavg": "FedAvg on a star (20 peers)",
    "adversary-ring": "DFedAvgM on a ring (20 peers)",
    "adversary-random_regular": "DFedAvgM on a random 4-regular graph (20 peers)",
    "adversary-ring-noniid": "DFedAvgM on a ring, Dirichlet α = 0.1 (20 peers)",
}
ATTACK_SWEEPS = {
    "adversary-attacks-star": "Every attack at 20 %: FedAvg on a star",
    "adversary-attacks": "Every attack at 20 %: DFedAvgM on a random 4-regular graph",
}


def collect(sweep: Path, key: str = "adversary.fraction") -> dict[str, dict[str, list[dict]]]:
    """summary.json of every finished cell, by aggregator and the value of ``key``."""
    out: dict[str, dict[str, list[dict]]] = {}
    for row in cells(sweep):
        summary = json.loads((sweep / row["cell"] / "summary.json").read_text())
        by_value = out.setdefault(row["algorithm.aggregator"], {})
        by_value.setdefault(row[key], []).append(summary)
    return out


def attack_table(title: str, data: dict[str, dict[str, list[dict]]]) -> str:
    rules = list(data)
    attacks = list(next(iter(data.values())))
    lines = [f"**{title}**", "", "| attack | " + " | ".join(rules) + " |"]
    lines.append("|" + "---|" * (len(rules) + 1))
    for attack in attacks:
        accs = [pm([r["final"]["accuracy"] for r in data[rule][attack]]) for rule in rules]
        lines.append(f"| {attack} | " + " | ".join(accs) + " |")
    return "\n".join(lines)


def honest(summary: dict) -> float:
    """The mean accuracy of the honest peers' own final models."""
    if "adversary" in summary:
        return summary["adversary"]["honest_accuracy"]
    return statistics.fmean(p["accuracy"] for p in summary["per_peer"])


def table(title: str, data: dict[str, dict[str, list[dict]]]) -> str:
    shares = sorted({s for by_share in data.values() for s in by_share}, key=float)
    graph = any(r["per_peer"] for by_share in data.values() for rs in by_share.values() for r in rs)
    head = ["aggregator", *(f"{float(s):.0%} attackers" for s in shares), "bytes sent"]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rule, by_share in data.items():
        accs = [pm([r["final"]["accuracy"] for r in by_share[s]]) for s in shares]
        sent = statistics.fmean(r["comm"]["total_bytes"] for r in by_share[shares[-1]])
        lines.append(f"| {rule} | " + " | ".join(accs) + f" | {sent:,.0f} |")
        if graph:
            own = [pm([honest(r) for r in by_share[s]]) for s in shares]
            lines.append("| (honest peers' own) | " + " | ".join(own) + " | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--figure", type=Path, default=Path("docs/figures/adversaries.png"))
    args = parser.parse_args()
    found = {n: t for n, t in SWEEPS.items() if (args.runs / n / "cells.csv").is_file()}
    cols = min(2, max(1, len(found)))
    rows = max(1, -(-len(found) // cols))
    fig, _ = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    for ax, (name, title) in zip(fig.axes, found.items(), strict=False):
        data = collect(args.runs / name)
        print(table(title, data) + "\n")
        for rule, by_share in data.items():
            shares = sorted(by_share, key=float)
            means = [statistics.fmean(r["final"]["accuracy"] for r in by_share[s]) for s in shares]
            ax.plot([100 * float(s) for s in shares], means, marker="o", label=rule)
        ax.set(title=title, xlabel="attackers (%)", ylabel="final accuracy", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for name, title in ATTACK_SWEEPS.items():
        if (args.runs / name / "cells.csv").is_file():
            print(attack_table(title, collect(args.runs / name, "adversary.attack")) + "\n")
    fig.tight_layout()
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.figure, dpi=120)
    print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
