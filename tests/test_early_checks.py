"""Checks that need no training run before anything is written (exit 2, one ``error:`` line).

Two that used to come late: a misspelled ``algorithm.aggregator`` (found only when the run
was built; now when the config is resolved, with the registered names listed, and the rule's
defaults written into ``config.yaml``), and DFedAvgM's Metropolis–Hastings mixing on a graph
that ``network.graph`` redraws (a run that started, then failed at t = 0.018 s with exit 1 or
deadlocked; now refused when the run is built, before its directory is made). Each through
the real command line, for a run and for a sweep cell.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import BASE, experiment, run_experiment
from p2pfl.app.config import resolve
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError
from p2pfl.learning.robust import AGGREGATORS

CLI = Path(sys.executable).parent / "p2pfl"
"""The installed command (``.venv/bin/p2pfl`` when the suite runs from the venv)."""

RING: dict[str, Any] = {"kind": "ring"}
REDRAWN = {"graph": {"every": "round", "kind": "s_out", "s": 2}}
METROPOLIS = (
    "algorithm.mixing: metropolis mixing needs a static graph, and network.graph changes it: "
    "set mixing: uniform"
)


def unknown_aggregator(name: str) -> str:
    return (
        f"algorithm.aggregator.name: unknown aggregator {name!r}; "
        f"choose one of: {', '.join(AGGREGATORS.names())}"
    )


def cli_run(tmp_path: Path, raw: dict[str, Any]) -> tuple[int, str, str, Path]:
    """``p2pfl run FILE --out DIR`` as a user types it: exit code, stdout, stderr, DIR."""
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = tmp_path / "out"
    command = [str(CLI)] if CLI.is_file() else [sys.executable, "-m", "p2pfl"]
    done = subprocess.run(
        [*command, "run", str(path), "--out", str(out), "--quiet"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr, out


def assert_refused(tmp_path: Path, raw: dict[str, Any], message: str) -> None:
    code, stdout, stderr, out = cli_run(tmp_path, raw)
    assert code == 2, stderr
    assert stdout == ""
    assert stderr == f"error: {tmp_path / 'exp.yaml'}: {message}\n"
    assert not out.exists()


def raw_experiment(**sections: Any) -> dict[str, Any]:
    return copy.deepcopy(BASE) | sections


# --- a misspelled aggregator ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("algorithm", "topology"),
    [
        ({"name": "fedavg", "rounds": 2, "aggregator": {"name": "medain"}}, {"kind": "star"}),
        ({"name": "dfedavgm", "rounds": 2, "aggregator": "medain"}, RING),
    ],
)
def test_a_misspelled_aggregator_is_refused_by_the_command_before_anything_is_written(
    tmp_path, algorithm, topology
):
    raw = raw_experiment(algorithm=algorithm, topology=topology)
    assert_refused(tmp_path, raw, unknown_aggregator("medain"))


def test_a_misspelled_aggregator_is_found_when_the_config_is_resolved():
    """Resolution, not build(): ``p2pfl cost`` and every sweep cell's check see it too."""
    for name in ("fedavg", "fedprox", "dfedavgm", "dfedsam"):
        raw = raw_experiment(algorithm={"name": name, "aggregator": "krun"})
        with pytest.raises(ConfigError) as info:
            resolve(raw, Path("exp.yaml"))
        assert str(info.value) == unknown_aggregator("krun"), name
    raw = raw_experiment(algorithm={"name": "fedavg", "aggregator": {"name": "krum", "m": 0}})
    with pytest.raises(ConfigError, match=r"^algorithm\.aggregator\.m: must be >= 1"):
        resolve(raw, Path("exp.yaml"))  # the rule's own checks, too


@pytest.mark.parametrize(
    ("option", "resolved"),
    [
        ("mean", {"name": "mean"}),
        ("median", {"name": "median"}),
        ("trimmed_mean", {"name": "trimmed_mean", "b": 1}),
        ({"name": "krum", "m": 3}, {"name": "krum", "f": None, "m": 3}),
        (
            {"name": "centered_clipping"},
            {"name": "centered_clipping", "tau": None, "iterations": 1},
        ),
    ],
)
def test_the_aggregators_defaults_are_resolved(option, resolved):
    config = experiment(algorithm={"name": "fedavg", "rounds": 2, "aggregator": option}).config
    assert config["algorithm"]["aggregator"] == resolved
    assert (
        resolve(copy.deepcopy(config), Path("exp.yaml")).config == config
    )  # config.yaml reads back


