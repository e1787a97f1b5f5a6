"""The tables and the figure of docs/asynchrony.md, from the sweeps it runs (``runs/async-*``).

Every cell's numbers come from its ``summary.json``: ``time_to_accuracy`` (the first time the
run's model, scored every ``eval.every_s`` seconds, reached each target, and the bytes sent by
then) and ``final.accuracy`` (the run's model at the stop). Per condition: each seed's value,
then the mean; a target never reached within the budget is "—" (and a ratio to it, "> x").
The figure (``docs/figures/asynchrony-time.png``) draws, per section, each method's accuracy
against simulated time for one seed (the run's model, as ``time_to_accuracy`` reads it).

    python benchmarks/asynchrony_tables.py [--runs runs] [--target 0.8] [--seed 0] [--figure PATH]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pfl.reporting.progress import accuracy_series  # noqa: E402

SWEEPS = {
    "stragglers": "async-adpsgd-stragglers",
    "star": "async-star-heterogeneous",
    "gossip": "async-gossip-fedavg",
}
METHODS = {  # a cell's algorithm (as cells.csv names it) -> how the tables say it
    "adpsgd_reply_timeout_s-1.0": "AD-PSGD",
    "dfedavgm": "DFedAvgM (D-PSGD)",
    "fedavg": "FedAvg",
    "fedasync_staleness-polynomial": "FedAsync (polynomial)",
    "fedbuff_buffer_size-10": "FedBuff (K = 10)",
    "gossip_period_s-0.5": "gossip learning",
    "gossip_period_s-0.5_train_idle-True": "gossip learning, train_idle",
}
DEVICES = {  # a cell's peers (as cells.csv names it) -> how the tables say it
    "count-16_flops_per_s-300000000.0": "all alike",
    "count-16_flops_per_s-300000000.0_slow_fraction-0.0625_slow_factor-0.1": "1 of 16 10x slower",
    "count-16_flops_per_s-300000000.0_speed_dist-lognormal_sigma-1.0": "lognormal, sigma 1",
}


COLORS = {
    "adpsgd_reply_timeout_s-1.0": "tab:blue",
    "dfedavgm": "tab:red",
    "fedavg": "black",
    "fedasync_staleness-polynomial": "tab:orange",
    "fedbuff_buffer_size-10": "tab:green",
    "gossip_period_s-0.5": "tab:purple",
    "gossip_period_s-0.5_train_idle-True": "tab:cyan",
}


def cells(sweep: Path) -> list[dict[str, Any]]:
    """The finished cells of a sweep: its ``cells.csv`` row, summary and path."""
    with open(sweep / "cells.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    for r in rows:
        r["path"] = sweep / r["cell"]
        r["summary"] = json.loads((r["path"] / "summary.json").read_text())
    return rows


def tta(summary: dict[str, Any], target: float, what: str = "time_s") -> float | None:
    hit = summary["time_to_accuracy"][repr(float(target))]
    return None if hit is None else hit[what]


def seeds_text(values: list[float | None], fmt: str) -> str:
    """Each seed's value, then the mean if every seed has one."""
    text = " / ".join("—" if v is None else format(v, fmt) for v in values)
    if all(v is not None for v in values) and len(values) > 1:
        text += f" (mean {format(statistics.fmean(values), fmt)})"  # type: ignore[arg-type]
    return text


def ratio_text(slow: list[float | None], base: list[float | None], budget: float) -> str:
    out = []
    for s, b in zip(slow, base, strict=True):
        if b is None:
            out.append("—")
        elif s is None:
            out.append(f"> {budget / b:.1f}")
        else:
            out.append(f"{s / b:.2f}")
    return " / ".join(out)


def by(rows: list[dict[str, Any]], *keys: str) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Rows grouped by ``keys`` (each group sorted by seed)."""
    out: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: int(r["seed"])):
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def stragglers_table(root: Path, target: float) -> None:
    rows = cells(root / SWEEPS["stragglers"])
    budget = rows[0]["summary"]["sim_time_s"]
    groups = by(rows, "algorithm", "peers")
    print(f"| method | devices | time to 0.75 (s) | time to {target} (s) | vs all alike "
          f"| MB sent by {target} | accuracy at {budget:g} s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for algorithm in dict.fromkeys(k[0] for k in groups):
        base = [tta(r["summary"], target) for r in groups[algorithm, next(iter(DEVICES))]]
        for devices, name in DEVICES.items():
            members = groups.get((algorithm, devices))
            if not members:
                continue
            summaries = [r["summary"] for r in members]
            t = [tta(s, target) for s in summaries]
            mb = [None if (b := tta(s, target, "bytes")) is None else b / 1e6 for s in summaries]
            acc = [s["final"]["accuracy"] for s in summaries]
            early = [tta(s, 0.75) for s in summaries]
            print(f"| {METHODS[algorithm]} | {name} | {seeds_text(early, '.2f')} "
                  f"| {seeds_text(t, '.2f')} | {ratio_text(t, base, budget)} "
                  f"| {seeds_text(mb, '.0f')} | {seeds_text(acc, '.3f')} |")  # fmt: skip


def star_table(root: Path, target: float) -> None:
    rows = cells(root / SWEEPS["star"])
    budget = rows[0]["summary"]["sim_time_s"]
    groups = by(rows, "algorithm")
    base = [tta(r["summary"], target) for r in groups["fedavg",]]
    print(f"| method | time to 0.75 (s) | time to {target} (s) | FedAvg's time / its time "
          f"| MB sent by {target} | accuracy at {budget:g} s "
          f"| server updates by {budget:g} s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for (algorithm,), members in groups.items():
        summaries = [r["summary"] for r in members]
        t = [tta(s, target) for s in summaries]
        speedup = " / ".join(
            "—" if x is None else f"> {budget / x:.1f}" if b is None else f"{b / x:.1f}"
            for b, x in zip(base, t, strict=True)
        )
        mb = [None if (b := tta(s, target, "bytes")) is None else b / 1e6 for s in summaries]
        acc = [s["final"]["accuracy"] for s in summaries]
        updates = [server_updates(r["path"]) for r in members]
        print(f"| {METHODS[algorithm]} | {seeds_text([tta(s, 0.75) for s in summaries], '.2f')} "
              f"| {seeds_text(t, '.2f')} | {speedup} | {seeds_text(mb, '.0f')} "
              f"| {seeds_text(acc, '.3f')} | {' / '.join(map(str, updates))} |")  # fmt: skip


def server_updates(path: Path) -> int:
    """The server's last version (FedAsync: updates; FedBuff: steps; FedAvg: rounds), from
    the server's rows of ``metrics.csv``."""
    with open(path / "metrics.csv", newline="") as f:
        rounds = [int(r["round"]) for r in csv.DictReader(f) if r["peer"] == "server"]
    return max(rounds, default=0)


