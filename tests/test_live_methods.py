"""Methods that live with a network that misbehaves (issue 15): gossip learning, AD-PSGD and
DFedAvgM's ``wait_s`` / ``mixing`` options, on the built-in digits data."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, experiment, run_experiment
from p2pfl.app.cli import main
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError

PEERS = {"count": 8}
DATA = {"partition": {"name": "dirichlet", "alpha": 0.5}, "peers": PEERS}
CHURN = {
    "churn": {"online": {"mean_s": 0.5}, "offline_fraction": 0.3},
    "crashes": {"at": {3: 0.3}},
    "links": {"loss": 0.1},
}
GOSSIP = {"name": "gossip", "rounds": 12, "period_s": 0.1}
ADPSGD = {"name": "adpsgd", "rounds": 12, "reply_timeout_s": 0.05}


def stripped(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("wall_time_s", "compute_wall_s")}


def fates(run: Path) -> set[str]:
    with open(run / "comm.csv") as f:
        return {r["fate"] for r in csv.DictReader(f)}


@pytest.mark.parametrize("algorithm", [GOSSIP, ADPSGD], ids=["gossip", "adpsgd"])
def test_asynchronous_methods_learn_and_replay(tmp_path, algorithm):
    ring = {"kind": "ring"}
    runs = [run_experiment(tmp_path / n, **DATA, topology=ring, algorithm=algorithm) for n in "ab"]
    assert stripped(runs[0]) == stripped(runs[1])
    assert runs[0]["final"]["accuracy"] > 0.5  # 10 classes: an untrained model scores ~0.1


@pytest.mark.parametrize("algorithm", [GOSSIP, ADPSGD], ids=["gossip", "adpsgd"])
def test_asynchronous_methods_live_through_churn_loss_and_a_crash(tmp_path, algorithm):
    ring = {"kind": "ring"}
    runs = [
        run_experiment(tmp_path / n, **DATA, topology=ring, algorithm=algorithm, network=CHURN)
        for n in "ab"
    ]
    assert runs[0]["status"] == "ok" and stripped(runs[0]) == stripped(runs[1])
    assert {"delivered", "lost"} <= fates(tmp_path / "a")
    assert runs[0]["per_peer"][3]["accuracy"] is None  # crashed
    assert runs[0]["final"]["accuracy"] > 0.3


def test_gossip_cost_is_one_model_per_peer_and_period(tmp_path):
    for kind in ("ring", "mesh"):
        summary = run_experiment(tmp_path / kind, **DATA, topology={"kind": kind}, algorithm=GOSSIP)
        assert summary["comm"]["messages"] == 12 * 8
        path = tmp_path / f"{kind}.yaml"
        path.write_text(
            (ROOT / "experiments/quickstart.yaml").read_text()
            .replace("topology: {file: topologies/star.yaml}", f"topology: {{kind: {kind}}}")
            .replace("{count: 10, profile: peers/uniform.yaml}", "{count: 8}")
            .replace("algorithm: {name: fedavg, rounds: 20, participation: 0.5}",
                     "algorithm: {name: gossip, rounds: 12, period_s: 0.1}")
            .replace("hidden: [64]", "hidden: [32]")
        )  # fmt: skip
        out = tmp_path / f"cost-{kind}"
        assert main(["cost", str(path), "--topologies", kind, "--out", str(out)]) == 0
        with open(out / "cost.csv") as f:
            (row,) = list(csv.DictReader(f))
        assert int(row["messages"]) == 12 * 8


@pytest.mark.parametrize("algorithm", [GOSSIP, ADPSGD], ids=["gossip", "adpsgd"])
def test_asynchronous_methods_refuse_a_star(algorithm):
    with pytest.raises(ConfigError, match="serverless"):
        build(experiment(algorithm=algorithm))


def test_adpsgd_needs_a_passive_neighbour_for_every_active_peer():
    edges = {"kind": "edges", "edges": [[0, 2], [2, 4], [4, 1], [1, 3]]}
    with pytest.raises(ConfigError, match="active .even. peer 0 has no passive"):
        build(experiment(algorithm=ADPSGD, topology=edges, peers={"count": 5}))


DFEDAVGM = {"name": "dfedavgm", "rounds": 3}


def test_dfedavgm_waiting_long_on_a_reliable_network_is_dfedavgm(tmp_path):
    ring = {"kind": "ring"}
    plain = run_experiment(tmp_path / "p", **DATA, topology=ring, algorithm=DFEDAVGM)
    waited = run_experiment(
        tmp_path / "w", **DATA, topology=ring, algorithm=DFEDAVGM | {"wait_s": 100.0}
    )
    assert stripped(plain) == stripped(waited) | {"sim_time_s": plain["sim_time_s"]}
    for name in ("metrics.csv", "comm.csv"):
        assert (tmp_path / "p" / name).read_bytes() == (tmp_path / "w" / name).read_bytes()


def test_uniform_mixing_is_metropolis_on_a_regular_graph(tmp_path):
    regular = {"kind": "random_regular", "d": 3}
    a = run_experiment(tmp_path / "m", **DATA, topology=regular, algorithm=DFEDAVGM)
    b = run_experiment(
        tmp_path / "u", **DATA, topology=regular, algorithm=DFEDAVGM | {"mixing": "uniform"}
    )
    assert stripped(a) == stripped(b)


def test_plain_dfedavgm_deadlocks_under_churn_and_the_waiting_one_completes(tmp_path):
    mesh = {"kind": "mesh"}
    with pytest.raises(Exception, match="deadlock"):
        run_experiment(tmp_path / "p", **DATA, topology=mesh, algorithm=DFEDAVGM, network=CHURN)
    summary = run_experiment(
        tmp_path / "w", **DATA, topology=mesh, algorithm={"name": "dfedavgm", "rounds": 8,
        "wait_s": 0.2}, network=CHURN,
    )  # fmt: skip
    assert summary["status"] == "ok" and summary["final"]["accuracy"] > 0.4


def test_epidemic_learning_sends_as_many_messages_as_the_static_regular_graph(tmp_path):
    """EL-Local (each peer sends to s random peers, redrawn every round) against a static
    s-regular graph: N·s models per round both."""
    algorithm = DFEDAVGM | {"mixing": "uniform"}
    static = run_experiment(
        tmp_path / "s", **DATA, topology={"kind": "random_regular", "d": 3}, algorithm=algorithm
    )
    redrawn = run_experiment(
        tmp_path / "r", **DATA, topology={"kind": "ring"}, algorithm=algorithm,
        network={"graph": {"every": "round", "kind": "s_out", "s": 3}},
    )  # fmt: skip
    assert static["comm"]["messages"] == redrawn["comm"]["messages"] == 3 * 8 * 3
    assert fates(tmp_path / "r") == {"delivered"}


FEDSEQ = {"name": "fedseq", "cycles": 2, "retry_s": 0.05}
MESH = {"kind": "mesh"}


def test_a_skipping_chain_on_a_reliable_network_is_fedseq(tmp_path):
    plain = run_experiment(tmp_path / "p", **DATA, topology=MESH, algorithm=FEDSEQ)
    skip = run_experiment(
        tmp_path / "s", **DATA, topology=MESH, algorithm=FEDSEQ | {"skip_offline": True}
    )
    assert stripped(plain) == stripped(skip)
    for name in ("metrics.csv", "comm.csv"):
        assert (tmp_path / "p" / name).read_bytes() == (tmp_path / "s" / name).read_bytes()


def test_a_skipping_chain_passes_over_offline_and_crashed_peers(tmp_path):
    """Peer 2 is offline from the start until long after the run; peer 4 has crashed: the
    chain goes 0 1 3 5 6 7 (and round again), their turns counted as taken."""
    trace = tmp_path / "trace.csv"
    trace.write_text("0,2,down\n100,2,up\n")
    net = {"churn": {"trace": str(trace)}, "crashes": {"at": {4: 0.0}}}
    algorithm = FEDSEQ | {"skip_offline": True}
    with pytest.raises(Exception, match="deadlock"):
        run_experiment(tmp_path / "p", **DATA, topology=MESH, algorithm=FEDSEQ, network=net)
    summary = run_experiment(
        tmp_path / "s", **DATA, topology=MESH, algorithm=algorithm, network=net
    )
    with open(tmp_path / "s/comm.csv") as f:
        hops = [(r["src"], r["dst"], r["round"], r["fate"]) for r in csv.DictReader(f)]
    chain = ["0", "1", "3", "5", "6", "7"] * 2
    assert [(s, d) for s, d, _, _ in hops] == list(zip(chain, chain[1:], strict=False))
    assert {f for *_, f in hops} == {"delivered"}
    assert [int(r) for _, _, r, _ in hops] == [1, 3, 5, 6, 7, 8, 9, 11, 13, 14, 15]
    assert [p["accuracy"] is None for p in summary["per_peer"]] == [i in (2, 4) for i in range(8)]
    assert summary["final"]["accuracy"] > 0.5


FEDFISHER = {"name": "fedfisher", "select": "final", "fisher": "diag"}


def test_a_one_shot_deadline_aggregates_those_that_reported(tmp_path):
    star, crash = {"kind": "star"}, {"crashes": {"at": {2: 0.0}}}
    plain = run_experiment(tmp_path / "p", **DATA, topology=star, algorithm=FEDFISHER)
    timed = FEDFISHER | {"deadline_s": 5.0}
    same = run_experiment(tmp_path / "t", **DATA, topology=star, algorithm=timed)
    assert stripped(plain) == stripped(same)  # everyone reports: the deadline changes nothing
    with pytest.raises(Exception, match="deadlock"):
        run_experiment(tmp_path / "c", **DATA, topology=star, algorithm=FEDFISHER, network=crash)
    summary = run_experiment(tmp_path / "d", **DATA, topology=star, algorithm=timed, network=crash)
    assert summary["status"] == "ok" and summary["sim_time_s"] >= 5.0
    with open(tmp_path / "d/comm.csv") as f:
        uploads = {r["src"] for r in csv.DictReader(f) if r["dst"] == "server"}
    assert uploads == {"0", "1", "3", "4", "5", "6", "7"}  # 2 crashed before it trained
    assert summary["per_peer"][2]["accuracy"] is None
    with pytest.raises(ConfigError, match="select: final"):
        build(experiment(**DATA, algorithm=timed | {"select": "val"}))


def test_ma_echo_with_a_deadline_merges_those_that_reported(tmp_path):
    star, crash = {"kind": "star"}, {"crashes": {"at": {5: 0.0}}}
    maecho = {"name": "maecho", "tau": 5, "ensemble": False}
    plain = run_experiment(tmp_path / "p", **DATA, topology=star, algorithm=maecho)
    timed = maecho | {"deadline_s": 5.0}
    assert stripped(plain) == stripped(run_experiment(tmp_path / "t", **DATA, topology=star,
                                                      algorithm=timed))  # fmt: skip
    summary = run_experiment(tmp_path / "d", **DATA, topology=star, algorithm=timed, network=crash)
    with open(tmp_path / "d/comm.csv") as f:
        uploads = {r["src"] for r in csv.DictReader(f) if r["dst"] == "server"}
    assert uploads == {"0", "1", "2", "3", "4", "6", "7"}
    assert summary["status"] == "ok" and summary["per_peer"][5]["accuracy"] is None
