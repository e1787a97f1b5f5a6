"""Hostile values (issue 36): numbers and files that the schema takes but a run cannot.

Churn sessions so short that a run would draw billions of them, a churn trace that is not
text or holds no time, an adversary that leaves no honest peer, a robust rule that the
topology cannot feed and a ``metrics.csv`` row of the wrong width: each is refused up front,
exit 2 and one ``error:`` line, before anything is written. A run that fails with an
exception that has no text still says what failed.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import test_hostile_config
import yaml
from test_hostile_config import exp_file, refused, run_refused

from conftest import BASE
from p2pfl.app.cli import main
from p2pfl.learning.robust import parse_aggregator

finished = test_hostile_config.finished  # the finished run that the plot cases spoil


def run_line(tmp_path: Path, capsys: Any, expected: str, **sections: Any) -> None:
    """``p2pfl run`` of BASE with ``sections`` exits 2 with exactly ``error: EXP: expected``
    and writes nothing in its ``--out``."""
    path = exp_file(tmp_path, **sections)
    line = run_refused(tmp_path, capsys, path, [], expected)
    assert line == f"error: {path}: {expected}"


# --- 1. churn sessions too short for any run --------------------------------------------
CYCLES = [  # (network.churn, the line's reason)
    (
        {"online": {"mean_s": 1e-9}, "offline_fraction": 0.3},
        "online and offline sessions average 1e-09 + 4.29e-10 s",
    ),
    (
        {"online": {"mean_s": 1e-300}, "offline_fraction": 0.3},
        "online and offline sessions average 1e-300 + 1e-12 s",
    ),
    (
        {"online": {"mean_s": 4e-4}, "offline": {"dist": "constant", "mean_s": 5e-4}},
        "online and offline sessions average 0.0004 + 0.0005 s",
    ),
]


@pytest.mark.parametrize("churn,reason", CYCLES, ids=["1e-9", "1e-300", "both-set"])
def test_churn_sessions_too_short_for_any_run_are_refused(tmp_path, capsys, churn, reason):
    """Before: a minute of drawing sessions, then a MemoryError or an empty reason."""
    expected = f"{reason}: a cycle must average at least 0.001 s (raise their mean_s)"
    run_line(tmp_path, capsys, f"network.churn: {expected}", network={"churn": churn})


WEIBULL = {"dist": "weibull", "mean_s": 2, "shape": 0.001}
LOGNORMAL = {"dist": "lognormal", "mean_s": 2, "sigma": 1e200}
OVERFLOWS = [  # distributions whose parameters make draw() overflow (before: exit 1 mid-run)
    (
        {"churn": {"online": WEIBULL, "offline_fraction": 0.3}},
        "network.churn.online.shape: 0.001 is too small (Γ(1 + 1/k) overflows)",
    ),
    (
        {"churn": {"online": LOGNORMAL, "offline_fraction": 0.3}},
        "network.churn.online.sigma: 1e+200 is too large (sigma² overflows)",
    ),
    (
        {"links": {"jitter": WEIBULL | {"mean_s": 0.01, "shape": 0.005}}},
        "network.links.jitter.shape: 0.005 is too small (Γ(1 + 1/k) overflows)",
    ),
]


@pytest.mark.parametrize("network,expected", OVERFLOWS, ids=["weibull", "lognormal", "jitter"])
def test_a_distribution_that_cannot_be_drawn_is_refused(tmp_path, capsys, network, expected):
    run_line(tmp_path, capsys, expected, network=network)


def test_a_run_that_would_draw_too_many_sessions_ends_with_one_line(tmp_path, capsys, monkeypatch):
    """Sessions above the floor but too many for the run's length: the bound on the
    sessions drawn ends it with one line (here lowered to 50 to meet it in a short run),
    and availability.csv keeps what was drawn."""
    monkeypatch.setattr("p2pfl.network.dynamics.MAX_SESSIONS", 50)
    churn = {"online": {"mean_s": 0.002}, "offline_fraction": 0.3}
    path = exp_file(tmp_path, network={"churn": churn})
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    pattern = (
        r"error: run failed: at t=[0-9.]+s: network\.churn: over 50 sessions drawn by "
        r"t=[0-9.e-]+ s: they are far too short for this run \(raise their mean_s\)\n"
    )
    assert re.fullmatch(pattern, err), err
    assert yaml.safe_load((out / "summary.json").read_text())["status"] == "failed"
    assert (out / "availability.csv").read_text().startswith("peer,online_from,online_to\n")


# --- 1b. a failure whose exception has no text still names it ------------------------------
def run_plugin(tmp_path: Path, plugin: str, **sections: Any) -> subprocess.CompletedProcess:
    (tmp_path / "plug.py").write_text(plugin)
    config = copy.deepcopy(BASE) | {"plugins": ["plug.py"]} | sections
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "p2pfl", "run", str(path), "--out", str(tmp_path / "out")]
    return subprocess.run([*cmd, "--quiet"], cwd=tmp_path, capture_output=True, text=True)


EXHAUSTING = """
from dataclasses import dataclass
from p2pfl.api import ATTACKS, Attack

