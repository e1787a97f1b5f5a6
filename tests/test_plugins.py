"""Plug-ins, as a user meets them: the worked example of docs/extending.md run from its own
directory (simulated, over ZeroMQ, in a sweep and in ``p2pfl cost``), the same package
installed under the ``p2pfl.plugins`` entry point, and broken plug-ins as one-line errors."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT, python_path
from p2pfl.learning.models import MODELS
from p2pfl.network.message import Message
from p2pfl.network.wire import encode

EXAMPLE = ROOT / "examples" / "plugin"
# One thread, as the ZeroMQ launcher gives its peers: the same float rounding in both runtimes.
ENV = os.environ | {"OMP_NUM_THREADS": "1"}
SMALL = ["--set", "peers.count=4", "--set", "algorithm.rounds=3", "--quiet"]
M = len(
    encode(Message("model", 0, 1, 1, MODELS.get("mlp")((1, 8, 8), 10, hidden=(32,)).state_dict()))
)
"""One model message of the example's MLP (64-32-10 on 8×8 digits), header included."""


def p2pfl(*args: str, cwd: Path = EXAMPLE, **env: str) -> subprocess.CompletedProcess:
    """``python -m p2pfl ARGS`` as a user types it in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "p2pfl", *args],
        cwd=cwd, env=ENV | env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def test_the_example_runs_from_its_directory(tmp_path):
    done = p2pfl("run", "experiment.yaml", "--out", str(tmp_path), "--quiet")
    assert done.returncode == 0, done.stderr
    s = summary(tmp_path)
    assert s["algorithm"] == "push_gossip" and s["topology"] == "ring"
    assert s["final"]["accuracy"] > 0.7  # ten digit classes: chance is 0.1
    assert s["comm"]["messages"] == 10 * 6  # every peer pushes one model a round
    assert s["comm"]["total_bytes"] == 10 * 6 * M
    with (tmp_path / "partition.csv").open() as f:
        sizes = sorted(int(row["total"]) for row in csv.DictReader(f))
    assert sizes[0] < sizes[-1] / 2  # quantity skew: unequal peers
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert config["plugins"] == [str(EXAMPLE / "push_gossip.py")]


def test_the_example_over_zeromq_gives_the_simulated_result(tmp_path):
    sim = p2pfl("run", "experiment.yaml", "--out", str(tmp_path / "sim"), *SMALL)
    real = p2pfl(
        "run", "experiment.yaml", "--out", str(tmp_path / "zmq"), "--transport", "zmq", *SMALL,
        "--set", "transport.timeout_s=120",
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    assert real.returncode == 0, real.stderr
    a, b = summary(tmp_path / "sim"), summary(tmp_path / "zmq")
    assert (a["transport"], b["transport"]) == ("sim", "zmq")
    assert a["final"]["accuracy"] > 0.3
    assert a["final"] == b["final"]
    assert a["per_peer"] == b["per_peer"]
    assert a["comm"] == b["comm"]
    assert b["comm"]["messages"] == 3 * 4 and b["comm"]["total_bytes"] == 3 * 4 * M


def test_cost_follows_the_methods_formula_and_the_ledger(tmp_path):
    done = p2pfl("cost", "experiment.yaml", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"M = {M:,} bytes" in done.stdout
    with (tmp_path / "cost.csv").open() as f:
        rows = {r["topology"]: r for r in csv.DictReader(f)}
    for kind in ("ring", "mesh"):  # R·N messages of M bytes; each peer sends R of them
        row = rows[kind]
        assert (row["status"], int(row["messages"])) == ("ok", 60)
        assert int(row["total_bytes"]) == int(row["model_bytes"]) == 60 * M
        assert float(row["peer_up_mean"]) == float(row["peer_up_max"]) == 10 * M
    assert rows["star"]["status"] == "n/a" and "serverless" in rows["star"]["note"]
    ran = p2pfl("run", "experiment.yaml", "--out", str(tmp_path / "run"), "--quiet")
    assert ran.returncode == 0, ran.stderr
    with (tmp_path / "run" / "comm.csv").open() as f:
        ledger = list(csv.DictReader(f))
    assert len(ledger) == 60 and {int(r["bytes"]) for r in ledger} == {M}


def test_every_component_from_plugins(tmp_path):
    done = p2pfl("run", "components.yaml", "--out", str(tmp_path / "run"), "--quiet")
    assert done.returncode == 0, done.stderr
    s = summary(tmp_path / "run")
    assert (s["topology"], s["num_peers"]) == ("torus", 9)
    assert s["final"]["accuracy"] > 0.5  # four classes: chance is 0.25
    assert s["comm"]["messages"] == 5 * 9
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["plugins"] == [str(EXAMPLE / "push_gossip.py"), str(EXAMPLE / "components.py")]
    assert config["dataset"] == {
        "name": "blobs", "classes": 4, "side": 4, "train": 800, "test": 200, "noise": 1.0,
        "subset": None, "test_subset": None,
    }  # fmt: skip
    # the jsonl reporter got every row metrics.csv got
    with (tmp_path / "run" / "metrics.csv").open() as f:
        rows = [(r["round"], r["peer"], r["metric"], float(r["value"])) for r in csv.DictReader(f)]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    jsonl = [(str(r["round"]), r["peer"], r["metric"], r["value"]) for r in map(json.loads, lines)]
    assert len(jsonl) == len(rows) > 5 * 9 * 2
    assert [r[:3] for r in jsonl] == [r[:3] for r in rows]
    assert [r[3] for r in jsonl] == pytest.approx([r[3] for r in rows], rel=1e-7)  # CSV: 8 digits
    # bf16 packs 2 bytes an entry and its name is as long as fp16's: the same frames
    cost = p2pfl(
        "cost", "components.yaml", "--set", "compression.model.codec=fp16",
        "--topologies", "torus", "--out", str(tmp_path / "cost"),
    )  # fmt: skip
    assert cost.returncode == 0, cost.stderr
    with (tmp_path / "cost" / "cost.csv").open() as f:
        (row,) = csv.DictReader(f)
    assert int(row["total_bytes"]) == s["comm"]["total_bytes"]


def test_a_sweep_over_the_plugin_method(tmp_path):
    grid = "sweep={algorithm.name: [push_gossip, dfedavgm], topology: [ring, star]}"
    # named three times (by path, by name, by another path): imported once, registered once
    named = "plugins=[push_gossip.py, push_gossip, ../plugin/push_gossip.py]"
    done = p2pfl(
        "run", "experiment.yaml", "--set", grid, "--set", named, "--out", str(tmp_path), *SMALL
    )
    assert done.returncode == 0, done.stderr
    with (tmp_path / "cells.csv").open() as f:
        cells = {r["cell"]: r for r in csv.DictReader(f)}
    for method in ("push_gossip", "dfedavgm"):
        assert cells[f"algorithm.name={method},topology=ring"]["status"] == "ok"
        assert cells[f"algorithm.name={method},topology=star"]["status"] == "skipped"
        assert "serverless" in cells[f"algorithm.name={method},topology=star"]["reason"]
    cell = tmp_path / "algorithm.name=push_gossip,topology=ring"
    assert summary(cell)["comm"]["total_bytes"] == 3 * 4 * M
    assert yaml.safe_load((cell / "config.yaml").read_text())["plugins"] == [
        str(EXAMPLE / "push_gossip.py"), "push_gossip", str(EXAMPLE / "push_gossip.py"),
    ]  # fmt: skip


def test_an_installed_entry_point_needs_no_plugins_key(tmp_path):
    source = shutil.copytree(EXAMPLE, tmp_path / "source")  # the build writes next to it
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet"]
    installed = subprocess.run(
        [*pip, "--target", str(site), str(source)], capture_output=True, text=True, timeout=300
    )
    assert installed.returncode == 0, installed.stderr
    work = tmp_path / "work"  # neither the example nor the installed modules are here
    work.mkdir()
    config = yaml.safe_load((EXAMPLE / "components.yaml").read_text())
    del config["plugins"]
    (work / "exp.yaml").write_text(yaml.safe_dump(config))
    done = p2pfl("run", "exp.yaml", "--out", str(work / "out"), "--quiet", cwd=work,
                 PYTHONPATH=python_path(site))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert summary(work / "out")["final"]["accuracy"] > 0.5
    assert "plugins" not in yaml.safe_load((work / "out" / "config.yaml").read_text())
    plain = p2pfl("run", "exp.yaml", "--out", str(work / "plain"), cwd=work)
    assert plain.returncode == 2
    assert "dataset.name: unknown dataset 'blobs'" in plain.stderr


BROKEN = {
    "syntax": ("def f(:\n", "SyntaxError: invalid syntax"),
    "missing-dependency": (
        "import no_such_package_p2pfl\n",
        "ModuleNotFoundError: No module named 'no_such_package",
    ),
    "raises": ("x = 1\nraise RuntimeError('boom')\n", "RuntimeError: boom (at "),
    "taken-name": (
        "from p2pfl.api import METHODS, Method\n\n\n@METHODS.register('fedavg')\n"
        "class Mine(Method):\n    pass\n",
        "method 'fedavg' is already registered (by p2pfl.methods.fedavg)",
    ),
    "missing-file": (None, "no_such_file.py: no such file"),
    "unknown-module": (None, "no_such_module: no module named 'no_such_module'"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_plugin_is_one_line_and_writes_nothing(tmp_path, case):
    source, message = BROKEN[case]
    name = {"missing-file": "no_such_file.py", "unknown-module": "no_such_module"}.get(
        case, f"{case.replace('-', '_')}.py"
    )
    if source is not None:
        (tmp_path / name).write_text(source)
    shutil.copy(EXAMPLE / "experiment.yaml", tmp_path / "exp.yaml")
    out = tmp_path / "out"
    done = p2pfl("run", "exp.yaml", "--set", f"plugins=[{name}]", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"error: exp.yaml: plugins: {name}: ")
    assert message in done.stderr
    assert not out.exists()


def test_cost_of_a_method_without_a_plan_is_one_line(tmp_path):
    (tmp_path / "idle.py").write_text(
        "from p2pfl.api import METHODS, Behaviour, Finish, Method, NodeContext\n\n\n"
        "@METHODS.register('idle')\nclass Idle(Method):\n"
        "    def total_rounds(self, num_peers: int) -> int:\n        return 1\n\n"
        "    def behaviour(self, ctx: NodeContext) -> Behaviour:\n"
        "        yield Finish(ctx.init_state())\n"
    )
    shutil.copy(EXAMPLE / "experiment.yaml", tmp_path / "exp.yaml")
    sets = ["--set", "plugins=[idle.py]", "--set", "algorithm={name: idle}"]
    sets += ["--set", "partition={name: iid}"]  # quantity_skew is push_gossip.py's
    done = p2pfl("cost", "exp.yaml", *sets, "--out", str(tmp_path / "cost"), cwd=tmp_path)
    assert done.returncode == 2
    assert (
        done.stderr
        == "error: algorithm.name: idle has no analytic cost plan (it defines no transfers())\n"
    )
    assert not (tmp_path / "cost").exists()


def test_the_docs_show_the_examples_code():
    """Every Python snippet of docs/extending.md is a verbatim piece of the example (or of
    the built-in method it shows)."""
    page = (ROOT / "docs" / "extending.md").read_text()
    files = [*sorted(EXAMPLE.glob("*.py")), ROOT / "p2pfl" / "methods" / "adpsgd.py"]
    code = "".join(p.read_text() for p in files)
    snippets = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(snippets) >= 5
    for snippet in snippets:
        assert snippet in code, snippet[:200]
