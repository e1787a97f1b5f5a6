"""The claims tier for the seed papers (``pytest -m claims``): each result table of
docs/fedelmy.md, docs/fedfisher.md, docs/maecho.md and docs/pans-fedinit.md is guarded here by
a test that runs its documented command through the command line (``p2pfl.app.cli.main``, in
this process) and asserts the documented ordering with the documented margin, on two seeds.

Where the full command takes minutes, the test runs the reduced form that the page documents
next to its table ("Reduced form (claims test)": the same command with a few ``--set``, the
page's measured numbers for it, and the seeds it was measured on). The margins are the ones
the page states for the reduced form, chosen below every gap measured there (over more seeds
than the test runs, and with both the AVX-512 and the AVX2 CPU kernels, which give different
numbers for the same seed: docs/fedelmy.md "Results at CPU scale"), and above what a broken
method gives (breaking each method on purpose makes its test fail; see the pages).
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, needs_fmnist
from p2pfl.app.cli import main

pytestmark = [pytest.mark.claims, needs_fmnist]

SEEDS = (0, 1)


def run(out: Path, experiment: str, seed: int, *sets: str) -> dict[str, Any]:
    """``p2pfl run experiments/EXPERIMENT.yaml --seed SEED --set ...`` into ``out``; returns
    summary.json with the accuracies in points (``final`` and every baseline)."""
    args = ["run", str(ROOT / "experiments" / f"{experiment}.yaml"), "--seed", str(seed)]
    args += [item for s in sets for item in ("--set", s)]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok"
    return summary


def points(summary: dict[str, Any]) -> dict[str, float]:
    """The run's final accuracy (``final``) and its baselines', in points."""
    return {"final": 100 * summary["final"]["accuracy"]} | {
        name: 100 * value for name, value in summary.get("baselines", {}).items()
    }


def server_accuracy(cell: Path) -> list[tuple[int, float]]:
    """(round, accuracy in points) of the global model's evaluations in ``cell``."""
    with (cell / "metrics.csv").open() as f:
        rows = csv.DictReader(f)
        return [
            (int(r["round"]), 100 * float(r["value"]))
            for r in rows
            if r["peer"] == "server" and r["metric"] == "accuracy"
        ]


def last_20(acc: list[tuple[int, float]]) -> float:
    """The mean of the evaluations over the last 20 rounds (the pages' "last 20")."""
    last = max(r for r, _ in acc)
    return statistics.mean(v for r, v in acc if r > last - 20)


def mean_pool_distance(run_dir: Path) -> float:
    """The off-diagonal mean of pool_distances.csv (the last pool's pairwise L2 distances)."""
    with (run_dir / "pool_distances.csv").open() as f:
        rows = [list(map(float, row[1:])) for row in list(csv.reader(f))[1:]]
    off = [v for i, row in enumerate(rows) for j, v in enumerate(row) if i != j]
    return statistics.mean(off)


# --- FedELMY (docs/fedelmy.md) -------------------------------------------------------------

LS_REDUCED = ("dataset.subset=10000",)


def test_fedelmy_beats_fedseq_beats_dfedavgm(tmp_path):
    """Table 1's ordering on the LS-main configs, reduced to a 10k-image subsample: FedELMY
    above FedSeq in every seed and by ≥ 1 point on the mean, above DFedAvgM by ≥ 3 in every
    seed, and FedSeq above DFedAvgM by ≥ 2 on the mean (docs/fedelmy.md, "Label skew, MLP",
    reduced form)."""
    acc = {
        (method, seed): points(run(tmp_path / f"{method}-{seed}", f"fedelmy-ls{method}", seed,
                                   *LS_REDUCED))["final"]
        for seed in SEEDS
        for method in ("", "-fedseq", "-dfedavgm")
    }  # fmt: skip
    print({f"fedelmy-ls{m} s{s}": round(v, 2) for (m, s), v in acc.items()})
    for seed in SEEDS:
        elmy, seq, dfa = (acc[m, seed] for m in ("", "-fedseq", "-dfedavgm"))
        assert elmy > seq, (seed, elmy, seq)
        assert elmy - dfa >= 3.0, (seed, elmy, dfa)
    elmy = statistics.mean(acc["", s] for s in SEEDS)
    seq = statistics.mean(acc["-fedseq", s] for s in SEEDS)
    dfa = statistics.mean(acc["-dfedavgm", s] for s in SEEDS)
    assert elmy - seq >= 1.0, (elmy, seq, acc)
    assert seq - dfa >= 2.0, (seq, dfa, acc)


