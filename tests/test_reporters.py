"""Reporters: ``metrics.csv`` always, TensorBoard on request (``eval.reporters``), and a
reporter of one's own through the same registry; in simulation and over ZeroMQ."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from conftest import BASE, ROOT, python_path, run_experiment
from p2pfl.reporting.reporters import REPORTERS, Reporter

# DFedAvgM on a ring: rows from every peer, each round, and from the final model.
SECTIONS = {
    "topology": {"kind": "ring"},
    "algorithm": {"name": "dfedavgm", "rounds": 3},
    "transport": {"timeout_s": 120},
    "eval": {"reporters": ["tensorboard"]},
}


def p2pfl(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pfl", *args], capture_output=True, text=True, cwd=ROOT, **kw
    )


def metric_rows(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("transport", ["sim", "zmq"])
def test_tensorboard_holds_exactly_the_rows_of_metrics_csv(tmp_path, transport):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE | SECTIONS))
    out = tmp_path / "run"
    proc = p2pfl("run", str(path), "--out", str(out), "--quiet", "--transport", transport)
    assert proc.returncode == 0, proc.stderr
    rows = metric_rows(out)
    assert {r["peer"] for r in rows} == {"0", "1", "2", "3", "final"}

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    expected: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        node = f"peer_{r['peer']}" if r["peer"].isdigit() else r["peer"]
        expected.setdefault(f"{r['metric']}/{node}", []).append(r)
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    assert {"accuracy/peer_3", "loss/peer_0", "accuracy/final"} <= set(expected)
    for tag, want in expected.items():
        got = events.Scalars(tag)
        assert [e.step for e in got] == [int(r["round"]) for r in want]
        assert [f"{e.wall_time:.9g}" for e in got] == [r["time"] for r in want]
        for e, r in zip(got, want, strict=True):  # TensorBoard keeps float32: one ulp
            assert e.value == pytest.approx(float(r["value"]), rel=2**-23, abs=1e-30)


def test_naming_tensorboard_without_the_package_is_a_config_error(tmp_path):
    hidden = tmp_path / "site" / "tensorboard"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('tensorboard is not installed')\n")
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE | SECTIONS))
    out = tmp_path / "run"
    env = {"PYTHONPATH": python_path(hidden.parent, ROOT), "PATH": "/usr/bin:/bin"}
    proc = p2pfl("run", str(path), "--out", str(out), env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: {path}: eval.reporters: the tensorboard reporter needs the tensorboard "
        "package: pip install 'p2pfl[tensorboard]'"
    )
    assert not out.exists()


def test_an_unknown_reporter_is_a_config_error(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE | {"eval": {"reporters": ["tensorbord"]}}))
    proc = p2pfl("run", str(path), "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: {path}: eval.reporters: unknown reporter 'tensorbord'; "
        "choose one of: csv, tensorboard"
    )


@REPORTERS.register("test_memory")
class MemoryReporter(Reporter):
    """A plug-in's reporter: keeps the rows it is given, as ``metrics.csv`` formats them."""

    rows: ClassVar[list[dict[str, str]]] = []
    closed: ClassVar[bool] = False

    def __init__(self, out: Path) -> None:
        MemoryReporter.rows, MemoryReporter.closed = [], False

    def log(self, time: float, round: int, peer: str, metric: str, value: float) -> None:
        row = [f"{time:.9g}", str(round), peer, metric, f"{value:.8g}"]
        self.rows.append(dict(zip(("time", "round", "peer", "metric", "value"), row, strict=True)))

    def close(self) -> None:
        MemoryReporter.closed = True


def test_a_registered_reporter_gets_every_row(tmp_path):
    assert MemoryReporter.name == "test_memory"  # registering sets the name
    run_experiment(tmp_path, eval={"reporters": ["test_memory"]})
    assert MemoryReporter.closed
    assert MemoryReporter.rows == metric_rows(tmp_path) != []
