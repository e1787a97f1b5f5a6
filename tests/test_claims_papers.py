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

A run that several tests read (FedELMY's full method and FedSeq on the 5k subsample) is made
once per session (``shared_run``): runs are deterministic, so reading another test's run is
reading one's own.
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import json
import os
import shutil
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
    return read_summary(out)


def read_summary(out: Path) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok"
    return summary


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the session's shared runs: under pytest-xdist the workers' common
    temporary folder (this session's, never an earlier one's), so each run is made once."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    root.mkdir(exist_ok=True)
    return root


def shared_run(root: Path, experiment: str, seed: int, *sets: str) -> dict[str, Any]:
    """``run`` into ``root``, made once per command and session: a test that needs a run
    another test has made reads its summary, and one that another worker is making waits
    for it (a lock per command)."""
    key = hashlib.sha256(json.dumps([experiment, seed, *sets]).encode()).hexdigest()[:16]
    out = root / f"{experiment}-s{seed}-{key}"
    with (root / f"{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "summary.json").is_file():
            return read_summary(out)
        shutil.rmtree(out, ignore_errors=True)  # a run that failed half-way
        return run(out, experiment, seed, *sets)


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


ELMY_5K = ("dataset.subset=5000",)


def fedelmy_5k(root: Path, seed: int, *sets: str) -> float:
    """fedelmy-ls.yaml (``*sets`` added) on a 5k-image subsample, final accuracy in points;
    the full method and FedSeq are shared (the ablation's and the measures' tables use them)."""
    return points(shared_run(root, "fedelmy-ls", seed, *ELMY_5K, *sets))["final"]


def fedseq_5k(root: Path, seed: int) -> float:
    return points(shared_run(root, "fedelmy-ls-fedseq", seed, *ELMY_5K))["final"]


@pytest.mark.filterwarnings("ignore:fedelmy. alpha 1.0 > beta 0.0:UserWarning")
def test_fedelmy_ablation_d2_and_both_terms_help(shared_runs):
    """Table 3's ablation on the LS-main config, reduced to a 5k-image subsample, in every
    seed: the full method (α = β = 1) above the pool alone (α = β = 0) by ≥ 1.5 points and
    above pool + d1 by ≥ 2.5, pool + d2 above the pool alone by ≥ 1, and the pool alone above
    FedSeq by ≥ 1. Pinned as measured (docs/fedelmy.md: d1 alone does not help at full scale
    either): pool + d1 at least 0.5 below the pool alone. Neither "full best" nor "every
    variant above FedSeq" holds here (pool + d2 ties the full method, pool + d1 ties FedSeq),
    so neither is asserted (docs/fedelmy.md, "Ablation", reduced form)."""
    for seed in SEEDS:
        acc = {
            name: fedelmy_5k(shared_runs, seed, f"algorithm.alpha={a}", f"algorithm.beta={b}")
            for name, a, b in (("pool", 0, 0), ("+d1", 1, 0), ("+d2", 0, 1))
        }
        acc |= {"full": fedelmy_5k(shared_runs, seed), "fedseq": fedseq_5k(shared_runs, seed)}
        print(f"seed {seed}: {acc}")
        assert acc["full"] - acc["pool"] >= 1.5, (seed, acc)
        assert acc["full"] - acc["+d1"] >= 2.5, (seed, acc)
        assert acc["+d2"] - acc["pool"] >= 1.0, (seed, acc)
        assert acc["pool"] - acc["fedseq"] >= 1.0, (seed, acc)
        assert acc["pool"] - acc["+d1"] >= 0.5, (seed, acc)


CNN_REDUCED = (
    "dataset.subset=5000", "dataset.test_subset=2000", "eval.every=1000", "eval.per_peer=false"
)  # fmt: skip


def test_fedelmy_small_cnn_beats_fedseq_beats_gossip(tmp_path):
    """The small-CNN table (cnn_s with BatchNorm) reduced to a 5k-image subsample, scored on
    a fixed 2,000-image test subset and only after the last round: in every seed FedELMY
    above FedSeq by ≥ 4 points, FedSeq above DFedAvgM by ≥ 3, and DFedAvgM above DFedSAM by
    ≥ 10 (the averaged SAM models leave the basin; docs/fedelmy.md, small CNN, reduced
    form)."""
    methods = ("", "-fedseq", "-dfedavgm", "-dfedsam")
    for seed in SEEDS:
        elmy, seq, dfa, sam = (
            points(run(tmp_path / f"cnn{m}-{seed}", f"fedelmy-ls-cnn{m}", seed, *CNN_REDUCED))[
                "final"
            ]
            for m in methods
        )
        print(f"seed {seed}: fedelmy {elmy}, fedseq {seq}, dfedavgm {dfa}, dfedsam {sam}")
        assert elmy - seq >= 4.0, (seed, elmy, seq)
        assert seq - dfa >= 3.0, (seed, seq, dfa)
        assert dfa - sam >= 10.0, (seed, dfa, sam)


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


def test_fedelmy_every_diversity_measure_beats_fedseq(shared_runs):
    """The diversity-measure table (the paper's Fig. 9) reduced to a 5k-image subsample:
    every measure (``l2sq``, ``l2``, ``l1``, ``cosine``) above FedSeq by ≥ 2 points in every
    seed, and the default ``l2sq`` the best on the mean over the seeds by ≥ 0.3
    (docs/fedelmy.md, "Diversity measure", reduced form)."""
    acc: dict[str, list[float]] = {"l2sq": [], "l2": [], "l1": [], "cosine": []}
    for seed in SEEDS:
        fedseq = fedseq_5k(shared_runs, seed)
        for dist in acc:
            sets = () if dist == "l2sq" else (f"algorithm.dist={dist}",)
            acc[dist].append(fedelmy_5k(shared_runs, seed, *sets))
            assert acc[dist][-1] - fedseq >= 2.0, (seed, dist, acc, fedseq)
        print(f"seed {seed}: fedseq {fedseq}, { ({d: v[-1] for d, v in acc.items()}) }")
    mean = {dist: statistics.mean(values) for dist, values in acc.items()}
    assert mean["l2sq"] - max(v for d, v in mean.items() if d != "l2sq") >= 0.3, mean


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


FF_REDUCED = ("dataset.subset=10000", "train.epochs=10", "algorithm.steps=300")


def test_fedfisher_kfac_beats_diag_beats_fedavg(tmp_path):
    """K-FAC > Diag > FedAvg at α = 0.1 (fedfisher-fmnist-a01.yaml), reduced to a 10k-image
    subsample, 10 local epochs and 300 server steps (every checkpoint up to step 200 is the
    full run's): K-FAC − Diag ≥ 1.5 points on the mean over the seeds (as the table reports
    it; on a lent H100, CUDA, seed 0 gave K-FAC 45.92 against Diag 48.99), Diag − FedAvg ≥ 5
    and K-FAC − FedAvg ≥ 10 in every seed. The Fisher-merging and RegMean columns (the file's
    baselines, computed from the same local models): Fisher merging ≥ 8 and RegMean ≥ 5
    above FedAvg and K-FAC ≥ 2 above RegMean in every seed, K-FAC ≥ 2 above Fisher merging
    on the mean (docs/fedfisher.md, reduced form)."""
    gaps = []
    for seed in SEEDS:
        acc = points(run(tmp_path / f"ff-{seed}", "fedfisher-fmnist-a01", seed, *FF_REDUCED))
        kfac, diag, fedavg = acc["final"], acc["fedfisher_diag"], acc["fedavg"]
        fisher, regmean = acc["fisher_merge"], acc["regmean"]
        print(f"seed {seed}: {acc}")
        gaps.append((kfac - diag, kfac - fisher))
        assert diag - fedavg >= 5.0, (seed, acc)
        assert kfac - fedavg >= 10.0, (seed, acc)
        assert fisher - fedavg >= 8.0 and regmean - fedavg >= 5.0, (seed, acc)
        assert kfac - regmean >= 2.0, (seed, acc)
    assert statistics.mean(g[0] for g in gaps) >= 1.5, gaps
    assert statistics.mean(g[1] for g in gaps) >= 2.0, gaps


@pytest.mark.parametrize("alpha", ["005", "02"])
def test_fedfisher_at_alpha_005_and_02_in_the_reduced_form(tmp_path, alpha):
    """The α = 0.05 and 0.2 rows of the reference-split table, in the α = 0.1 test's reduced
    form (docs/fedfisher.md): at 0.05 K-FAC above Diag, Fisher merging and FedAvg by ≥ 8
    points in every seed (measured ≥ 13.2 under three kernel sets); at 0.2 Diag and K-FAC
    above FedAvg by ≥ 8 and ≥ 5 (measured ≥ 13.5 and ≥ 9.7) and Fisher merging by ≥ 8
    (≥ 15.9); RegMean above FedAvg by ≥ 5 at both (≥ 9.8). The reduced form does not show
    Diag or Fisher merging ≥ FedAvg at 0.05, RegMean > K-FAC at 0.05, nor K-FAC above Diag,
    Fisher merging or RegMean at 0.2, so none of these is asserted."""
    for seed in SEEDS:
        acc = points(
            run(tmp_path / f"ff{alpha}-{seed}", f"fedfisher-fmnist-a{alpha}", seed, *FF_REDUCED)
        )
        kfac, diag, fedavg = acc["final"], acc["fedfisher_diag"], acc["fedavg"]
        fisher, regmean = acc["fisher_merge"], acc["regmean"]
        print(f"alpha 0.{alpha[1:]}, seed {seed}: {acc}")
        assert regmean - fedavg >= 5.0, (seed, acc)
        if alpha == "005":
            assert kfac - max(diag, fisher, fedavg) >= 8.0, (seed, acc)
        else:
            assert diag - fedavg >= 8.0 and kfac - fedavg >= 5.0, (seed, acc)
            assert fisher - fedavg >= 8.0, (seed, acc)


# --- MA-Echo (docs/maecho.md) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("peers", "margin", "margin_classaware"), [(2, 15.0, 15.0), (5, 30.0, 25.0)]
)
def test_maecho_beats_one_shot_fedavg_and_the_ensembles(tmp_path, peers, margin, margin_classaware):
    """MA-Echo above one-shot FedAvg by ≥ 15 points with 2 peers and ≥ 30 with 5 (the page's
    targets), above the class-aware FedAvg (MA-Echo without its projected iterations) by
    ≥ 15 and ≥ 25, above the masked output ensemble (the official code's) by ≥ 3 and above
    the logit-mean ensemble by ≥ 8, in every seed, reduced to a 20k-image subsample
    (docs/maecho.md, reduced form)."""
    for seed in SEEDS:
        acc = points(
            run(tmp_path / f"ma-{seed}", f"maecho-fmnist-{peers}", seed, "dataset.subset=20000")
        )
        print(f"{peers} peers, seed {seed}: {acc}")
        assert acc["final"] - acc["fedavg"] >= margin, (seed, acc)
        assert acc["final"] - acc["fedavg_classaware"] >= margin_classaware, (seed, acc)
        assert acc["final"] - acc["ensemble_masked"] >= 3.0, (seed, acc)
        assert acc["final"] - acc["ensemble"] >= 8.0, (seed, acc)


# --- FedInit and PANs (docs/pans-fedinit.md) -----------------------------------------------

ROUNDS_REDUCED = ("dataset.subset=20000", "algorithm.rounds=40")
LENET_REDUCED = (*ROUNDS_REDUCED, "dataset.test_subset=2000")


def sweep(
    out: Path, experiment: str, grid: str, sets: tuple[str, ...] = ROUNDS_REDUCED
) -> dict[str, Path]:
    """Run ``experiment``'s sweep replaced by ``grid``, with ``--set``s ``sets`` (default
    ROUNDS_REDUCED); returns each cell's directory by its name."""
    args = ["run", str(ROOT / "experiments" / f"{experiment}.yaml"), "--out", str(out)]
    sets = (*sets, f"sweep={grid}")
    assert main([*args, "--quiet", *(item for s in sets for item in ("--set", s))]) == 0
    with (out / "cells.csv").open() as f:
        cells = list(csv.DictReader(f))
    assert all(c["status"] == "ok" for c in cells), cells
    return {c["cell"]: out / c["cell"] for c in cells}


def relaxed_init_gains(cells: dict[str, Path]) -> dict[int, tuple[float, float]]:
    """Per seed, (last-20, final) accuracy of β = 0.1 minus β = 0 among the cells named
    ``seed=S,algorithm.relaxed_init.beta=B``."""
    gains = {}
    for seed in SEEDS:
        host, relaxed = (
            server_accuracy(cells[f"seed={seed},algorithm.relaxed_init.beta={beta}"])
            for beta in ("0.0", "0.1")
        )
        print(f"seed {seed}: beta 0 {host}, beta 0.1 {relaxed}")
        gains[seed] = (last_20(relaxed) - last_20(host), relaxed[-1][1] - host[-1][1])
    return gains


def test_fedinit_beats_fedavg(tmp_path):
    """FedAvg + FedInit (β = 0.1) above FedAvg in every seed: by ≥ 2 points over the last 20
    rounds and > 0 in final accuracy, on fedinit-mlp.yaml reduced to a 20k-image subsample
    and 40 rounds (docs/pans-fedinit.md, reduced form)."""
    grid = f"{{seed: {list(SEEDS)}, algorithm.relaxed_init.beta: [0.0, 0.1]}}"
    gains = relaxed_init_gains(sweep(tmp_path / "fedinit", "fedinit-mlp", grid))
    for seed, (last20, final) in gains.items():
        assert last20 >= 2.0 and final > 0, (seed, gains)


def test_fedinit_lifts_fedsam_on_the_mlp(tmp_path):
    """FedSAM + FedInit above FedSAM (the ``sam`` cells of fedinit-mlp.yaml) in every seed:
    by ≥ 2 points over the last 20 rounds and ≥ 1 in final accuracy, in the FedAvg test's
    reduced form (docs/pans-fedinit.md, reduced form)."""
    grid = f"{{seed: {list(SEEDS)}, algorithm.relaxed_init.beta: [0.0, 0.1]}}"
    cells = sweep(
        tmp_path / "fedsam", "fedinit-mlp", grid, (*ROUNDS_REDUCED, "train.optimizer=sam")
    )
    gains = relaxed_init_gains(cells)
    for seed, (last20, final) in gains.items():
        assert last20 >= 2.0 and final >= 1.0, (seed, gains)


@pytest.mark.parametrize(("optimizer", "last20", "final"), [("sgd", 1.0, 3.0), ("sam", 4.0, 8.0)])
def test_fedinit_beats_fedavg_and_fedsam_on_lenet(tmp_path, optimizer, last20, final):
    """fedinit-cnn.yaml (LeNet-5) reduced to a 20k-image subsample and 40 rounds, scored on a
    fixed 2,000-image test subset, in every seed: FedAvg + FedInit above FedAvg (``sgd``) by
    ≥ 1 point over the last 20 rounds and ≥ 3 in final accuracy, FedSAM + FedInit above
    FedSAM (``sam``) by ≥ 4 and ≥ 8 (docs/pans-fedinit.md, reduced form). One case per host
    method, so that each fits the tier's time per test."""
    grid = f"{{seed: {list(SEEDS)}, algorithm.relaxed_init.beta: [0.0, 0.1]}}"
    sets = (*LENET_REDUCED, f"train.optimizer={optimizer}")
    gains = relaxed_init_gains(sweep(tmp_path / "fedinit-cnn", "fedinit-cnn", grid, sets))
    for seed, gain in gains.items():
        assert gain[0] >= last20 and gain[1] >= final, (seed, optimizer, gains)


def pans_as_measured(
    out: Path, experiment: str, sets: tuple[str, ...], last20: float, final: float, gain: float
) -> list[dict[str, Any]]:
    """Run ``experiment``'s PANs ``off`` and ``mul`` cells on SEEDS (with ``sets``) and pin
    what was measured: in every seed the two differ (the encodings act) by at most
    ``last20`` points over the last 20 rounds and ``final`` points in final accuracy, and
    PANs raise the "global" neuron matching by at most ``gain`` points on the mean. Returns
    each seed's matching (``off``, ``mul``) from summary.json."""
    grid = f'{{seed: {list(SEEDS)}, model.pans.mode: ["off", mul]}}'
    cells = sweep(out, experiment, grid, sets)
    gains, matching = [], []
    for seed in SEEDS:
        off, mul = (cells[f"seed={seed},model.pans.mode={mode}"] for mode in ("off", "mul"))
        acc_off, acc_mul = server_accuracy(off), server_accuracy(mul)
        match = {m: read_summary(c)["matching"] for m, c in (("off", off), ("mul", mul))}
        print(f"seed {seed}: off {acc_off} {match['off']}, mul {acc_mul} {match['mul']}")
        assert acc_off != acc_mul, seed
        assert abs(last_20(acc_mul) - last_20(acc_off)) <= last20, (seed, acc_mul, acc_off)
        assert abs(acc_mul[-1][1] - acc_off[-1][1]) <= final, (seed, acc_mul, acc_off)
        gains.append(100 * (match["mul"]["global"]["mean"] - match["off"]["global"]["mean"]))
        matching.append(match)
    assert statistics.mean(gains) <= gain, gains
    return matching


def test_pans_leave_fedavg_unchanged_as_measured(tmp_path):
    """PANs are stated as *not* reproducing; what was measured is pinned: on pans-mlp.yaml
    reduced to a 20k-image subsample and 40 rounds, FedAvg + PANs differs from FedAvg (the
    encodings act) but by at most 1 point over the last 20 rounds and 2 points in final
    accuracy in every seed, and its neuron matching ("global") is not higher by more than 5
    points on the mean (docs/pans-fedinit.md, reduced form)."""
    pans_as_measured(tmp_path / "pans", "pans-mlp", ROUNDS_REDUCED, 1.0, 2.0, 5.0)


def test_pans_on_lenet_as_measured(tmp_path):
    """pans-cnn.yaml (LeNet-5, PANs on all four hidden layers) in the FedInit LeNet test's
    reduced form, pinned as measured: FedAvg + PANs differs from FedAvg by at most 3 points
    over the last 20 rounds and 6 in final accuracy in every seed, and raises the "global"
    matching by at most 8 points on the mean (docs/pans-fedinit.md, reduced form)."""
    pans_as_measured(tmp_path / "pans-cnn", "pans-cnn", LENET_REDUCED, 3.0, 6.0, 8.0)


def test_pans_matching_protocol_as_measured(tmp_path):
    """pans-match-mlp.yaml (the PANs paper's alignment protocol: 10 peers, all every round,
    20 rounds) on a 20k-image subsample, pinned as measured: FedAvg + PANs differs from
    FedAvg by at most 0.5 points over the last 20 rounds and 1.5 in final accuracy in every
    seed; without PANs the "global" matching is at its ceiling (≥ 85 % in every seed), and
    PANs raise it by at most 1.5 points on the mean (docs/pans-fedinit.md, reduced form)."""
    matching = pans_as_measured(
        tmp_path / "pans-match", "pans-match-mlp", ("dataset.subset=20000",), 0.5, 1.5, 1.5
    )
    for seed, match in zip(SEEDS, matching, strict=True):
        assert match["off"]["global"]["mean"] >= 0.85, (seed, match)