@ATTACKS.register("exhausting")
@dataclass(kw_only=True, frozen=True)
class Exhausting(Attack):
    def corrupt(self, honest, view):
        raise MemoryError
"""

SILENT = """
from p2pfl.api import REPORTERS, Reporter

@REPORTERS.register("silent")
class Silent(Reporter):
    def log(self, time, round, peer, metric, value):
        if peer == "final":
            raise KeyError
"""


def test_a_failure_in_the_simulation_without_text_names_its_exception(tmp_path):
    done = run_plugin(tmp_path, EXHAUSTING, adversary={"peers": [1], "attack": "exhausting"})
    assert done.returncode == 1, done.stderr
    assert re.fullmatch(r"error: run failed: at t=[0-9.]+s: MemoryError\n", done.stderr)


def test_a_failure_after_the_simulation_without_text_names_its_exception(tmp_path):
    done = run_plugin(tmp_path, SILENT, eval={"reporters": ["silent"]})
    assert done.returncode == 1, done.stderr
    assert done.stderr == "error: run failed: KeyError\n"


# --- 2. churn traces that are not text, or hold no time -------------------------------------
NOT_A_TIME = "needs a finite time >= 0 and state up or down, got"
TRACES = [  # (trace bytes, the reason after "FILE ")
    (b"time,peer,state\n0.5,1,down\n1\xff,2,down\n", "line 3: not UTF-8 text"),
    (b"0.5,1,down\nnan,3,down\n", f"line 2: {NOT_A_TIME} ['nan', '3', 'down']"),
    (b"time,peer,state\ninf,3,down\n", f"line 2: {NOT_A_TIME} ['inf', '3', 'down']"),
    (b"time,peer,state\n\n1,x,down\n", "line 2: expected time,peer,state, got []"),
]


@pytest.mark.parametrize("content,reason", TRACES, ids=["utf8", "nan", "inf", "blank-line"])
def test_a_broken_churn_trace_is_refused_naming_its_line(tmp_path, capsys, content, reason):
    trace = tmp_path / "trace.csv"
    trace.write_bytes(content)
    expected = f"network.churn.trace: {trace} {reason}"
    run_line(tmp_path, capsys, expected, network={"churn": {"trace": "trace.csv"}})


# --- 3. an adversary that leaves no honest peer ---------------------------------------------
ALL_BAD = "makes all 4 data-holding peers attackers: no honest peer is left"
ADVERSARIES = [  # (algorithm, topology, adversary, key)
    ({"name": "fedavg", "rounds": 2}, {"kind": "star"}, {"fraction": 0.99}, "fraction"),
    ({"name": "dfedavgm", "rounds": 2}, {"kind": "ring"}, {"fraction": 0.9}, "fraction"),
    ({"name": "fedavg", "rounds": 2}, {"kind": "star"}, {"peers": [3, 2, 1, 0, 0]}, "peers"),
]


@pytest.mark.parametrize(
    "algorithm,topology,adversary,key", ADVERSARIES, ids=["star-0.99", "ring-0.9", "every-peer"]
)
def test_an_adversary_that_leaves_no_honest_peer_is_refused(
    tmp_path, capsys, algorithm, topology, adversary, key
):
    """Before: the whole run trained, then it exited 1 (or 0, with no honest accuracy)."""
    sections = {"algorithm": algorithm, "topology": topology}
    run_line(
        tmp_path, capsys, f"adversary.{key}: {ALL_BAD}",
        adversary=adversary | {"attack": "sign_flip"}, **sections,
    )  # fmt: skip


# --- 4. robust rules that the topology cannot feed -------------------------------------------
PATH_PLUS = {"kind": "edges", "edges": [[0, 1], [1, 2], [2, 3], [1, 3]]}  # peer 0: one neighbour
RULES = [  # (algorithm, topology, peers, the line after "algorithm.aggregator.")
    (
        {"name": "fedavg", "aggregator": {"name": "krum", "f": 10}}, {"kind": "star"}, 4,
        "f: krum with f=10 needs n >= 2f + 3 = 23 models; the server gets 4",
    ),
    (
        {"name": "fedavg", "participation": 0.5, "aggregator": {"name": "krum", "f": 0}},
        {"kind": "star"}, 4, "f: krum with f=0 needs n >= 2f + 3 = 3 models; the server gets 2",
    ),
    (
        {"name": "fedavg", "aggregator": {"name": "krum", "m": 5}}, {"kind": "star"}, 4,
        "m: multi-krum with m=5 needs n − f >= 5 models it can trust; the server gets 4",
    ),
    (
        {"name": "fedavg", "aggregator": {"name": "trimmed_mean", "b": 2}}, {"kind": "star"}, 4,
        "b: trimmed_mean with b=2 needs 2b + 1 = 5 models; the server gets 4",
    ),
    (
        {"name": "dfedavgm", "aggregator": {"name": "krum", "f": 1}}, {"kind": "ring"}, 5,
        "f: krum with f=1 needs n >= 2f + 3 = 5 models; "
        "peer 0 gets 3, peer 1 gets 3, peer 2 gets 3 (and 2 more)",
    ),
    (
        {"name": "dfedavgm", "aggregator": {"name": "krum", "f": 0}}, PATH_PLUS, 4,
        "f: krum with f=0 needs n >= 2f + 3 = 3 models; peer 0 gets 2",
    ),
    (
        {"name": "dfedsam", "aggregator": {"name": "trimmed_mean", "b": 2}}, {"kind": "ring"}, 4,
        "b: trimmed_mean with b=2 needs 2b + 1 = 5 models; "
        "peer 0 gets 3, peer 1 gets 3, peer 2 gets 3 (and 1 more)",
    ),
]  # fmt: skip
RULE_IDS = ["krum-f", "krum-participation", "multi-krum-m", "trimmed-b", "ring-krum",
            "one-leaf", "dfedsam-trimmed"]  # fmt: skip


@pytest.mark.parametrize("algorithm,topology,count,expected", RULES, ids=RULE_IDS)
def test_a_rule_the_topology_cannot_feed_is_refused_per_node(
    tmp_path, capsys, algorithm, topology, count, expected
):
    """Before: each ran silently, the rule's guarantee void at every round."""
    sections = {"algorithm": algorithm | {"rounds": 2}, "topology": topology}
    run_line(
        tmp_path, capsys, f"algorithm.aggregator.{expected}", peers={"count": count}, **sections
    )


