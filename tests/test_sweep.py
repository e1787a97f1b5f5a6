"""Sweeps: the grid, skipped cells with their reason, the comparison table, resuming."""

from __future__ import annotations

import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch
import yaml

from conftest import AFTER_CUDA, forks_refused
from p2pfl.app import sweep
from p2pfl.app.cli import main
from p2pfl.core.errors import ConfigError, RunError
from p2pfl.reporting import plots

BASE = {
    "name": "mini",
    "dataset": {"name": "digits"},
    "model": {"name": "mlp", "hidden": [8]},
    "topology": {"kind": "star"},
    "peers": {"count": 3},
    "algorithm": {"name": "fedavg", "rounds": 1},
    "train": {"epochs": 1, "batch_size": 64, "lr": 0.05},
}
GRID = {
    "algorithm": [{"name": "fedavg", "rounds": 1}, "dfedavgm"],
    "topology": ["ring", "star"],
    "seed": [0, 1],
    "algorithm.rounds": [1],
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models train much faster on one thread, above all on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write(tmp_path, grid=GRID, **changes):
    file = tmp_path / "sweep.yaml"
    file.write_text(yaml.safe_dump(BASE | changes | {"sweep": grid}, sort_keys=False))
    return str(file)


def rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_values_apply_as_sections_shorthands_and_dotted_keys():
    raw = {"topology": {"kind": "star", "link": {}}, "algorithm": {"name": "fedavg", "rounds": 5}}
    values = {"algorithm.cycles": 2, "algorithm": "fedseq", "topology": "ring", "seed": 3}
    assert sweep.apply(raw, values) == {
        "topology": {"kind": "ring"},
        "algorithm": {"name": "fedseq", "cycles": 2},
        "seed": 3,
    }
    assert sweep.apply(raw, {"topology": {"kind": "mesh", "link": {"latency_s": 0}}}) == raw | {
        "topology": {"kind": "mesh", "link": {"latency_s": 0}}
    }
    assert sweep.label({"name": "fedavg", "rounds": 5}) == "fedavg_rounds-5"
    assert sweep.label([64, 32]) == "64-32"
    assert sweep.label("a b/c") == "a-b-c"


def test_sweep_runs_the_grid_skips_misfits_and_writes_the_table(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", write(tmp_path), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    cells = rows(out / "cells.csv")
    assert [c["status"] for c in cells] == ["skipped"] * 2 + ["ok"] * 4 + ["skipped"] * 2
    assert "fedavg runs on star, not on 'ring'" in cells[0]["reason"]
    assert "dfedavgm is serverless" in cells[-1]["reason"]
    ran = [c["cell"] for c in cells if c["status"] == "ok"]
    assert ran[0] == "algorithm=fedavg_rounds-1,topology=star,seed=0,algorithm.rounds=1"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(ran)
    table = rows(out / "sweep.csv")
    assert [(r["algorithm"], r["topology"], r["runs"]) for r in table] == [
        ("fedavg_rounds-1", "ring", "0"),
        ("fedavg_rounds-1", "star", "2"),
        ("dfedavgm", "ring", "2"),
        ("dfedavgm", "star", "0"),
    ]
    accs = [json.loads((out / c / "summary.json").read_text())["final"]["accuracy"] for c in ran]
    assert float(table[1]["accuracy_mean"]) == pytest.approx(statistics.fmean(accs[:2]))
    assert float(table[1]["accuracy_std"]) == pytest.approx(statistics.stdev(accs[:2]))
    assert table[0]["note"].startswith("skipped: topology.kind: fedavg runs on star")
    assert "skipped: topology.kind: fedavg runs on star" in printed
    for stem in ("sweep", "accuracy", "traffic", "partition-1", "partition-2"):
        for fmt in ("png", "svg"):
            assert (out / f"{stem}.{fmt}").is_file()


def test_a_second_run_skips_finished_cells_and_reruns_changed_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "figures", lambda *args: {})  # figures: the test above
    monkeypatch.setattr(plots, "sweep_chart", lambda *args: [])
    out = tmp_path / "out"
    grid = {"algorithm": ["fedavg"], "algorithm.rounds": [1], "seed": [0, 1]}
    assert main(["run", write(tmp_path, grid), "--out", str(out), "--quiet"]) == 0
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/summary.json")}
    assert len(stamps) == 2

    calls = []
    real_run = sweep.run
    monkeypatch.setattr(sweep, "run", lambda *a, **k: calls.append(a[1]) or real_run(*a, **k))
    assert main(["run", write(tmp_path, grid), "--out", str(out), "--quiet"]) == 0
    assert calls == []
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/summary.json")} == stamps
    assert [c["status"] for c in rows(out / "cells.csv")] == ["done", "done"]

    first = sorted(stamps)[0]
    summary = json.loads(first.read_text())
    first.write_text(json.dumps(summary | {"status": "failed"}))
    assert main(["run", write(tmp_path, grid), "--out", str(out), "--quiet"]) == 0
    assert calls == [first.parent]

    changed = write(tmp_path, grid, train=BASE["train"] | {"lr": 0.1})
    assert main(["run", changed, "--out", str(out), "--quiet"]) == 0
    assert len(calls) == 3


def test_a_sweep_reuses_its_own_directory_and_no_other(tmp_path, capsys, monkeypatch):
    """Without ``--force`` a sweep goes into a directory that holds something only to resume
    it: one that holds a sweep's outputs and nothing else."""
    monkeypatch.setattr(plots, "figures", lambda *args: {})
    monkeypatch.setattr(plots, "sweep_chart", lambda *args: [])
    file, out = write(tmp_path, {"seed": [0]}), tmp_path / "out"
    assert main(["run", file, "--out", str(out), "--quiet"]) == 0
    (out / "notes.txt").write_text("mine")
    (out / "seed=0" / "summary.json").write_text("{}")  # would run again if it could
    capsys.readouterr()
    assert main(["run", file, "--out", str(out), "--quiet"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert (out / "seed=0" / "summary.json").read_text() == "{}"
    (out / "notes.txt").unlink()
    assert main(["run", file, "--out", str(out), "--quiet"]) == 0  # resumed
    assert [c["status"] for c in rows(out / "cells.csv")] == ["ok"]

    skipped, out = write(tmp_path, {"topology": ["ring"]}), tmp_path / "skipped"
    assert main(["run", skipped, "--out", str(out), "--quiet"]) == 0
    assert main(["run", skipped, "--out", str(out), "--quiet"]) == 0  # cells.csv: the sweep's
    assert [c["status"] for c in rows(out / "cells.csv")] == ["skipped"]

    single = tmp_path / "single.yaml"
    single.write_text(yaml.safe_dump(BASE))
    run_dir = tmp_path / "run"
    assert main(["run", str(single), "--out", str(run_dir), "--quiet"]) == 0
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    capsys.readouterr()
    assert main(["run", file, "--out", str(run_dir), "--quiet"]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_a_cell_run_again_keeps_nothing_of_its_last_run(tmp_path, monkeypatch):
    """A cell whose config changed starts from an empty directory: no ``availability.csv`` of
    a ``network:`` section it no longer has (which ``p2pfl plot`` would draw)."""
    monkeypatch.setattr(plots, "sweep_chart", lambda *args: [])
    out, grid = tmp_path / "out", {"seed": [0]}
    network = {"crashes": {"at": {1: 1000}}}
    assert main(["run", write(tmp_path, grid, network=network), "--out", str(out), "--quiet"]) == 0
    assert (out / "seed=0" / "availability.csv").is_file()
    assert "availability" in plots.figures([out])
    assert main(["run", write(tmp_path, grid), "--out", str(out), "--quiet"]) == 0
    assert sorted(p.name for p in (out / "seed=0").iterdir()) == [
        "comm.csv", "config.yaml", "metrics.csv", "partition.csv", "partition.png", "summary.json"
    ]  # fmt: skip
    assert "availability" not in plots.figures([out])


def test_a_cell_whose_summary_is_not_a_mapping_runs_again(tmp_path, monkeypatch):
    """A cell's summary.json that parses as JSON but is no summary (a list) is not a
    finished cell: the next pass runs it again (it was an AttributeError)."""
    monkeypatch.setattr(plots, "figures", lambda *args: {})
    monkeypatch.setattr(plots, "sweep_chart", lambda *args: [])
    out = tmp_path / "out"
    grid = {"algorithm": ["fedavg"], "algorithm.rounds": [1], "seed": [0, 1]}
    assert main(["run", write(tmp_path, grid), "--out", str(out), "--quiet"]) == 0
    spoilt = sorted(out.glob("*/summary.json"))[0]
    spoilt.write_text("[]")
    assert main(["run", write(tmp_path, grid), "--out", str(out), "--quiet"]) == 0
    assert [c["status"] for c in rows(out / "cells.csv")] == ["ok", "done"]
    assert json.loads(spoilt.read_text())["status"] == "ok"


def outputs(out, cell):
    """A cell's outputs, wall times left out."""
    summary = json.loads((out / cell / "summary.json").read_text())
    files = [(out / cell / f).read_bytes() for f in ("metrics.csv", "comm.csv", "partition.csv")]
    return {k: v for k, v in summary.items() if "wall" not in k}, files


def test_a_sweep_on_two_workers_writes_what_one_writes(tmp_path, capsys):
    """``--workers 2`` runs two cells at a time, each in a forked child, and draws the
    figures in two processes: the same tables (but wall times), the same outputs in every
    cell, each cell reported once, the same pictures."""
    grid = {"algorithm": ["dfedavgm"], "topology": ["ring", "mesh"], "seed": [0, 1, 2]}
    file = write(tmp_path, grid)
    printed = ""
    for workers in ("1", "2"):
        argv = ["run", file, "--out", str(tmp_path / workers), "--quiet", "--workers", workers]
        if forks_refused():
            command = [sys.executable, "-m", "p2pfl", *argv]
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr
            printed += done.stdout
        else:
            assert main(argv) == 0
            printed += capsys.readouterr().out
    one, two = rows(tmp_path / "1" / "cells.csv"), rows(tmp_path / "2" / "cells.csv")
    assert [c["status"] for c in two] == ["ok"] * 6
    timeless = [[{k: v for k, v in c.items() if k != "wall_time_s"} for c in t] for t in (one, two)]
    assert timeless[0] == timeless[1]
    tables = [(tmp_path / w / "sweep.csv").read_bytes() for w in ("1", "2")]
    assert tables[0] == tables[1]
    for cell in (c["cell"] for c in one):
        assert outputs(tmp_path / "1", cell) == outputs(tmp_path / "2", cell)
        assert printed.count(f"] {cell}: ok") == 2
    for stem in ("sweep", "accuracy", "traffic", "partition-1", "partition-2", "partition-3"):
        pictures = [(tmp_path / w / f"{stem}.png").read_bytes() for w in ("1", "2")]
        assert pictures[0] == pictures[1], stem
        assert (tmp_path / "2" / f"{stem}.svg").is_file()


def test_a_figure_that_fails_on_a_worker_is_one_error_line(tmp_path, capsys, monkeypatch):
    """The figure drawn in the forked child fails: the sweep says so and exits with 1,
    its tables written."""
    if forks_refused():
        pytest.skip(AFTER_CUDA)

    def figures(paths):
        return {"accuracy": lambda: 1 / 0}  # the second drawing: the child's

    monkeypatch.setattr(plots, "figures", figures)
    file = write(tmp_path, {"algorithm": ["dfedavgm"], "topology": ["ring"], "seed": [0]})
    out = tmp_path / "out"
    assert main(["run", file, "--out", str(out), "--quiet", "--workers", "2"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: drawing the sweep's figures failed (exit status 1)"
    )
    assert (out / "sweep.csv").is_file() and (out / "sweep.png").is_file()


def test_a_cell_that_fails_or_dies_on_a_worker_is_reported_and_the_rest_run(tmp_path, monkeypatch):
    """A cell whose run fails gets its reason in cells.csv, as on one worker; one whose
    process dies gets its exit code; the other cells run, and the sweep exits with 1."""
    if forks_refused():
        pytest.skip(AFTER_CUDA)
    monkeypatch.setattr(plots, "figures", lambda *args: {})
    real_run = sweep.run

    def run(setup, out, *args):  # the children are forked: they call this too
        seed = setup.config["seed"]
        if seed == 1:
            raise RunError("deadlock: nobody can move")
        if seed == 2:
            os._exit(3)
        return real_run(setup, out, *args)

    monkeypatch.setattr(sweep, "run", run)
    file = write(tmp_path, {"algorithm": ["dfedavgm"], "topology": ["ring"], "seed": [0, 1, 2, 3]})
    out = tmp_path / "out"
    assert main(["run", file, "--out", str(out), "--quiet", "--workers", "2"]) == 1
    cells = rows(out / "cells.csv")
    assert [(c["status"], c["reason"]) for c in cells] == [
        ("ok", ""),
        ("failed", "deadlock: nobody can move"),
        ("failed", "its process ended with exit code 3"),
        ("ok", ""),
    ]


def test_ctrl_c_ends_a_sweeps_running_cells_as_interrupted_runs(tmp_path):
    """Ctrl-C (SIGINT to the command's process group) on ``--workers 2``: the sweep stops
    its two running cells, each writes ``summary.json`` saying ``interrupted``, and the
    command ends with one line and exit code 130, as one run does."""
    grid = {"topology": ["ring"], "seed": [0, 1]}
    file = write(tmp_path, grid, algorithm={"name": "dfedavgm", "rounds": 100_000})
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "p2pfl", "run", file, "--out", str(out), "--quiet"]
    proc = subprocess.Popen(
        [*cmd, "--workers", "2"], env=os.environ | {"OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    cells = [out / f"topology=ring,seed={s}" for s in (0, 1)]
    metrics = [cell / "metrics.csv" for cell in cells]
    try:
        for _ in range(600):  # both cells under way: a few rounds scored (at most a minute)
            if all(m.is_file() and len(m.read_text().splitlines()) > 3 for m in metrics):
                break
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err == "error: interrupted (SIGINT)\n", err
    for cell in cells:
        assert json.loads((cell / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({"algoritm": ["fedavg"]}, "sweep.algoritm: must be a section or a dotted key path"),
        ({"seed": 3}, "sweep.seed: must be a non-empty list"),
        ({"algorithm.rouns": [1]}, "algorithm.rouns (sweep cell algorithm.rouns=1): unknown key"),
        ({"model.hidden": [[8], [8]]}, "two values share a directory label"),
        ({}, "sweep: must be a non-empty mapping"),
    ],
)
def test_bad_sweeps_stop_before_anything_is_written(tmp_path, capsys, grid, message):
    out = tmp_path / "out"
    assert main(["run", write(tmp_path, grid), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_load_keeps_set_and_seed_on_the_base(tmp_path):
    raw, grid = sweep.load(write(tmp_path), ["train.lr=0.2"], seed=4)
    assert raw["train"]["lr"] == 0.2 and raw["seed"] == 4 and "sweep" not in raw
    assert grid == GRID
    with pytest.raises(ConfigError):
        sweep.cells(raw, {"topology": ["ring", "ring"]}, tmp_path / "sweep.yaml")
