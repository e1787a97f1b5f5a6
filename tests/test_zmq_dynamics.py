"""The ``network:`` section over real ZeroMQ sockets, in wall-clock time (issue 15): ten peer
processes, two of them killed at their crash times, the others churning and losing messages;
deadline-FedAvg and gossip learning complete, with every fate in the ledger."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import BASE

NETWORK = {
    "churn": {"online": {"mean_s": 1.5}, "offline_fraction": 0.3},
    "crashes": {"at": {2: 2.0, 7: 4.0}},
    "links": {"loss": 0.1},
}
CASES = {
    "fedavg-deadline": {
        "topology": {"kind": "star"},
        "algorithm": {"name": "fedavg", "rounds": 8, "participation": 0.5, "deadline_s": 1.0},
    },
    "gossip": {
        "topology": {"kind": "ring"},
        "algorithm": {"name": "gossip", "rounds": 16, "period_s": 0.5},
    },
}


def run_zmq(tmp_path: Path, sections: dict[str, Any]) -> tuple[subprocess.CompletedProcess, Path]:
    config = BASE | {"peers": {"count": 10}, "network": NETWORK} | sections
    config |= {"transport": {"timeout_s": 30.0}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "p2pfl", "run", str(path), "--transport", "zmq", "--out", str(out)]
    done = subprocess.run(cmd + ["--quiet"], capture_output=True, text=True, timeout=400)
    return done, out


@pytest.mark.parametrize("case", sorted(CASES))
def test_ten_peers_with_crashes_and_churn_complete_over_sockets(tmp_path, case):
    done, out = run_zmq(tmp_path, CASES[case])
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["transport"] == "zmq"
    assert [p["accuracy"] is None for p in summary["per_peer"]] == [i in (2, 7) for i in range(10)]
    with open(out / "comm.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    fates = {r["fate"] for r in rows}
    assert "delivered" in fates and fates & {"lost", "offline", "crashed"}
    assert summary["comm"]["messages"] == len(rows)
    assert sum(v["messages"] for v in summary["comm"]["by_fate"].values()) == len(rows)
    # nothing reaches a crashed peer after its crash
    crash = {"2": 2.0, "7": 4.0}
    late = [r for r in rows if r["dst"] in crash and float(r["arrival"]) > crash[r["dst"]] + 0.5]
    assert all(r["fate"] != "delivered" for r in late)
    with open(out / "availability.csv", newline="") as f:
        spans = [r for r in csv.DictReader(f) if r["peer"] == "2"]
    assert spans and all(float(r["online_to"]) <= 2.0 for r in spans)