def test_fedelmy_pool_diversity_grows_with_alpha(tmp_path):
    """The DIV table (the paper's Fig. 10): the last pool's mean pairwise distance, averaged
    over the seeds as the table is, is strictly increasing in α ∈ {0, 0.5, 1}, and α = 1
    spreads it ≥ 1.3× as far as α = 0 (and further in every seed); reduced to a 5k-image
    subsample (docs/fedelmy.md, "Pool diversity vs α", reduced form). Per seed the middle
    value may fall out of order: on a lent H100 (CUDA), seed 1 gave 1.97, 1.74, 3.01."""
    spreads = []
    for seed in SEEDS:
        spread = []
        for alpha in (0, 0.5, 1):
            out = tmp_path / f"div-{seed}-{alpha}"
            run(out, "fedelmy-div", seed, "dataset.subset=5000", f"algorithm.alpha={alpha}")
            spread.append(mean_pool_distance(out))
        print(f"seed {seed}: pool distance at alpha 0, 0.5, 1: {spread}")
        assert spread[2] > spread[0], (seed, spread)
        spreads.append(spread)
    mean = [statistics.mean(s[i] for s in spreads) for i in range(3)]
    assert mean[0] < mean[1] < mean[2], (mean, spreads)
    assert mean[2] >= 1.3 * mean[0], (mean, spreads)


def test_fedelmy_one_shot_beats_fedseq_on_rotated_domains(tmp_path):
    """The DS-few table's T = 1 column, at full scale (``cycles: 1`` is the 7-cycle run's first
    cycle, bit for bit: the prefix property): FedELMY above FedSeq by ≥ 3 points in every seed
    (docs/fedelmy.md, "Domain shift, few-shot")."""
    for seed in SEEDS:
        elmy = points(run(tmp_path / f"ds-{seed}", "fedelmy-ds", seed, "algorithm.cycles=1"))
        seq = points(
            run(tmp_path / f"ds-seq-{seed}", "fedelmy-ds-fedseq", seed, "algorithm.cycles=1")
        )
        print(f"seed {seed}: fedelmy {elmy}, fedseq {seq}")
        assert elmy["final"] - seq["final"] >= 3.0, (seed, elmy, seq)


# --- FedFisher (docs/fedfisher.md) ---------------------------------------------------------


def test_fedfisher_kfac_beats_diag_beats_fedavg(tmp_path):
    """K-FAC > Diag > FedAvg at α = 0.1 (fedfisher-fmnist-a01.yaml), reduced to a 10k-image
    subsample, 10 local epochs and 300 server steps (every checkpoint up to step 200 is the
    full run's): K-FAC − Diag ≥ 1.5 points on the mean over the seeds (as the table reports
    it; on a lent H100, CUDA, seed 0 gave K-FAC 45.92 against Diag 48.99), Diag − FedAvg ≥ 5
    and K-FAC − FedAvg ≥ 10 in every seed (docs/fedfisher.md, reduced form)."""
    gaps = []
    for seed in SEEDS:
        acc = points(
            run(tmp_path / f"ff-{seed}", "fedfisher-fmnist-a01", seed,
                "dataset.subset=10000", "train.epochs=10", "algorithm.steps=300",
                "algorithm.baselines=[fedavg, fedfisher_diag]")
        )  # fmt: skip
        kfac, diag, fedavg = acc["final"], acc["fedfisher_diag"], acc["fedavg"]
        print(f"seed {seed}: {acc}")
        gaps.append(kfac - diag)
        assert diag - fedavg >= 5.0, (seed, acc)
        assert kfac - fedavg >= 10.0, (seed, acc)
    assert statistics.mean(gaps) >= 1.5, gaps


@pytest.mark.parametrize("alpha", ["005", "02"])
def test_fedfisher_at_alpha_005_and_02_in_the_reduced_form(tmp_path, alpha):
    """The α = 0.05 and 0.2 rows of the reference-split table, in the α = 0.1 test's reduced
    form (docs/fedfisher.md): at 0.05 K-FAC above both Diag and FedAvg by ≥ 8 points in every
    seed (measured ≥ 13.2 under three kernel sets); at 0.2 Diag and K-FAC above FedAvg by
    ≥ 8 and ≥ 5 (measured ≥ 13.5 and ≥ 9.7). The reduced form does not show Diag ≥ FedAvg
    at 0.05 nor K-FAC > Diag at 0.2 (gaps of −1.3 to +0.1 and −3.8 to +3.4), so neither is
    asserted."""
    for seed in SEEDS:
        acc = points(
            run(tmp_path / f"ff{alpha}-{seed}", f"fedfisher-fmnist-a{alpha}", seed,
                "dataset.subset=10000", "train.epochs=10", "algorithm.steps=300",
                "algorithm.baselines=[fedavg, fedfisher_diag]")
        )  # fmt: skip
        kfac, diag, fedavg = acc["final"], acc["fedfisher_diag"], acc["fedavg"]
        print(f"alpha 0.{alpha[1:]}, seed {seed}: {acc}")
        if alpha == "005":
            assert kfac - max(diag, fedavg) >= 8.0, (seed, acc)
        else:
            assert diag - fedavg >= 8.0 and kfac - fedavg >= 5.0, (seed, acc)


