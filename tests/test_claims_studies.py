"""The claims tier for the studies (issue 41): every result table of docs/dynamics.md,
docs/adversaries.md and docs/results.md (the core methods), re-run through the real command line
and its documented ordering asserted with a margin, on two seeds (``pytest -m claims``).

Each test runs the documented command itself. A sweep's test keeps only the cells that carry
the claim (``--set 'sweep={...}'``): each cell is the same run as in the full sweep, so its
numbers are the table's own (runs are deterministic). Where a run is shortened, the doc says
so and gives the shortened command's numbers. The margins come from the measured values (in
each test's docstring, per seed): wide enough for another machine's float rounding, narrow
enough that a method that stops working fails. Each doc table names its test.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT, needs_fmnist
from p2pfl.reporting.plots import curve, read_run


def claim(test):
    """A claims-tier test (``pytest -m claims``) on Fashion-MNIST."""
    return pytest.mark.claims(needs_fmnist(test))


SEEDS = [0, 1]


def p2pfl_run(experiment: str, out: Path, *sets: str) -> None:
    """``p2pfl run experiments/EXPERIMENT.yaml --out OUT --quiet --set ...`` on one thread."""
    args = [sys.executable, "-m", "p2pfl", "run", f"experiments/{experiment}.yaml"]
    args += ["--out", str(out), "--quiet"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(
        args, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def sweep(tmp_path: Path, experiment: str, cells: dict[str, list], *sets: str) -> dict:
    """Run ``experiment``'s sweep over ``cells`` only (its other keys as shipped): each
    cell's (summary, run directory) by the tuple of its values, as ``cells.csv`` writes them."""
    out = tmp_path / experiment
    flow = yaml.safe_dump(cells, default_flow_style=True, width=10_000).strip()
    p2pfl_run(experiment, out, f"sweep={flow}", *sets)
    with open(out / "cells.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(list(_product(cells))) and {r["status"] for r in rows} == {"ok"}
    return {
        tuple(r[k] for k in cells): (
            json.loads((out / r["cell"] / "summary.json").read_text()), out / r["cell"]
        )
        for r in rows
    }  # fmt: skip


def _product(cells: dict[str, list]) -> list[tuple]:
    combos: list[tuple] = [()]
    for values in cells.values():
        combos = [c + (v,) for c in combos for v in values]
    return combos


def acc(cell: tuple[dict[str, Any], Path]) -> float:
    return cell[0]["final"]["accuracy"]


# --- docs/adversaries.md -------------------------------------------------------------------


@claim
def test_adversaries_fedavg_star_mean_collapses_robust_rules_hold(tmp_path):
    """docs/adversaries.md, "FedAvg on a star", 20 % sign-flipping attackers (scale 4): the
    mean collapses, the median, Krum and centered clipping hold, and the robust rules send
    no sample counts. Measured (seed 0 / 1): mean 0.198 / 0.112, median 0.786 / 0.777, Krum
    0.769 / 0.765, centered clipping 0.777 / 0.774."""
    rules = ["mean", "median", "krum", "centered_clipping"]
    cells = {"adversary.fraction": [0.2], "algorithm.aggregator": rules, "seed": SEEDS}
    got = sweep(tmp_path, "adversary-fedavg", cells)
    for seed in map(str, SEEDS):
        a = {rule: acc(got["0.2", rule, seed]) for rule in rules}
        assert a["mean"] < 0.3, (seed, a)
        for rule in rules[1:]:
            assert a[rule] >= 0.74 and a[rule] >= a["mean"] + 0.45, (seed, rule, a)
        sent = {rule: got["0.2", rule, seed][0]["comm"]["total_bytes"] for rule in rules}
        assert sent == {"mean": 163_099_260} | dict.fromkeys(rules[1:], 163_071_660)


@claim
def test_adversaries_ring_gossip_averaging_collapses_median_and_clipped_gossip_hold(tmp_path):
    """docs/adversaries.md, "DFedAvgM on a ring", 20 % attackers: gossip averaging collapses,
    gossip median and ClippedGossip hold, within 0.02 of each other (the "not reproduced"
    half: ClippedGossip does not beat the median with IID data). Measured (seed 0 / 1): mean
    0.550 / 0.122, median 0.802 / 0.794, clipped_gossip 0.802 / 0.805."""
    rules = ["mean", "median", "clipped_gossip"]
    cells = {"adversary.fraction": [0.2], "algorithm.aggregator": rules, "seed": SEEDS}
    got = sweep(tmp_path, "adversary-ring", cells)
    for seed in map(str, SEEDS):
        a = {rule: acc(got["0.2", rule, seed]) for rule in rules}
        for rule in rules[1:]:
            assert a[rule] >= 0.77 and a[rule] >= a["mean"] + 0.2, (seed, rule, a)
        assert abs(a["median"] - a["clipped_gossip"]) <= 0.02, (seed, a)


@claim
def test_adversaries_random_regular_clipped_gossip_breaks_at_30_percent(tmp_path):
    """docs/adversaries.md, "DFedAvgM on a random 4-regular graph", 30 % attackers: the
    median holds and ClippedGossip with the authors' adaptive radius breaks (the paper's
    ordering not reproduced; pinned as measured). Measured (seed 0 / 1): median 0.792 /
    0.798, clipped_gossip 0.553 / 0.740."""
    rules = ["median", "clipped_gossip"]
    cells = {"adversary.fraction": [0.3], "algorithm.aggregator": rules, "seed": SEEDS}
    got = sweep(tmp_path, "adversary-random_regular", cells)
    for seed in map(str, SEEDS):
        median, clipped = (acc(got["0.3", rule, seed]) for rule in rules)
        assert median >= 0.77 and clipped <= median - 0.04, (seed, median, clipped)


@claim
def test_adversaries_ipm_and_free_riding_break_krum_on_the_star(tmp_path):
    """docs/adversaries.md, "Every attack at 20 %: FedAvg on a star": IPM and free-riding
    break Krum (attackers that send nearly the model they received sit together, and Krum
    keeps one), against Krum under sign flipping. Measured (seed 0 / 1): sign_flip 0.769 /
    0.765, ipm 0.663 / 0.653, free_ride 0.674 / 0.657."""
    attacks = [{"name": "sign_flip", "scale": 4}, "ipm", "free_ride"]
    cells = {"adversary.attack": attacks, "algorithm.aggregator": ["krum"], "seed": SEEDS}
    got = sweep(tmp_path, "adversary-attacks-star", cells)
    for seed in map(str, SEEDS):
        base = acc(got["sign_flip_scale-4", "krum", seed])
        assert base >= 0.74, (seed, base)
        for attack in ("ipm", "free_ride"):
            assert acc(got[attack, "krum", seed]) <= base - 0.06, (seed, attack)


# --- docs/dynamics.md ----------------------------------------------------------------------

BUDGET_S = 20.0  # the common simulated-time budget of docs/dynamics.md section 1


def churn_cells(tmp_path: Path, method: str) -> dict[tuple[str, str], dict[str, float]]:
    """Section 1's numbers for one method at 0 % and 50 % offline time: final accuracy, the
    peers' accuracy at 20 s, and when the last round's evaluation happened."""
    cells = {"network.churn.offline_fraction": [0.0, 0.5], "seed": SEEDS}
    got = sweep(tmp_path, f"dynamics-{method}", cells)
    out = {}
    for key, (summary, path) in got.items():
        points = curve(read_run(path))[0]
        at_budget = points[points[:, 2] <= BUDGET_S + 1e-9][-1, 1]
        out[key] = {
            "final": summary["final"]["accuracy"],
            "at_20s": float(at_budget),
            "ends": float(points[-1, 2]),
        }
    return out


@claim
def test_churn_dfedavgm_keeps_its_accuracy_but_pays_in_time(tmp_path):
    """docs/dynamics.md section 1: DFedAvgM with `wait_s` at 50 % offline time keeps its
    final accuracy, but its 44 rounds take over 2.5 times as long, so at the common 20 s
    budget its peers' models fall far behind. Measured (seed 0 / 1), 0 % -> 50 %: final
    0.822 / 0.810 -> 0.764 / 0.799; ends 20.04 / 18.54 -> 66.92 / 63.92 s; peers at 20 s
    0.783 / 0.783 -> 0.541 / 0.532."""
    got = churn_cells(tmp_path, "dfedavgm")
    for seed in map(str, SEEDS):
        calm, churn = got["0.0", seed], got["0.5", seed]
        assert churn["final"] >= calm["final"] - 0.09, (seed, calm, churn)
        assert churn["ends"] >= 2.5 * calm["ends"], (seed, calm, churn)
        assert churn["at_20s"] <= calm["at_20s"] - 0.15, (seed, calm, churn)


@claim
def test_churn_gossip_runs_on_the_clock(tmp_path):
    """docs/dynamics.md section 1: gossip learning's time is the same at every churn level
    (a period is 0.5 s whatever happens), while with fewer peers online its peers' own models
    at 20 s fall. Measured (seed 0 / 1), 0 % -> 50 %: ends 20.41 / 20.40 -> 21.51 / 22.35 s;
    peers at 20 s 0.644 / 0.629 -> 0.559 / 0.552; final 0.798 / 0.804 -> 0.787 / 0.736."""
    got = churn_cells(tmp_path, "gossip")
    for seed in map(str, SEEDS):
        calm, churn = got["0.0", seed], got["0.5", seed]
        assert calm["ends"] <= churn["ends"] <= 1.15 * calm["ends"], (seed, calm, churn)
        assert churn["at_20s"] <= calm["at_20s"] - 0.04, (seed, calm, churn)
        assert churn["final"] >= 0.72, (seed, calm, churn)


@claim
def test_churn_fedavg_with_a_deadline_loses_no_final_accuracy(tmp_path):
    """docs/dynamics.md section 1: FedAvg with `deadline_s` samples among the online peers,
    so 50 % churn costs it no final accuracy, and its rounds run later (a round with a peer
    gone runs to its deadline). Measured (seed 0 / 1), 0 % -> 50 %: final 0.749 / 0.779 ->
    0.803 / 0.801; ends 20.07 / 19.09 -> 24.70 / 24.16 s."""
    got = churn_cells(tmp_path, "fedavg")
    for seed in map(str, SEEDS):
        calm, churn = got["0.0", seed], got["0.5", seed]
        assert churn["final"] >= calm["final"] - 0.03 and churn["final"] >= 0.74, (seed, churn)
        assert churn["ends"] >= calm["ends"] + 3.0, (seed, calm, churn)


@claim
def test_churn_adpsgd_keeps_its_accuracy_and_takes_longer(tmp_path):
    """docs/dynamics.md section 1: AD-PSGD keeps its final accuracy at 50 % churn, and its
    time grows (a partner offline costs up to `reply_timeout_s`). Measured (seed 0 / 1),
    0 % -> 50 %: final 0.787 / 0.789 -> 0.790 / 0.795; ends 14.89 / 14.38 -> 33.30 / 36.58 s."""
    got = churn_cells(tmp_path, "adpsgd")
    for seed in map(str, SEEDS):
        calm, churn = got["0.0", seed], got["0.5", seed]
        assert churn["final"] >= calm["final"] - 0.03 and churn["final"] >= 0.74, (seed, churn)
        assert churn["ends"] >= 1.6 * calm["ends"], (seed, calm, churn)


def first_round(points, target: float) -> int | None:
    reached = [int(p[0]) for p in points if p[1] >= target]
    return reached[0] if reached else None


@claim
def test_epidemic_learning_a_redrawn_graph_reaches_targets_in_fewer_rounds(tmp_path):
    """docs/dynamics.md section 2 (de Vos et al. 2023): at the same messages per round, the
    graph redrawn every round (s_out) reaches 55 % and 60 % mean peer accuracy in fewer rounds
    than the static s-regular graph; with s = 2 (a ring) the static graph never reaches 60 %
    and ends well below. Measured (seed 0 / 1), rounds to 55 % / 60 %: s = 2 static - / 40
    and - / -, redrawn 17 / 20 and 25 / 24; s = 3 static 18 / 16 and 24 / 24, redrawn 12 / 12
    and 18 / 18; final mean peer accuracy s = 2: static 0.541 / 0.550, redrawn 0.614 / 0.642."""
    static = sweep(tmp_path, "el-static", {"topology.d": [2, 3], "seed": SEEDS})
    redrawn = sweep(tmp_path, "el-epidemic", {"network.graph.s": [2, 3], "seed": SEEDS})
    for seed in map(str, SEEDS):
        for s in ("2", "3"):
            a, b = (curve(read_run(got[s, seed][1]))[0] for got in (static, redrawn))
            for target in (0.55, 0.6):
                fast = first_round(b, target)
                slow = first_round(a, target) or 41  # never in 40 rounds
                assert fast is not None and fast <= slow - 4, (seed, s, target, fast, slow)
        a, b = (curve(read_run(got["2", seed][1]))[0] for got in (static, redrawn))
        assert first_round(a, 0.6) is None, seed
        assert b[-1, 1] >= a[-1, 1] + 0.05, (seed, a[-1, 1], b[-1, 1])


@claim
def test_push_sum_running_sums_survive_loss_on_a_fixed_graph(tmp_path):
    """docs/dynamics.md section 4, the fixed-graph table: at 20 % loss plain push-sum
    collapses to chance, running sums (`robust: true`) hold as DFedAvgM does. Measured (seed
    0 / 1): plain 0.122 / 0.122, running sums 0.799 / 0.801, DFedAvgM 0.800 / 0.812."""
    algorithms = yaml.safe_load((ROOT / "experiments/dynamics-pushsum-static.yaml").read_text())
    algorithms = algorithms["sweep"]["algorithm"]  # plain, running sums, DFedAvgM
    cells = {"algorithm": algorithms, "network.links.loss": [0.2], "seed": SEEDS}
    got = sweep(tmp_path, "dynamics-pushsum-static", cells)
    names = {k[0] for k in got}  # as cells.csv names them, e.g. pushsum_robust-True_rounds-30...
    (dfedavgm,) = [n for n in names if n.startswith("dfedavgm")]
    (robust,) = [n for n in names if n.startswith("pushsum") and "robust-True" in n]
    (plain,) = names - {dfedavgm, robust}
    for seed in map(str, SEEDS):
        a = {n: acc(got[n, "0.2", seed]) for n in (plain, robust, dfedavgm)}
        assert a[plain] <= 0.2, (seed, a)
        assert a[robust] >= 0.77 and a[dfedavgm] >= 0.77, (seed, a)
        assert a[robust] >= a[plain] + 0.5, (seed, a)


@claim
def test_push_sum_running_sums_recover_loss_on_a_redrawn_graph(tmp_path):
    """docs/dynamics.md section 4, the redrawn-graph table: at 5 % loss running sums keep
    push-sum near its lossless accuracy while plain push-sum loses mass. Measured (seed
    0 / 1): plain 0.563 / 0.624, running sums 0.773 / 0.781 (AVX-512 kernels); with AVX2
    kernels plain push-sum gives 0.593 / 0.706 (its decaying weights magnify rounding) and
    the running sums the same, so the margin is 0.03 per seed and 0.06 on the mean."""
    algorithms = yaml.safe_load((ROOT / "experiments/dynamics-pushsum.yaml").read_text())
    algorithms = algorithms["sweep"]["algorithm"][:2]  # plain, running sums
    cells = {"algorithm": algorithms, "network.links.loss": [0.05], "seed": SEEDS}
    got = sweep(tmp_path, "dynamics-pushsum", cells)
    names = {k[0] for k in got}
    (robust,) = [n for n in names if "robust-True" in n]
    (plain,) = names - {robust}
    gaps = []
    for seed in map(str, SEEDS):
        a, b = acc(got[plain, "0.05", seed]), acc(got[robust, "0.05", seed])
        assert b >= 0.75 and b >= a + 0.03, (seed, a, b)
        gaps.append(b - a)
    assert sum(gaps) / len(gaps) >= 0.06, gaps


# --- docs/results.md, the core methods ------------------------------------------------------------


@claim
def test_readme_core_methods_label_skew_costs_fedavg_accuracy(tmp_path):
    """docs/results.md, the core-method table, shortened to 5 rounds (the page gives this
    command and its numbers): FedAvg on Fashion-MNIST loses accuracy as the
    label skew grows, IID > Dirichlet 0.5 > Dirichlet 0.1. Measured (seed 0 / 1): IID 0.8480 /
    0.8464, Dirichlet 0.5 0.8248 / 0.8172, Dirichlet 0.1 0.6505 / 0.5604."""
    partitions = [
        {"name": "iid"},
        {"name": "dirichlet", "alpha": 0.5},
        {"name": "dirichlet", "alpha": 0.1},
    ]
    cells = {"partition": partitions, "seed": SEEDS}
    got = sweep(tmp_path, "fedavg-fmnist", cells, "algorithm.rounds=5")
    names = sorted({k[0] for k in got})
    iid = next(n for n in names if "iid" in n)
    half = next(n for n in names if "0.5" in n)
    tenth = next(n for n in names if "0.1" in n)
    for seed in map(str, SEEDS):
        a = {n: acc(got[n, seed]) for n in (iid, half, tenth)}
        assert a[iid] >= a[half] + 0.01 and a[half] >= a[tenth] + 0.1, (seed, a)
        assert a[iid] >= 0.82, (seed, a)


GUARD = re.compile(r"`(tests/test_claims_\w+\.py)::(test_\w+)`")


def test_every_table_names_a_claims_test_that_exists():
    """Not a claim (it runs in the default suite): every `tests/test_claims_*.py::test_...`
    that the README and docs/*.md name under a table is a test of that file, so a renamed test
    cannot leave a table pointing at nothing."""
    named = [
        (doc.name, *m.groups())
        for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for m in GUARD.finditer(doc.read_text())
    ]
    assert any(path == "tests/test_claims_studies.py" for _, path, _ in named)
    for doc, path, name in named:
        assert (ROOT / path).is_file(), (doc, path)
        assert f"def {name}(" in (ROOT / path).read_text(), (doc, path, name)
