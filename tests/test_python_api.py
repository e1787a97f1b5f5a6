"""p2pfl from Python (``p2pfl.run``, ``p2pfl.sweep``, ``p2pfl.cost``): the same runs, files,
tables and error lines as the command line, on the quick-start cut to two rounds."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import yaml

import p2pfl
from conftest import ROOT
from p2pfl.app.cli import main

QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def timeless(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary without its wall-clock times (the only part that differs between runs)."""
    return {k: v for k, v in summary.items() if "wall" not in k}


def cli_run(out: Path, *args: str) -> Path:
    """``p2pfl run`` into ``out``; ``out``."""
    assert main(["run", *args, "--out", str(out), "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def cli_quickstart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quick-start run by the command line with ``--set algorithm.rounds=2``."""
    out = tmp_path_factory.mktemp("cli") / "run"
    return cli_run(out, str(QUICKSTART), "--set", "algorithm.rounds=2")


def assert_same_run(result: p2pfl.Result, cli_dir: Path) -> None:
    """``result`` holds what the command line's run in ``cli_dir`` wrote."""
    summary = json.loads((cli_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["algorithm"] == "fedavg"
    assert timeless(result.summary) == timeless(summary)
    assert result.config == yaml.safe_load((cli_dir / "config.yaml").read_text())
    for table, name in ((result.metrics, "metrics.csv"), (result.comm, "comm.csv")):
        lines = (cli_dir / name).read_text().splitlines()
        assert list(table.columns) == lines[0].split(",")
        assert len(table) == len(lines) - 1 > 0
        pd.testing.assert_frame_equal(table, pd.read_csv(cli_dir / name))


def test_run_gives_the_command_lines_run_and_overrides_are_set(tmp_path, cli_quickstart):
    """``algorithm__rounds=2`` is ``--set algorithm.rounds=2``; the Result's summary is the
    CLI's summary.json (wall times aside) and its tables are the CLI's CSVs, row for row."""
    result = p2pfl.run(QUICKSTART, out=tmp_path / "api", algorithm__rounds=2)
    assert result.out == tmp_path / "api"
    assert result.config["algorithm"]["rounds"] == 2
    assert result.metrics["round"].max() == 2
    assert_same_run(result, cli_quickstart)
    assert list(result.availability.columns) == ["peer", "online_from", "online_to"]
    assert result.availability.empty  # no churn


def test_shard_gives_the_command_lines_sharded_run(tmp_path, cli_quickstart):
    """``workers=2, shard=True`` is ``--workers 2 --shard``: one process's outputs."""
    if torch.cuda.device_count():
        pytest.skip("autograd, once this process has run it on a GPU, refuses forked ranks")
    result = p2pfl.run(QUICKSTART, out=tmp_path / "api", workers=2, shard=True, algorithm__rounds=2)
    assert_same_run(result, cli_quickstart)


def test_shard_events_gives_the_command_lines_run(tmp_path, cli_quickstart):
    """``shard_events=True`` is ``--shard-events``: each rank runs its own peers' events,
    and the outputs are one process's."""
    if torch.cuda.device_count():
        pytest.skip("autograd, once this process has run it on a GPU, refuses forked ranks")
    out = tmp_path / "api"
    result = p2pfl.run(QUICKSTART, out=out, workers=2, shard_events=True, algorithm__rounds=2)
    assert_same_run(result, cli_quickstart)


def test_a_dict_and_yaml_text_give_what_the_file_gives(tmp_path, cli_quickstart, monkeypatch):
    """Their relative paths are found from the current directory; a dotted key passed as
    ``**{"a.b": v}`` is the same override; ``out=None`` is a fresh temporary directory,
    never the current one."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the system's, in this test
    text = QUICKSTART.read_text()
    from_dict = p2pfl.run(yaml.safe_load(text), algorithm__rounds=2)
    from_text = p2pfl.run(text, **{"algorithm.rounds": 2})
    for result in (from_dict, from_text):
        assert result.out.parent == tmp_path
        assert result.out.name.startswith("p2pfl-")
        assert_same_run(result, cli_quickstart)
    assert from_dict.out != from_text.out


def test_a_bad_key_raises_the_command_lines_error_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """str(ConfigError) is the CLI's stderr line after ``error: ``; neither the given
    ``out`` nor a temporary directory is left behind."""
    assert main(["run", str(QUICKSTART), "--set", "algorithm.roundz=2", "--out", "x"]) == 2
    line = capsys.readouterr().err
    with pytest.raises(p2pfl.ConfigError) as caught:
        p2pfl.run(QUICKSTART, out=tmp_path / "api", algorithm__roundz=2)
    assert line == f"error: {caught.value}\n"
    assert "algorithm.roundz" in line and str(QUICKSTART) in line
    assert not (tmp_path / "api").exists()
    with pytest.raises(p2pfl.ConfigError, match=r"^<yaml>: algorithm\.rounds: holds object"):
        p2pfl.run(QUICKSTART.read_text(), out=tmp_path / "api", algorithm__rounds=object())
    assert not (tmp_path / "api").exists()

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with pytest.raises(p2pfl.ConfigError, match=r"^<dict>: bogus: unknown top-level key"):
        p2pfl.run(yaml.safe_load(QUICKSTART.read_text()) | {"bogus": 1})
    assert list(scratch.iterdir()) == []


def test_a_non_empty_out_is_refused_unless_it_holds_a_run_and_force(tmp_path, capsys, monkeypatch):
    """The CLI's --out rules: refused without ``force``; with it, a directory of the user's
    is still refused (and kept), and one that holds a p2pfl run is replaced."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["run", str(QUICKSTART), "--out", str(mine)]) == 2
    line = capsys.readouterr().err
    with pytest.raises(p2pfl.ConfigError) as caught:
        p2pfl.run(QUICKSTART, out=mine, algorithm__rounds=1)
    assert line == f"error: {caught.value}\n" and "not empty" in line
    with pytest.raises(p2pfl.ConfigError, match="--force only replaces a p2pfl run"):
        p2pfl.run(QUICKSTART, out=mine, force=True, algorithm__rounds=1)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # out=None: a directory in it
    first = p2pfl.run(QUICKSTART, algorithm__rounds=1)
    assert first.out.parent == tmp_path
    with pytest.raises(p2pfl.ConfigError, match="not empty"):
        p2pfl.run(QUICKSTART, out=first.out, algorithm__rounds=2)
    again = p2pfl.run(QUICKSTART, out=first.out, force=True, algorithm__rounds=2)
    assert again.metrics["round"].max() == 2


def test_import_p2pfl_does_not_import_torch():
    """The lazy exports: ``import p2pfl`` (and its errors) stay light; ``p2pfl.run`` loads
    the library, still without torch (a run imports it)."""
    code = (
        "import sys, p2pfl\n"
        "print('p2pfl.app.library' in sys.modules, 'torch' in sys.modules)\n"
        "assert p2pfl.ConfigError.__module__ == 'p2pfl.core.errors'\n"
        "assert callable(p2pfl.run)\n"
        "print('p2pfl.app.library' in sys.modules, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False False\nTrue False\n"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        p2pfl.nope  # noqa: B018


def test_cost_gives_the_command_lines_table(tmp_path):
    """``p2pfl.cost`` is ``p2pfl cost`` with the same options: the same cost.csv."""
    args = ["--topologies", "ring,star", "--methods", "fedavg,dfedavgm", "--peers", "6"]
    assert main(["cost", str(QUICKSTART), *args, "--out", str(tmp_path / "cli")]) == 0
    table = p2pfl.cost(
        QUICKSTART, topologies="ring,star", methods="fedavg,dfedavgm", peers=6, out=tmp_path / "api"
    )
    expected = pd.read_csv(tmp_path / "cli" / "cost.csv")
    assert len(expected) == 4 and set(expected["topology"]) == {"ring", "star"}
    pd.testing.assert_frame_equal(table, expected)
    assert table.attrs["out"] == tmp_path / "api"


def test_sweep_gives_the_command_lines_tables_and_each_cells_result(tmp_path, capsys, monkeypatch):
    """A two-cell sweep (two seeds): the table and cells are the CLI's sweep.csv and
    cells.csv (wall times aside); each cell's Result is its directory's run. ``p2pfl.run``
    refuses a sweep, ``p2pfl.sweep`` an experiment that is none."""
    monkeypatch.chdir(ROOT)  # the quick-start's relative topology file is found from here
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["algorithm"]["rounds"] = 2
    file = tmp_path / "sweep.yaml"
    file.write_text(yaml.safe_dump(raw | {"sweep": {"seed": [0, 1]}}))
    cli_run(tmp_path / "cli", str(file))
    capsys.readouterr()
    swept = p2pfl.sweep(file, out=tmp_path / "api")
    assert "sweep.csv" in capsys.readouterr().out  # it reports as the command line does
    expected = pd.read_csv(tmp_path / "cli" / "sweep.csv", dtype={"note": str}).fillna({"note": ""})
    assert expected["runs"].tolist() == [2] and expected["note"].tolist() == [""]
    assert swept.table["accuracy_mean"].dtype == float
    pd.testing.assert_frame_equal(swept.table, expected)
    cells = pd.read_csv(tmp_path / "cli" / "cells.csv", dtype={"reason": str}).fillna(
        {"reason": ""}
    )
    pd.testing.assert_frame_equal(
        swept.cells.drop(columns="wall_time_s"), cells.drop(columns="wall_time_s")
    )
    assert sorted(swept.runs) == ["seed=0", "seed=1"]
    for name, result in swept.runs.items():
        assert result.summary["seed"] == int(name.removeprefix("seed="))
        assert_same_run(result, tmp_path / "cli" / name)
    with pytest.raises(p2pfl.ConfigError, match=r"sweep\.yaml: sweep: this is a sweep"):
        p2pfl.run(file, out=tmp_path / "refused")
    with pytest.raises(p2pfl.ConfigError, match="this is not a sweep"):
        p2pfl.sweep(QUICKSTART, out=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_plot_draws_what_p2pfl_plot_draws(tmp_path, capsys):
    """``Result.plot()`` writes the files ``p2pfl plot RUN_DIR`` writes, in RUN_DIR/plots."""
    result = p2pfl.run(QUICKSTART, out=tmp_path / "run", algorithm__rounds=1)
    assert main(["plot", str(result.out), "--out", str(tmp_path / "cli")]) == 0
    drawn = result.plot()
    assert drawn and all(p.parent == result.out / "plots" for p in drawn)
    assert sorted(p.name for p in drawn) == sorted(p.name for p in (tmp_path / "cli").iterdir())