def gossip_table(root: Path, target: float) -> None:
    rows = cells(root / SWEEPS["gossip"])
    budget = rows[0]["summary"]["sim_time_s"]
    groups = by(rows, "algorithm")
    print(f"| method | graph | accuracy at {budget:g} s | time to 0.75 (s) | time to {target} (s) "
          f"| MB sent by {target} | MB sent in {budget:g} s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for (algorithm,), members in groups.items():
        summaries = [r["summary"] for r in members]
        acc = [s["final"]["accuracy"] for s in summaries]
        mb = [s["comm"]["total_bytes"] / 1e6 for s in summaries]
        by_target = [None if (b := tta(s, target, "bytes")) is None else b / 1e6 for s in summaries]
        print(f"| {METHODS[algorithm]} | {members[0]['topology']} | {seeds_text(acc, '.3f')} "
              f"| {seeds_text([tta(s, 0.75) for s in summaries], '.2f')} "
              f"| {seeds_text([tta(s, target) for s in summaries], '.2f')} "
              f"| {seeds_text(by_target, '.0f')} | {seeds_text(mb, '.0f')} |")  # fmt: skip


def series(path: Path) -> tuple[list[float], list[float]]:
    """The run's accuracy series (without its final row) as (times, accuracies)."""
    with open(path / "metrics.csv", newline="") as f:
        points, _ = accuracy_series(csv.DictReader(f))
    points = [p for p in points if p.round >= 0][:-1]  # the last is the final row
    return [p.time for p in points], [p.accuracy for p in points]


def figure(root: Path, seed: int, target: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    panels = [
        ("stragglers", "1. ring, 16 peers: AD-PSGD vs DFedAvgM",
         lambda r: r["peers"] != list(DEVICES)[2],
         lambda r: f"{METHODS[r['algorithm']]}, {DEVICES[r['peers']]}"),
        ("star", "2. star, 16 lognormal devices",
         lambda r: True, lambda r: METHODS[r["algorithm"]]),
        ("gossip", "3. IID data, equal devices",
         lambda r: True, lambda r: f"{METHODS[r['algorithm']]} ({r['topology']})"),
    ]  # fmt: skip
    for ax, (key, title, keep, label) in zip(axes, panels, strict=True):
        sweep = root / SWEEPS[key]
        if not (sweep / "cells.csv").is_file():
            continue
        for r in cells(sweep):
            if int(r["seed"]) != seed or not keep(r):
                continue
            t, a = series(r["path"])
            dashed = "slower" in label(r)
            color = COLORS[r["algorithm"]]
            ax.step(t, a, where="post", label=label(r), color=color,
                    linestyle="--" if dashed else "-", linewidth=1.2)  # fmt: skip
        ax.axhline(target, color="grey", linewidth=0.7, linestyle=":")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("simulated time (s)")
        ax.set_ylim(0.6, 0.87)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("test accuracy of the run's model")
    fig.suptitle(f"Fashion-MNIST, MLP 784-64-10, 3e8 FLOP/s devices, seed {seed} "
                 f"(dotted line: the target {target})", fontsize=10)  # fmt: skip
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs", help="where the sweeps are")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0, help="the seed the figure draws")
    parser.add_argument("--figure", default="docs/figures/asynchrony-time.png")
    args = parser.parse_args()
    root = Path(args.runs)
    for name, table in (("stragglers", stragglers_table), ("star", star_table),
                        ("gossip", gossip_table)):  # fmt: skip
        if (root / SWEEPS[name] / "cells.csv").is_file():
            print(f"\n{SWEEPS[name]}:\n")
            table(root, args.target)
    figure(root, args.seed, args.target, Path(args.figure))


if __name__ == "__main__":
    main()
