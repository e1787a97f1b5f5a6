"""Every shipped experiment that is one run (not a sweep) runs to the end from the command
line, as its header says: a slow test (``pytest -m slow``, about 12 minutes on one core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT

RUNS = sorted(
    path
    for path in (ROOT / "experiments").glob("*.yaml")
    if "sweep" not in yaml.safe_load(path.read_text())
)


@pytest.mark.slow
@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in RUNS])
def test_a_shipped_experiment_runs_to_the_end(tmp_path, path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "p2pfl", "run", str(path), "--out", str(out), "--quiet"],
        cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["final"]["accuracy"] > 0.1