def test_config_yaml_holds_the_aggregators_defaults_and_the_run_is_unchanged(tmp_path):
    """The rule named, or the same rule written out with its defaults: the same run."""
    algorithm = {"name": "fedavg", "rounds": 2, "aggregator": "trimmed_mean"}
    short = run_experiment(tmp_path / "short", algorithm=algorithm)
    written = yaml.safe_load((tmp_path / "short" / "config.yaml").read_text())
    assert written["algorithm"]["aggregator"] == {"name": "trimmed_mean", "b": 1}
    long = run_experiment(tmp_path / "long", algorithm=written["algorithm"])
    for name in ("metrics.csv", "comm.csv"):
        assert (tmp_path / "short" / name).read_bytes() == (tmp_path / "long" / name).read_bytes()
    assert short["final"] == long["final"] and short["comm"] == long["comm"]


# --- Metropolis mixing on a graph that changes ----------------------------------------------


def test_metropolis_mixing_on_a_redrawn_graph_is_refused_by_the_command(tmp_path):
    """It used to start, then fail at t = 0.018 s with exit 1 (with ``wait_s``)."""
    raw = raw_experiment(
        topology=RING, peers={"count": 6}, network=REDRAWN,
        algorithm={"name": "dfedavgm", "rounds": 2, "wait_s": 0.5},
    )  # fmt: skip
    assert_refused(tmp_path, raw, METROPOLIS)


@pytest.mark.parametrize(
    ("algorithm", "graph"),
    [
        ({"name": "dfedavgm", "rounds": 2}, REDRAWN["graph"]),  # used to deadlock at t = 1.8 s
        ({"name": "dfedsam", "rounds": 2, "mixing": "metropolis"}, REDRAWN["graph"]),
        ({"name": "dfedavgm", "wait_s": 0.5}, {"every": 0.2, "kind": "random_regular", "d": 2}),
        (
            {"name": "dfedavgm", "wait_s": 0.5},
            {"schedule": [{"at_s": 0, "kind": "ring"}, {"at_s": 0.1, "kind": "mesh"}]},
        ),
    ],
)
def test_metropolis_mixing_on_any_changing_graph_is_refused_when_built(algorithm, graph):
    config = experiment(
        topology=RING, peers={"count": 6}, algorithm=algorithm, network={"graph": graph}
    )
    with pytest.raises(ConfigError) as info:
        build(config)
    assert str(info.value) == METROPOLIS


def test_uniform_mixing_or_a_static_graph_is_accepted():
    for network, mixing in [(REDRAWN, "uniform"), ({"links": {"loss": 0.1}}, "metropolis")]:
        config = experiment(
            topology=RING, peers={"count": 6}, network=network,
            algorithm={"name": "dfedavgm", "rounds": 2, "wait_s": 0.5, "mixing": mixing},
        )  # fmt: skip
        assert build(config).network is not None


# --- in a sweep -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sweep", "key", "cell", "reason"),
    [
        (
            {"algorithm.aggregator": ["median", "medain"]},
            "algorithm.aggregator.name",
            "algorithm.aggregator=medain",
            unknown_aggregator("medain").partition(": ")[2],
        ),
        (
            {"algorithm.mixing": ["uniform", "metropolis"]},
            "algorithm.mixing",
            "algorithm.mixing=metropolis",
            METROPOLIS.partition(": ")[2],
        ),
    ],
)
def test_a_sweep_with_such_a_cell_writes_nothing(tmp_path, sweep, key, cell, reason):
    """Every cell is checked before the first runs: the good cell before it never starts."""
    raw = raw_experiment(
        topology=RING, peers={"count": 6}, network=REDRAWN, sweep=sweep,
        algorithm={"name": "dfedavgm", "rounds": 2, "wait_s": 0.5, "mixing": "uniform"},
    )  # fmt: skip
    code, stdout, stderr, out = cli_run(tmp_path, raw)
    assert code == 2, stderr
    assert stderr == f"error: {tmp_path / 'exp.yaml'}: {key} (sweep cell {cell}): {reason}\n"
    assert not out.exists()
