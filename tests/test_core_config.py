"""Bad input: exit code 2 and one line ``error: FILE: key.path: what is wrong``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import BASE, ROOT
from p2pfl.app.cli import main


def write(tmp_path: Path, config: dict, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def error_line(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; assert exit 2 and a single error line; return it."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("error: ")
    return err


def broken(**changes) -> dict:
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for dotted, value in changes.items():
        section, _, key = dotted.partition("__")
        if key:
            config[section][key] = value
        else:
            config[section] = value
    return config


CASES = [
    # (changes, expected "key.path: message" fragment)
    ({"partition__alpa": 0.5}, "partition.alpa: unknown key; valid keys are:"),
    ({"train__epochs": "two"}, "train.epochs: must be integer, got 'two'"),
    ({"train__lr": -1.0}, "train.lr: must be > 0"),
    ({"algorithm__name": "fedsgd"}, "algorithm.name: unknown method 'fedsgd'; choose one of:"),
    ({"dataset__name": "imagenet"}, "dataset.name: unknown dataset 'imagenet'"),
    ({"topology__kind": "hypercube"}, "topology.kind: unknown topology kind 'hypercube'"),
    ({"partition": {"name": "dirichlet", "alpha": 0.0}}, "partition.alpha: must be > 0"),
    ({"partition": {"name": "dirichlet", "alpha": -1}}, "partition.alpha: must be > 0"),
    ({"peers__count": 5000}, "peers.count:"),
    ({"topology__kind": "ring"}, "topology.kind: fedavg runs on star, not on 'ring'"),
    ({"algorithm": {"name": "dfedavgm"}}, "topology.kind: dfedavgm is serverless"),
    ({"peers__device": "tpu"}, "peers.device: must be cpu, cuda, cuda:N or auto"),
    ({"model__hidden": [0]}, "model.hidden:"),
    ({"seed": "zero"}, "seed: must be an integer"),
    ({"surprise": 1}, "surprise: unknown top-level key"),
    ({"topology": {"kind": "watts_strogatz", "k": 9}}, "topology.k: must be in [2, 3]"),
    ({"dataset": {"name": "mnist"}}, "dataset.root: missing required key"),
    ({"dataset": {"name": "mnist", "root": "/nonexistent"}}, "dataset.root:"),
]


@pytest.mark.parametrize("changes,expected", CASES)
def test_bad_config_is_one_line_with_file_and_key(tmp_path, capsys, changes, expected):
    path = write(tmp_path, broken(**changes))
    err = error_line(capsys, ["run", str(path), "--out", str(tmp_path / "out")])
    assert err.startswith(f"error: {path}: ")
    assert expected in err
    assert not (tmp_path / "out").exists()  # nothing half-written for a config error


def test_missing_sections_and_files(tmp_path, capsys):
    err = error_line(capsys, ["run", str(tmp_path / "nope.yaml")])
    assert "nope.yaml: no such experiment file" in err
    config = broken()
    del config["algorithm"]
    assert "algorithm: missing required section" in error_line(
        capsys, ["run", str(write(tmp_path, config))]
    )
    config = broken(topology={"file": "topologies/none.yaml"})
    assert "topology.file: no such topology file" in error_line(
        capsys, ["run", str(write(tmp_path, config))]
    )
    (tmp_path / "bad.yaml").write_text("seed: [1,\n")
    assert "not valid YAML" in error_line(capsys, ["run", str(tmp_path / "bad.yaml")])


def test_bad_arguments(tmp_path, capsys):
    path = write(tmp_path, broken())
    assert "--set" in error_line(capsys, ["run", str(path), "--set", "noequals"])
    err = error_line(capsys, ["run", str(path), "--set", "train.epochs=x"])
    assert "train.epochs: must be integer" in err
    assert "invalid int value" in error_line(capsys, ["run", str(path), "--seed", "x"])
    assert "invalid choice" in error_line(capsys, ["run", str(path), "--transport", "pigeon"])


def test_set_and_seed_override_the_file(tmp_path, capsys):
    path = write(tmp_path, broken())
    out = tmp_path / "out"
    argv = ["run", str(path), "--out", str(out), "--quiet", "--seed", "3"]
    argv += ["--set", "algorithm.rounds=1", "--set", "partition={name: dirichlet, alpha: 1}"]
    assert main(argv) == 0
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["seed"] == 3 and resolved["algorithm"]["rounds"] == 1
    assert resolved["partition"] == {
        "name": "dirichlet", "alpha": 1.0, "min_size": 10, "max_tries": 100,
        "val_fraction": 0.1, "seed": None,
    }  # fmt: skip
    assert resolved["train"]["optimizer"] == "sgd"  # defaults are written out


def test_real_command_exit_code_and_no_traceback(tmp_path):
    path = write(tmp_path, broken(train__epochs=0))
    proc = subprocess.run(
        [sys.executable, "-m", "p2pfl", "run", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {path}: train.epochs: must be >= 1"


def test_every_shipped_experiment_resolves(capsys):
    from p2pfl.app.sweep import load_experiment

    files = sorted((ROOT / "experiments").glob("*.yaml"))
    assert len(files) >= 4
    for path in files:
        load_experiment(path)
