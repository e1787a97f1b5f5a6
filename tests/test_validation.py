"""One validation phase (issue 14 §2): every check that needs no training runs before a run,
a peer or any cell of a sweep writes anything. A bad configuration is exit code 2 and one
line ``error: FILE: key.path: reason`` naming the key, with no traceback and no output."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import conftest
from conftest import BASE, ROOT
from p2pfl.app.cli import main
from p2pfl.app.experiment import build
from p2pfl.data.datasets import load_dataset, loaded_once


def experiment(tmp_path: Path, **sections: Any) -> Path:
    """BASE with whole sections replaced (``None`` drops one), written to ``exp.yaml``."""
    config = copy.deepcopy(BASE) | sections
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in config.items() if v is not None}))
    return path


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI in-process; assert exit 2 and exactly one ``error:`` line; return it."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


STAR = {"kind": "star"}
VAL0 = {"name": "iid", "val_fraction": 0.0}

# (changes: whole sections of BASE, extra CLI arguments, the key the error must name)
CATALOGUE: list[tuple[dict[str, Any], list[str], str]] = [
    # name and seed
    ({"name": ["a"]}, [], "name"),
    ({"name": 5}, [], "name"),
    ({"seed": "zero"}, [], "seed"),
    ({"seed": -1}, [], "seed"),
    ({"seed": True}, [], "seed"),
    ({"surprise": 1}, [], "surprise"),
    # dataset
    ({"dataset": {"name": "imagenet"}}, [], "dataset.name"),
    ({"dataset": "digits"}, [], "dataset"),
    ({"dataset": {"name": "digits", "colour": True}}, [], "dataset.colour"),
    ({"dataset": {"name": "digits", "subset": 0}}, [], "dataset.subset"),
    ({"dataset": {"name": "digits", "subset": 99999}}, [], "dataset.subset"),
    ({"dataset": {"name": "mnist"}}, [], "dataset.root"),
    ({"dataset": {"name": "mnist", "root": "/nonexistent"}}, [], "dataset.root"),
    # partition
    ({"partition": {"name": "dirichlet", "alpa": 0.5}}, [], "partition.alpa"),
    ({"partition": {"name": "dirichlet", "alpha": 0}}, [], "partition.alpha"),
    ({"partition": {"name": "iid", "val_fraction": 1.0}}, [], "partition.val_fraction"),
    ({"partition": {"name": "iid", "seed": -1}}, [], "partition.seed"),
    ({"partition": {"name": "dirichlet", "min_size": 500}}, [], "partition.min_size"),
    ({"partition": {"name": "shards", "classes_per_peer": 11}}, [], "partition.classes_per_peer"),
    ({"partition": {"name": "shards"}, "peers": {"count": 4}}, [], "partition.classes_per_peer"),
    (
        {
            "dataset": {"name": "digits", "subset": 40},
            "partition": VAL0 | {"val_fraction": 1 - 1e-11},
        },
        [],
        "partition.val_fraction",
    ),
    ({"partition": {"name": "disjoint"}, "peers": {"count": 11}}, [], "partition.name"),
    ({"partition": {"name": "domain", "angles": []}}, [], "partition.angles"),
    # model
    ({"model": {"name": "vgg"}}, [], "model.name"),
    ({"model": {"name": "mlp", "dropout": 0.5}}, [], "model.dropout"),
    ({"model": {"name": "mlp", "hidden": [0]}}, [], "model.hidden"),
    ({"model": {"name": "lenet", "padding": 0}}, [], "model.name"),  # 8x8 digits: too small
    ({"model": {"name": "mlp", "pans": {"mode": "on"}}}, [], "model.pans.mode"),
    # topology
    ({"topology": {"kind": "star", "lattency_s": 0.1}}, [], "topology.lattency_s"),
    ({"topology": {"kind": "hypercube"}}, [], "topology.kind"),
    ({"topology": {"kind": ["star"]}}, [], "topology.kind"),
    ({"topology": {"link": {}}}, [], "topology.kind"),
    ({"topology": {"kind": "star", "link": {"latency_s": -1}}}, [], "topology.link.latency_s"),
    ({"topology": {"kind": "star", "links": 3}}, [], "topology.links"),
    ({"topology": STAR | {"links": [{"between": [0, 2]}]}}, [], "topology.links.0.between"),
    ({"topology": STAR | {"links": [{"between": [0]}]}}, [], "topology.links.0.between"),
    ({"topology": {"kind": "watts_strogatz", "k": 9}}, [], "topology.k"),
    ({"topology": {"file": "topologies/none.yaml"}}, [], "topology.file"),
    ({"topology": {"kind": "ring"}}, [], "topology.kind"),  # fedavg needs a star
    # peers
    ({"peers": {"count": 0}}, [], "peers.count"),
    ({"peers": {"count": 5000}}, [], "peers.count"),
    ({"peers": {"count": 4, "device": "tpu"}}, [], "peers.device"),
    ({"peers": {"count": 4, "device": "cuda:99"}}, [], "peers.device"),
    ({"peers": {"count": 4, "speed": -1}}, [], "peers.speed"),
    ({"peers": {"count": 4, "profile": "peers/none.yaml"}}, [], "peers.profile"),
    ({"peers": {"count": 4, "cores": 2}}, [], "peers.cores"),
    # algorithm, and the checks a method makes on the model and the data
    ({"algorithm": None}, [], "algorithm"),
    ({"algorithm": {"name": "fedsgd"}}, [], "algorithm.name"),
    ({"algorithm": {"name": "fedavg", "rounds": 0}}, [], "algorithm.rounds"),
    ({"algorithm": {"name": "fedavg", "rouns": 2}}, [], "algorithm.rouns"),
    ({"algorithm": {"name": "fedfisher"}, "partition": VAL0}, [], "partition.val_fraction"),
    (
        {"algorithm": {"name": "regmean", "select": "final"}, "model": {"name": "cnn_s"}},
        [],
        "model.name",
    ),  # BatchNorm has no Gram statistics
    ({"algorithm": {"name": "maecho"}, "model": {"name": "cnn_s"}}, [], "model.name"),
    # train
    ({"train": {"epochs": "two"}}, [], "train.epochs"),
    ({"train": {"lr": -1.0}}, [], "train.lr"),
    ({"train": {"optimizer": "rmsprop"}}, [], "train.optimizer"),
    ({"train": {"select": "best_val"}, "partition": VAL0}, [], "partition.val_fraction"),
    # eval
    ({"eval": {"every": 0}}, [], "eval.every"),
    ({"eval": {"matching": {"peers": 9}}}, [], "eval.matching.peers"),
    ({"eval": {"reporters": ["nope"]}}, [], "eval.reporters"),
    ({"eval": {"peers": 0}}, [], "eval.peers"),
    ({"eval": {"peers": 5}}, [], "eval.peers"),  # BASE has 4 peers
    ({"eval": {"peers": True}}, [], "eval.peers"),
    # transport
    ({"transport": {"timeout_s": 0}}, [], "transport.timeout_s"),
    ({"transport": {"curve_keys": "/nonexistent"}}, ["--transport", "zmq"], "transport.curve_keys"),
    # compression
    ({"compression": {"modle": {"codec": "int8"}}}, [], "compression.modle"),
    ({"compression": {"model": {"codec": "zip"}}}, [], "compression.model.codec"),
    (
        {"compression": {"model": {"codec": "topk", "fraction": 0}}},
        [],
        "compression.model.fraction",
    ),
    # plugins
    ({"plugins": ["no_such_plugin.py"]}, [], "plugins"),
    ({"plugins": "mine.py"}, [], "plugins"),
    # --set and --seed
    ({}, ["--set", "noequals"], "--set"),
    ({}, ["--set", "train.epochs=x"], "train.epochs"),
    ({}, ["--set", "topology.kind.x=1"], "topology.kind"),
    ({}, ["--set", "nope.x=1"], "nope"),
    ({}, ["--seed", "-3"], "seed"),
    ({}, ["--seed", "x"], "--seed"),
    # sweeps: a bad cell is named with its key, before any cell runs
    ({"sweep": {"algoritm": ["fedavg"]}}, [], "sweep.algoritm"),
    ({"sweep": {"seed": 3}}, [], "sweep.seed"),
    ({"sweep": {"topology": ["star", "star"]}}, [], "sweep.topology"),
    (
        {"topology": STAR | {"lattency_s": 0.1}, "sweep": {"seed": [0, 1]}},
        [],
        "topology.lattency_s (sweep cell seed=0)",
    ),
    ({"sweep": {"peers.count": [4, 2000]}}, [], "peers.count (sweep cell peers.count=2000)"),
    (
        {"sweep": {"algorithm": ["fedavg", "fedfisher"]}, "partition": VAL0},
        [],
        "partition.val_fraction (sweep cell algorithm=fedfisher)",
    ),
    (
        {"algorithm": {"name": "fedfisher"}, "partition": VAL0, "sweep": {"topology": ["ring"]}},
        [],
        "partition.val_fraction (sweep cell topology=ring)",  # a misfit too: still a bad cell
    ),
    (
        {"sweep": {"topology": ["ring", "star"], "train.lr": [0.1, -1]}},
        [],
        "train.lr (sweep cell topology=ring,train.lr=-1)",
    ),
]


def case_id(case: tuple[dict[str, Any], list[str], str]) -> str:
    return case[2].split(" ")[0] + ("_" + case[1][0] if case[1] else "")


@pytest.mark.parametrize("changes,argv,key", CATALOGUE, ids=[case_id(c) for c in CATALOGUE])
def test_a_bad_configuration_is_one_error_line_naming_its_key_and_writes_nothing(
    tmp_path, capsys, changes, argv, key
):
    path = experiment(tmp_path, **changes)
    out = tmp_path / "out"
    line = one_error_line(capsys, ["run", str(path), "--out", str(out), "--quiet", *argv])
    assert f" {key}: " in line or line.startswith(f"error: argument {key}:")
    if not key.startswith("--"):
        assert line.startswith(f"error: {path}: {key}: ")
    assert not out.exists()


def test_the_catalogue_covers_every_section():
    covered = {key.split(".")[0].split(" ")[0] for _, _, key in CATALOGUE}
    covered |= {k for changes, _, _ in CATALOGUE for k in changes}
    sections = ["name", "seed", "dataset", "partition", "model", "topology", "peers"]
    sections += ["algorithm", "train", "eval", "transport", "compression", "plugins"]
    assert set(sections) | {"--set", "--seed", "sweep"} <= covered
    assert len(CATALOGUE) >= 40


@pytest.mark.parametrize("command", ["run", "peer"])
def test_an_output_path_through_a_file_is_a_bad_argument(tmp_path, capsys, command):
    path = experiment(tmp_path)
    argv = peer_argv(path, tmp_path) if command == "peer" else ["run", str(path)]
    line = one_error_line(capsys, [*argv, "--out", str(path / "out")])
    assert line == f"error: --out: {path} is a file, not a directory"


def test_an_unknown_topology_key_lists_the_keys_a_topology_has(tmp_path, capsys):
    path = experiment(tmp_path, topology={"kind": "ring", "lattency_s": 0.1})
    line = one_error_line(capsys, ["run", str(path), "--out", str(tmp_path / "out")])
    assert line.endswith(
        "topology.lattency_s: unknown key; valid keys are: file, kind, link, links"
    )
    path = experiment(tmp_path, topology={"kind": "erdos_renyi", "q": 0.1})
    line = one_error_line(capsys, ["run", str(path), "--out", str(tmp_path / "out")])
    assert line.endswith("topology.q: unknown key; valid keys are: file, kind, link, links, p")


def test_issue_sweep_with_a_misspelt_topology_key_stops_before_writing(tmp_path, capsys):
    """Issue 14: this sweep "skipped" every cell, wrote files and exited 0."""
    path = experiment(
        tmp_path,
        topology={"kind": "ring", "lattency_s": 0.1},
        algorithm={"name": "dfedavgm", "rounds": 1},
        sweep={"seed": [0, 1]},
    )
    out = tmp_path / "out"
    line = one_error_line(capsys, ["run", str(path), "--out", str(out), "--quiet"])
    assert "topology.lattency_s (sweep cell seed=0): unknown key" in line
    assert not out.exists()


def test_issue_fedfisher_without_a_validation_split_stops_before_training(tmp_path, capsys):
    """Issue 14: this trained every peer, computed the Fishers, then exited 1."""
    path = experiment(tmp_path, algorithm={"name": "fedfisher"}, partition=VAL0)
    out = tmp_path / "out"
    line = one_error_line(capsys, ["run", str(path), "--out", str(out)])
    assert "partition.val_fraction: fedfisher with select: val" in line
    assert not out.exists()  # nothing trained: a run writes config.yaml before it trains
    build(conftest.experiment(algorithm={"name": "fedfisher", "select": "final"}, partition=VAL0))


def test_a_sweep_skips_only_the_cells_whose_method_does_not_fit(tmp_path, capsys):
    path = experiment(
        tmp_path,
        model={"name": "mlp", "hidden": [8]},
        train={"epochs": 1, "batch_size": 64},
        algorithm={"name": "fedavg", "rounds": 1},
        sweep={"topology": ["ring", "star"]},
    )
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "[1/2] topology=ring: skipped (topology.kind: fedavg runs on star, not on 'ring')" in (
        printed
    )
    assert "[2/2] topology=star: ok" in printed
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["topology=star"]


def peer_argv(path: Path, tmp_path: Path, peer: str = "0", addresses: Any = None) -> list[str]:
    """``p2pfl peer`` for one node of a 4-peer star, with an addresses file."""
    table = {str(i): f"tcp://127.0.0.1:{47400 + i}" for i in range(4)} | {
        "server": "tcp://127.0.0.1:47404"
    }
    file = tmp_path / "addresses.yaml"
    file.write_text(yaml.safe_dump(table if addresses is None else addresses))
    out = str(tmp_path / "out")
    return ["peer", str(path), "--peer", peer, "--addresses", str(file), "--out", out]


@pytest.mark.parametrize(
    "changes,key",
    [
        ({"topology": {"kind": "star", "lattency_s": 0.1}}, "topology.lattency_s"),
        ({"algorithm": {"name": "fedfisher"}, "partition": VAL0}, "partition.val_fraction"),
        ({"peers": {"count": 4, "device": "cuda:99"}}, "peers.device"),
        ({"transport": {"curve_keys": "/nonexistent"}}, "transport.curve_keys"),
        ({"sweep": {"peers.count": [4, 2000]}}, "peers.count (sweep cell peers.count=2000)"),
    ],
)
def test_peer_validates_like_run(tmp_path, capsys, changes, key):
    path = experiment(tmp_path, **changes)
    line = one_error_line(capsys, peer_argv(path, tmp_path))
    assert f" {key}: " in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "peer,addresses,message",
    [
        ("7", None, "--peer: no node '7' in this topology; nodes are: 0, 1, 2, 3, server"),
        ("0", {"0": "tcp://127.0.0.1:1"}, "addresses.yaml: no address for node(s) 1, 2, 3"),
        ("0", {"0": "127.0.0.1:1"}, "addresses.yaml: 0: must be tcp://HOST:PORT"),
        ("0", {"nine": "tcp://127.0.0.1:1"}, "addresses.yaml: nine: no node 'nine'"),
    ],
)
def test_peer_checks_its_node_and_addresses_before_writing(
    tmp_path, capsys, peer, addresses, message
):
    path = experiment(tmp_path)
    line = one_error_line(capsys, peer_argv(path, tmp_path, peer, addresses))
    assert message in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command,changes,key",
    [
        ("run", {"topology": STAR | {"lattency_s": 0.1}, "sweep": {"seed": [0]}}, "topology"),
        ("run", {"algorithm": {"name": "fedfisher"}, "partition": VAL0}, "partition"),
        ("peer", {"peers": {"count": 4, "device": "tpu"}}, "peers.device"),
    ],
)
def test_the_real_command_exits_2_with_one_line(tmp_path, command, changes, key):
    path = experiment(tmp_path, **changes)
    argv = ["run", str(path), "--out", str(tmp_path / "out")]
    if command == "peer":
        argv = peer_argv(path, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "p2pfl", *argv], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: {key}"), proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_sweep_loads_each_dataset_once():
    """Checking every cell builds it: within a sweep a dataset is loaded and normalised once,
    outside nothing is kept."""
    with loaded_once():
        first, second = (load_dataset({"name": "digits"}, seed) for seed in (0, 1))
        assert first.train_x.data_ptr() == second.train_x.data_ptr()
    again = load_dataset({"name": "digits"}, 0)
    assert again.train_x.data_ptr() != first.train_x.data_ptr()
    assert torch.equal(again.train_x, first.train_x)