def test_trimmed_mean_is_refused_only_where_no_node_can_trim():
    """b shrinks where fewer models arrive, by design: one leaf is no error, all are."""
    rule = parse_aggregator({"name": "trimmed_mean", "b": 1})
    rule.check_inputs({"peer 0": 2, "peer 1": 3})
    with pytest.raises(Exception, match="needs 2b"):
        rule.check_inputs({"peer 0": 2, "peer 1": 2})


# --- 5. p2pfl plot: metrics.csv (and the other tables) of the wrong width ---------------------
METRICS = b"time,round,peer,metric,value\n0.1,1,0,accuracy,0.5\n"
COMM = b"time,round,src,dst,kind,bytes,arrival\n"
TABLES = [  # (file, content, the reason after "FILE ")
    ("metrics.csv", METRICS + b"0.2,2,0,accuracy,0.6,7\n", "line 3: 6 fields; its header has 5"),
    ("metrics.csv", METRICS + b"0.2,2,0,accuracy,0.6,\n", "line 3: 6 fields; its header has 5"),
    ("metrics.csv", METRICS + b"0.2,2,0,accuracy\n", "line 3: 4 fields; its header has 5"),
    (
        "metrics.csv",
        METRICS + b"\n0.2,2,0,accuracy,x\n",
        "line 4: column 'value' is 'x', not a float",
    ),
    ("comm.csv", COMM + b"0,1,server,0,model,5,1,extra\n", "line 2: 8 fields; its header has 7"),
    (
        "availability.csv",
        b"peer,online_from,online_to\n0,0\n",
        "line 2: 2 fields; its header has 3",
    ),
]


@pytest.mark.parametrize(
    "name,content,reason", TABLES,
    ids=["extra", "trailing-comma", "missing", "not-a-number", "comm-extra", "availability"],
)  # fmt: skip
def test_plot_refuses_a_row_of_the_wrong_width_naming_its_line(
    tmp_path,
    capsys,
    finished,
    name,
    content,
    reason,
):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / name).write_bytes(content)
    out = tmp_path / "plots"
    line = refused(capsys, ["plot", str(run), "--out", str(out)], reason)
    assert line == f"error: {run / name} {reason}"
    assert not out.exists()
