"""Shared helpers: small, fast experiments on the built-in digits data."""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# One thread per process, in this process and every one it starts (ZeroMQ peers, ranks,
# command lines): results that must be equal across processes are computed alike, and the
# suite's processes do not oversubscribe the cores.
os.environ["OMP_NUM_THREADS"] = "1"
# The data cache (inflated IDX files, p2pfl/data/datasets.py) of this session's processes,
# never the user's own: made here, removed at exit.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="p2pfl-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from p2pfl.app.config import Resolved, resolve  # noqa: E402
from p2pfl.app.experiment import build, run  # noqa: E402
from p2pfl.runtime.sim import SimRuntime  # noqa: E402

torch.set_num_threads(1)

# A suite started in the background by a non-interactive shell (``make test &``, some CI
# runners) ignores SIGINT, and so would every process it starts: the tests that press
# Ctrl-C on a run would wait in vain. Caught here, it is back to its default in children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parent.parent
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

BASE: dict[str, Any] = {
    "name": "test",
    "seed": 0,
    "dataset": {"name": "digits"},
    "partition": {"name": "iid"},
    "model": {"name": "mlp", "hidden": [32]},
    "topology": {"kind": "star"},
    "peers": {"count": 4},
    "algorithm": {"name": "fedavg", "rounds": 2},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.05},
}


DEVICE = {"name": "cpu"}
"""``pytest --device cuda``: the ``peers.device`` of every experiment built here that names
none (the suite's check on a GPU host; docs/performance.md)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", help="peers.device for the suite's experiments")


def pytest_configure(config: pytest.Config) -> None:
    DEVICE["name"] = config.getoption("--device")


def on_device(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with ``pytest --device``'s ``peers.device`` where its peers name none."""
    if DEVICE["name"] != "cpu" and isinstance(raw.get("peers"), dict):
        raw = raw | {"peers": {"device": DEVICE["name"]} | raw["peers"]}
    return raw


def experiment(**sections: dict[str, Any] | int | str) -> Resolved:
    """A resolved digits experiment; each keyword replaces one whole section."""
    raw = on_device(copy.deepcopy(BASE) | sections)
    return resolve(raw, ROOT / "experiments" / "test.yaml")


def run_experiment(out: Path, **sections: dict[str, Any] | int | str) -> dict[str, Any]:
    """Build and run a digits experiment into ``out``; returns summary.json's content."""
    return run(build(experiment(**sections)), out)


def run_cli(
    file: Path, config: dict[str, Any], out: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """Write ``config`` to ``file`` and run ``p2pfl run FILE --out OUT ARGS`` as a user
    would, from the repository root (stdout and stderr captured)."""
    file.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [sys.executable, "-m", "p2pfl", "run", str(file), "--out", str(out), *args],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip


def thousand_peers(file: Path, kind: str) -> Path:
    """Write ``file``: 1,000 digits peers on a ``kind`` graph, 2 images each (drawn with
    replacement), one DFedAvgM round; for the checks that a large population is sized
    before it is built."""
    file.write_text(
        "dataset: {name: digits}\nmodel: {name: mlp, hidden: [8]}\n"
        f"topology: {{kind: {kind}}}\n"
        "partition: {name: iid, samples_per_peer: 2, replace: true, val_fraction: 0}\n"
        "peers: {count: 1000}\nalgorithm: {name: dfedavgm, rounds: 1}\n"
    )
    return file


def sim_and_zmq(tmp_path: Path, config: dict[str, Any]) -> tuple[dict, dict]:
    """Run ``config`` from the command line in simulation (``tmp_path/sim``) and over
    ``--transport zmq`` (``tmp_path/zmq``); both must succeed. Their summary.json contents."""
    for out, args in (("sim", ()), ("zmq", ("--transport", "zmq"))):
        done = run_cli(tmp_path / "exp.yaml", config, tmp_path / out, "--quiet", *args)
        assert done.returncode == 0, done.stderr
    sim, zmq = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("sim", "zmq"))
    return sim, zmq


def sim_runtimes(monkeypatch: pytest.MonkeyPatch) -> list[SimRuntime]:
    """Every ``SimRuntime`` made from now on in this test, kept to read its nodes' ends."""
    runtimes: list[SimRuntime] = []
    init = SimRuntime.__init__

    def spy(self: SimRuntime, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        runtimes.append(self)

    monkeypatch.setattr(SimRuntime, "__init__", spy)
    return runtimes


def finals(
    monkeypatch: pytest.MonkeyPatch, out: Path, **sections: Any
) -> tuple[dict[str, Any], dict[int, Any]]:
    """Run a digits experiment; its summary and every node's final model (``Finish.state``)."""
    runtimes = sim_runtimes(monkeypatch)
    summary = run_experiment(out, **sections)
    (runtime,) = runtimes
    return summary, {n: f.state for n, f in runtime.finals.items()}


needs_fmnist = pytest.mark.skipif(
    not FMNIST_DIR.is_dir(), reason="Debian package dataset-fashion-mnist not installed"
)


def forks_refused() -> bool:
    """Whether this pytest process has used CUDA (``pytest --device cuda``): autograd refuses
    to run in a child forked after the parent's CUDA backward passes, so a test that forks
    must start a fresh process, or skip (the command line forks before any CUDA work)."""
    return torch.cuda.is_initialized()


AFTER_CUDA = "this process ran CUDA: its forked children could not train (run the test alone)"


def python_path(*first: Path) -> str:
    """A child's ``PYTHONPATH``: ``first``, then the suite's own (where it finds its packages
    through one, as on a machine that runs the suite from a checkout)."""
    paths = [*map(str, first), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(filter(None, paths))


def peer_pids(launcher: int) -> dict[str, int]:
    """The launcher's peer processes by node name (each shows as ``p2pfl NAME``)."""
    found = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True)
    pids = {}
    for pid in map(int, found.stdout.split()):
        with contextlib.suppress(OSError):
            comm = Path(f"/proc/{pid}/comm").read_text().split()
            if comm[0] == "p2pfl":
                pids[comm[1]] = pid
    return pids