# --- MA-Echo (docs/maecho.md) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("peers", "margin", "margin_classaware"), [(2, 15.0, 15.0), (5, 30.0, 25.0)]
)
def test_maecho_beats_one_shot_fedavg(tmp_path, peers, margin, margin_classaware):
    """MA-Echo above one-shot FedAvg by ≥ 15 points with 2 peers and ≥ 30 with 5 (the page's
    targets), and above the class-aware FedAvg (MA-Echo without its projected iterations) by
    ≥ 15 and ≥ 25, reduced to a 10k-image subsample without the ensemble baselines
    (docs/maecho.md, reduced form)."""
    for seed in SEEDS:
        acc = points(
            run(tmp_path / f"ma-{seed}", f"maecho-fmnist-{peers}", seed,
                "dataset.subset=10000", "algorithm.ensemble=false")
        )  # fmt: skip
        print(f"{peers} peers, seed {seed}: {acc}")
        assert acc["final"] - acc["fedavg"] >= margin, (seed, acc)
        assert acc["final"] - acc["fedavg_classaware"] >= margin_classaware, (seed, acc)


# --- FedInit and PANs (docs/pans-fedinit.md) -----------------------------------------------

ROUNDS_REDUCED = ("dataset.subset=20000", "algorithm.rounds=40")


def sweep(out: Path, experiment: str, grid: str) -> dict[str, Path]:
    """Run ``experiment``'s sweep replaced by ``grid`` (reduced by ROUNDS_REDUCED); returns
    each cell's directory by its name."""
    args = ["run", str(ROOT / "experiments" / f"{experiment}.yaml"), "--out", str(out)]
    sets = [*ROUNDS_REDUCED, f"sweep={grid}"]
    assert main([*args, "--quiet", *(item for s in sets for item in ("--set", s))]) == 0
    with (out / "cells.csv").open() as f:
        cells = list(csv.DictReader(f))
    assert all(c["status"] == "ok" for c in cells), cells
    return {c["cell"]: out / c["cell"] for c in cells}


def test_fedinit_beats_fedavg(tmp_path):
    """FedAvg + FedInit (β = 0.1) above FedAvg in every seed: by ≥ 2 points over the last 20
    rounds and > 0 in final accuracy, on fedinit-mlp.yaml reduced to a 20k-image subsample
    and 40 rounds (docs/pans-fedinit.md, reduced form)."""
    grid = f"{{seed: {list(SEEDS)}, algorithm.relaxed_init.beta: [0.0, 0.1]}}"
    cells = sweep(tmp_path / "fedinit", "fedinit-mlp", grid)
    for seed in SEEDS:
        fedavg, fedinit = (
            server_accuracy(cells[f"seed={seed},algorithm.relaxed_init.beta={beta}"])
            for beta in ("0.0", "0.1")
        )
        print(f"seed {seed}: fedavg {fedavg}, fedinit {fedinit}")
        assert last_20(fedinit) - last_20(fedavg) >= 2.0, (seed, fedinit, fedavg)
        assert fedinit[-1][1] > fedavg[-1][1], (seed, fedinit, fedavg)


def test_pans_leave_fedavg_unchanged_as_measured(tmp_path):
    """PANs are stated as *not* reproducing; what was measured is pinned: on pans-mlp.yaml
    reduced to a 20k-image subsample and 40 rounds, FedAvg + PANs differs from FedAvg (the
    encodings act) but by at most 1 point over the last 20 rounds and 2 points in final
    accuracy in every seed, and its neuron matching ("global") is not higher by more than 5
    points on the mean (docs/pans-fedinit.md, reduced form)."""
    cells = sweep(
        tmp_path / "pans", "pans-mlp", f'{{seed: {list(SEEDS)}, model.pans.mode: ["off", mul]}}'
    )
    gain = []
    for seed in SEEDS:
        off, mul = (cells[f"seed={seed},model.pans.mode={mode}"] for mode in ("off", "mul"))
        acc_off, acc_mul = server_accuracy(off), server_accuracy(mul)
        assert acc_off != acc_mul, seed
        assert abs(last_20(acc_mul) - last_20(acc_off)) <= 1.0, (seed, acc_mul, acc_off)
        assert abs(acc_mul[-1][1] - acc_off[-1][1]) <= 2.0, (seed, acc_mul, acc_off)
        match = [json.loads((c / "summary.json").read_text())["matching"] for c in (off, mul)]
        gain.append(100 * (match[1]["global"]["mean"] - match[0]["global"]["mean"]))
        print(f"seed {seed}: off {acc_off} {match[0]}, mul {acc_mul} {match[1]}")
    assert statistics.mean(gain) <= 5.0, gain
