"""scripts/regression.py: fingerprints recorded and checked on the same tree agree (exit 0);
a fingerprint file changed by hand is a difference naming its file (exit 1); wall-clock keys
and columns are left out and nothing else; ``--quick`` shortens what it says."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "regression.py"
spec = importlib.util.spec_from_file_location("regression", SCRIPT)
assert spec is not None and spec.loader is not None
regression = importlib.util.module_from_spec(spec)
sys.modules["regression"] = regression
spec.loader.exec_module(regression)


def script(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip


def test_record_then_check_on_the_same_tree_agrees_and_a_changed_fingerprint_is_named(tmp_path):
    record, work = tmp_path / "quick.json", tmp_path / "work"
    done = script("record", record, "--quick", "--only", "^quickstart$", "--work", work)
    assert done.returncode == 0, done.stderr
    data = json.loads(record.read_text())
    assert data["mode"] == "quick" and list(data["runs"]) == ["quickstart"]
    run = data["runs"]["quickstart"]
    assert run["exit"] == 0
    assert sorted(run["files"]) == ["comm.csv", "metrics.csv", "partition.csv", "summary.json"]
    # --quick: 2 of the quick-start's 20 rounds, 1 of its 2 epochs
    config = yaml.safe_load((work / "current" / "quickstart" / "config.yaml").read_text())
    assert (config["algorithm"]["rounds"], config["train"]["epochs"]) == (2, 1)

    done = script("check", record, "--work", work)  # the file's mode and runs
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[1:-1]]
    assert rows == [["quickstart", name, "same"] for name in sorted(run["files"])]
    assert done.stdout.splitlines()[-1].startswith(f"all 1 runs the same as {record}")

    data["runs"]["quickstart"]["files"]["metrics.csv"] = "0" * 64
    record.write_text(json.dumps(data))
    done = script("check", record, "--work", work)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["quickstart", "metrics.csv", "DIFFERENT"]
    assert sum("DIFFERENT" in line for line in lines) == 1
    assert lines[-1].startswith(f"1 difference(s) against {record}")
    report = (work / "report.txt").read_text()
    assert "metrics.csv    DIFFERENT" in report


def test_wall_clock_keys_are_left_out_at_any_depth_and_nothing_else(tmp_path):
    summary = {
        "experiment": "x", "wall_time_s": 1.5, "compute_wall_s": 0.2, "sim_time_s": 0.62,
        "cells": [{"startup_wall_s": 3.0, "start_spread_s": 0.1, "accuracy": 0.5}],
    }  # fmt: skip
    assert regression.without_wall_clock(summary) == {
        "experiment": "x", "sim_time_s": 0.62, "cells": [{"accuracy": 0.5}],
    }  # fmt: skip
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps(summary))
    first = regression.summary_digest(out / "summary.json", out)
    (out / "summary.json").write_text(json.dumps(summary | {"wall_time_s": 99.0}))
    assert regression.summary_digest(out / "summary.json", out) == first
    (out / "summary.json").write_text(json.dumps(summary | {"sim_time_s": 0.63}))
    assert regression.summary_digest(out / "summary.json", out) != first
    # a sweep's cells.csv: its wall_time_s column only
    cells = out / "cells.csv"
    cells.write_text("seed,cell,status,accuracy,wall_time_s\n0,seed=0,ok,0.5,1.25\n")
    first = regression.csv_digest(cells)
    cells.write_text("seed,cell,status,accuracy,wall_time_s\n0,seed=0,ok,0.5,7.5\n")
    assert regression.csv_digest(cells) == first
    cells.write_text("seed,cell,status,accuracy,wall_time_s\n0,seed=0,ok,0.51,1.25\n")
    assert regression.csv_digest(cells) != first


def test_quick_shortens_each_method_by_its_own_keys():
    raws = {ex.name: ex.raw for ex in regression.experiments()}
    assert regression.quick_sets(raws["quickstart"]) == ["algorithm.rounds=2", "train.epochs=1"]
    assert regression.quick_sets(raws["fedseq-ring"]) == [
        "train.epochs=1",
        "dataset.subset=3000",
        "dataset.test_subset=500",
    ]  # fmt: skip  (cycles: 1 already)
    assert regression.quick_sets(raws["population-dfedavgm"]) == [
        "algorithm.rounds=2",
        "dataset.subset=3000",
        "dataset.test_subset=500",
        "peers.count=1000",
    ]  # fmt: skip  (10,000 peers would outnumber 3,000 samples)
    assert "peers.count=1000" not in regression.quick_sets(raws["population-gossip"])  # replace
    fedfisher = regression.quick_sets(raws["fedfisher-digits-mesh"])
    assert fedfisher == ["algorithm.steps=100", "algorithm.val_every=50", "train.epochs=1"]
    sweep = regression.quick_sets(raws["sweep-digits"])
    grid = json.loads(sweep[-1].partition("=")[2])
    assert grid == {  # on digits: every algorithm and topology, the first seed
        "algorithm": [
            {"name": "fedavg", "rounds": 2}, {"name": "fedseq", "cycles": 1},
            {"name": "dfedavgm", "rounds": 2},
        ],
        "topology": ["ring", "mesh", "star"],
        "seed": [0],
    }  # fmt: skip
    grid = json.loads(regression.quick_sets(raws["dynamics-pushsum"])[-1].partition("=")[2])
    assert grid == {  # on Fashion-MNIST: the last value of each key, the first seed
        "algorithm": [{"name": "dfedavgm", "rounds": 2, "wait_s": 0.5, "mixing": "uniform"}],
        "network.links.loss": [0.2],
        "seed": [0],
    }


def test_the_list_holds_every_experiment_and_a_network_adversary_run():
    names = [ex.name for ex in regression.experiments()]
    assert names[:-1] == sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml"))
    last = regression.experiments()[-1].raw
    assert "network" in last and "adversary" in last
    assert names[-1] == "regression-network-adversary"


def test_a_tree_whose_code_is_not_imported_is_refused(tmp_path):
    """``--base``'s guard: the installed package must not stand in for the worktree's."""
    side = regression.Side("base", tmp_path, tmp_path)  # no p2pfl/ here
    with pytest.raises(SystemExit) as info:
        side.check_import()
    assert info.value.code == 2
