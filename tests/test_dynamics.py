"""Networks that misbehave (issue 15): the ``network:`` section in simulated time.

Real runs on the built-in digits data through the real SimPy runtime, and the network model's
own draws checked against what they promise (long-run offline share, sessions, crashes,
partitions, redrawn graphs).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
import yaml

from conftest import BASE, ROOT, experiment, run_experiment
from p2pfl.app.cli import main
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError
from p2pfl.methods.base import METHODS, Method, NodeContext
from p2pfl.methods.effects import Behaviour, Finish, Log, Neighbours, Now, Recv, Send, Wait
from p2pfl.network.dynamics import Network, read_trace
from p2pfl.network.topology import build_topology

FEDAVG_DEADLINE = {"name": "fedavg", "rounds": 4, "participation": 0.5, "deadline_s": 1.0}
CHURN = {
    "churn": {"online": {"dist": "weibull", "mean_s": 1.0, "shape": 0.6}, "offline_fraction": 0.3},
    "crashes": {"at": {1: 1.5}},
    "links": {"loss": 0.3, "jitter": {"dist": "exponential", "mean_s": 0.01}},
}
NEUTRAL = {"churn": {"offline_fraction": 0.0}, "links": {"loss": 0.0}, "crashes": {"at": {}}}


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def stripped(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("wall_time_s", "compute_wall_s")}


def test_the_quickstart_is_byte_identical_to_before_the_network_model(tmp_path):
    """The quick-start's ledger is pinned (sha-256 of the comm.csv made before issue 15)."""
    out = tmp_path / "q"
    assert (
        main(["run", str(ROOT / "experiments/quickstart.yaml"), "--out", str(out), "--quiet"]) == 0
    )
    digest = hashlib.sha256((out / "comm.csv").read_bytes()).hexdigest()
    assert digest == "2bd44d65677416529b9931267856d0676df05d68f0de8b862b24b90aafeb06b5"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["comm"]["total_bytes"], summary["comm"]["messages"]) == (3910907, 310)
    assert round(summary["final"]["accuracy"], 4) == 0.9417
    assert not (out / "availability.csv").exists()


RING = {"kind": "ring"}
CASES = {
    "fedavg-star": {"algorithm": {"name": "fedavg", "rounds": 2}},
    "dfedavgm-mesh": {"topology": {"kind": "mesh"}, "algorithm": {"name": "dfedavgm", "rounds": 2}},
    "fedelmy-ring": {
        "topology": RING,
        "algorithm": {"name": "fedelmy", "pool_size": 2, "warmup_epochs": 1},
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_network_section_that_says_all_is_well_changes_nothing(tmp_path, case):
    plain = run_experiment(tmp_path / "plain", **CASES[case])
    neutral = run_experiment(tmp_path / "neutral", **CASES[case], network=NEUTRAL)
    assert stripped(plain) == stripped(neutral)
    for name in ("comm.csv", "metrics.csv"):
        assert (tmp_path / "plain" / name).read_bytes() == (
            tmp_path / "neutral" / name
        ).read_bytes()
    assert "fate" not in (tmp_path / "plain" / "comm.csv").read_text().splitlines()[0]


def test_same_seed_same_churn_losses_and_results(tmp_path):
    runs = [
        run_experiment(tmp_path / name, algorithm=FEDAVG_DEADLINE, network=CHURN, seed=seed)
        for name, seed in (("a", 3), ("b", 3), ("c", 4))
    ]
    assert stripped(runs[0]) == stripped(runs[1])
    for name in ("comm.csv", "metrics.csv", "availability.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a/availability.csv").read_bytes() != (
        tmp_path / "c/availability.csv"
    ).read_bytes()
    fates = {r["fate"] for r in rows(tmp_path / "a" / "comm.csv")}
    assert "delivered" in fates and "lost" in fates
    by_fate = runs[0]["comm"]["by_fate"]
    assert sum(v["messages"] for v in by_fate.values()) == runs[0]["comm"]["messages"]
    assert sum(v["bytes"] for v in by_fate.values()) == runs[0]["comm"]["total_bytes"]
    # the crashed peer has no final model, and stays offline from its crash on
    assert runs[0]["per_peer"][1]["accuracy"] is None
    assert all(
        float(r["online_to"]) <= 1.5
        for r in rows(tmp_path / "a/availability.csv")
        if r["peer"] == "1"
    )


def test_the_plain_method_deadlocks_under_churn_and_the_deadline_variant_completes(tmp_path):
    """The deadlock names what the network did not deliver to the waiting server and the way
    out; the deadline variant completes."""
    lossy = {"links": {"loss": 0.5}}
    told = r"deadlock: .*undelivered to the waiting, over the run: [1-9]\d* lost; give the alg"
    with pytest.raises(Exception, match=told):
        run_experiment(
            tmp_path / "plain", algorithm=FEDAVG_DEADLINE | {"deadline_s": None}, network=lossy
        )
    summary = run_experiment(tmp_path / "deadline", algorithm=FEDAVG_DEADLINE, network=lossy)
    assert summary["status"] == "ok"
    assert summary["comm"]["by_fate"]["lost"]["messages"] > 0


def test_every_message_lost_leaves_the_initial_model(tmp_path):
    """Loss 1: nothing is ever delivered, so the server keeps its initial model and every
    round logs the same accuracy."""
    summary = run_experiment(
        tmp_path / "x", algorithm=FEDAVG_DEADLINE, network={"links": {"loss": 1.0}}
    )
    assert set(summary["comm"]["by_fate"]) == {"lost"}
    accs = {r["value"] for r in rows(tmp_path / "x/metrics.csv") if r["metric"] == "accuracy"}
    assert len(accs) == 1


# A probe method: what the deadline, wait and neighbour-view effects return, logged as metrics.
@dataclass(kw_only=True, eq=False)
class Probe(Method):
    def total_rounds(self, num_peers: int) -> int:
        return 1

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        if ctx.node == 0:
            for j in ctx.neighbours:
                yield Send(j, "control", 1, {}, {"hello": 0})
        if ctx.node == 1:
            got = yield Recv(kinds=("control",), count=3, deadline=5.0)  # only 0 sends: 1 comes
            yield Log(1, "received", len(got))
            yield Log(1, "after_deadline", (yield Now()))
            yield Wait(until=7.0)
            yield Log(1, "after_wait", (yield Now()))
            yield Wait(until=1.0)  # in the past: returns at once
            yield Log(1, "after_past_wait", (yield Now()))
            yield Log(1, "reachable", len((yield Neighbours())))
        yield Finish(ctx.init_state())


@pytest.fixture
def probe():
    """The probe, registered for one test only (other tests iterate over every method)."""
    METHODS.register("probe_effects")(Probe)
    yield
    METHODS._items.pop("probe_effects")


def test_deadline_wait_now_and_the_neighbour_view(tmp_path, probe):
    net = {"crashes": {"at": {2: 0.0}}}  # peer 2 is gone from the start
    run_experiment(
        tmp_path / "p", topology={"kind": "mesh"}, algorithm={"name": "probe_effects"}, network=net
    )
    got = {
        r["metric"]: float(r["value"]) for r in rows(tmp_path / "p/metrics.csv") if r["peer"] == "1"
    }
    assert got == {
        "received": 1.0,
        "after_deadline": 5.0,
        "after_wait": 7.0,
        "after_past_wait": 7.0,
        "reachable": 2.0,  # peers 0 and 3 of 0, 2, 3
    }
    fates = {(r["dst"], r["fate"]) for r in rows(tmp_path / "p/comm.csv")}
    assert fates == {("1", "delivered"), ("2", "crashed"), ("3", "delivered")}


def network(options: dict[str, Any], n: int = 10, kind: str = "mesh", seed: int = 0) -> Network:
    return Network(options, build_topology({"kind": kind}, n, seed), seed)


@pytest.mark.parametrize("dist", ["exponential", "weibull", "lognormal"])
def test_sessions_reach_the_asked_offline_share(dist):
    net = network(
        {"churn": {"online": {"dist": dist, "mean_s": 2.0, "shape": 0.7}, "offline_fraction": 0.3}},
        n=40,
    )
    horizon = 2000.0
    online = sum(b - a for p in range(40) for a, b in net.availability(p, horizon))
    assert abs(1 - online / (40 * horizon) - 0.3) < 0.03
    for p in (0, 7):  # availability agrees with online() at arbitrary times
        spans = net.availability(p, 100.0)
        for t in (0.0, 3.3, 17.1, 55.5, 99.9):
            assert net.online(p, t) == any(a <= t < b for a, b in spans)
            assert net.online(p, net.next_online(p, t))


def test_crashes_are_seeded_and_final():
    net = network({"crashes": {"fraction": 0.3, "between_s": [5, 10], "at": {9: 2.0}}})
    again = network({"crashes": {"fraction": 0.3, "between_s": [5, 10], "at": {9: 2.0}}})
    assert net.crash_at == again.crash_at and len(net.crash_at) in (3, 4)
    assert net.crash_at[9] == 2.0
    assert all(5 <= t <= 10 for p, t in net.crash_at.items() if p != 9)
    assert net.online(9, 1.9) and not net.online(9, 2.0) and net.next_online(9, 3.0) == math.inf


def test_partitions_cut_only_between_groups_and_only_in_their_window():
    net = network({"links": {"partitions": [{"groups": [[0, 1], [2, 3]], "from_s": 5, "to_s": 8}]}})
    assert net.partitioned(0, 2, 5.0) and net.partitioned(3, 1, 7.9)
    assert not net.partitioned(0, 1, 6.0)  # same group
    assert not net.partitioned(0, 5, 6.0)  # 5 is in no group
    assert not net.partitioned(0, 2, 4.9) and not net.partitioned(0, 2, 8.0)
    assert net.neighbours(0, None, 6.0, False) == [1, 4, 5, 6, 7, 8, 9]


def test_a_graph_redrawn_every_round_is_seeded_and_differs_by_round():
    net = network({"graph": {"every": "round", "kind": "s_out", "s": 3}}, n=12)
    g1, g2 = net.graph(1, 0.0), net.graph(2, 0.0)
    assert all(g1.out_degree(i) == 3 for i in range(12)) and set(g1.edges) != set(g2.edges)
    assert set(g1.edges) == set(
        network({"graph": {"every": "round", "kind": "s_out", "s": 3}}, n=12).graph(1, 0.0).edges
    )
    assert net.neighbours(0, 1, 0.0, False) == sorted(g1.successors(0))
    assert net.neighbours(0, 1, 0.0, True) == sorted(g1.predecessors(0))
    timed = network(
        {"graph": {"schedule": [{"at_s": 0, "kind": "ring"}, {"at_s": 10, "kind": "mesh"}]}}
    )
    assert timed.graph(None, 9.9).number_of_edges() == 10
    assert timed.graph(None, 10.0).number_of_edges() == 45


def test_a_trace_drives_the_sessions(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("time,peer,state\n2,0,down\n5,0,up\n1,3,down\n")
    sections = {"churn": {"trace": str(trace)}}
    net = network(sections, n=4)
    assert net.online(0, 1.9) and not net.online(0, 2.0) and net.online(0, 5.0)
    assert net.next_online(0, 3.0) == 5.0
    assert not net.online(3, 100.0) and net.next_online(3, 100.0) == math.inf
    assert net.availability(0, 10.0) == [(0.0, 2.0), (5.0, 10.0)]
    assert set(read_trace(trace, 4)) == {0, 3}


def test_graph_files_in_three_formats_give_the_same_run(tmp_path):
    g = nx.random_regular_graph(3, 6, seed=1)
    nx.write_graphml(g, tmp_path / "g.graphml")
    nx.write_edgelist(g, tmp_path / "g.edgelist", data=False)
    nx.write_gml(g, tmp_path / "g.gml")
    sums = []
    for name in ("g.graphml", "g.edgelist", "g.gml"):
        topo = {"kind": "graph_file", "path": str(tmp_path / name)}
        sums.append(
            stripped(run_experiment(tmp_path / f"run-{name}", topology=topo, peers={"count": 6},
                                    algorithm={"name": "dfedavgm", "rounds": 1}))
        )  # fmt: skip
        built = build(experiment(topology=topo, peers={"count": 6}, algorithm={"name": "dfedavgm"}))
        assert {tuple(sorted(e)) for e in built.topology.graph.edges} == {
            tuple(sorted((int(u), int(v)))) for u, v in g.edges
        }
    assert sums[0] == sums[1] == sums[2]


BAD: list[tuple[dict[str, Any], str]] = [
    ({"churn": {"online": {"mean_s": -1}, "offline_fraction": 0.1}}, "network.churn.online.mean_s"),
    ({"churn": {"offline_fraction": 1.0}}, "network.churn.offline_fraction"),
    (
        {"churn": {"online": {"dist": "pareto"}, "offline_fraction": 0.1}},
        "network.churn.online.dist",
    ),
    ({"churn": {"online": {"mean_s": 5}}}, "network.churn.offline"),
    ({"churn": {"offline_fraction": 0.2, "peers": [0, 99]}}, "network.churn.peers.1"),
    ({"churn": {"trace": "nope.csv"}}, "network.churn.trace"),
    ({"crashes": {"at": {7: 1.0}}}, "network.crashes.at.7"),
    ({"crashes": {"at": {1: -3}}}, "network.crashes.at.1"),
    ({"crashes": {"fraction": 2}}, "network.crashes.fraction"),
    ({"links": {"loss": -0.1}}, "network.links.loss"),
    ({"links": {"jitter": {"mean_s": 0}}}, "network.links.jitter.mean_s"),
    (
        {"links": {"per_link": [{"between": [0, 9], "loss": 0.5}]}},
        "network.links.per_link.0.between",
    ),
    (
        {"links": {"partitions": [{"groups": [[0, 1], [1, 2]]}]}},
        "network.links.partitions.0.groups",
    ),
    (
        {"links": {"partitions": [{"groups": [[0], [1]], "from_s": 5, "to_s": 2}]}},
        "network.links.partitions.0.to_s",
    ),
    ({"graph": {"every": "round"}}, "network.graph.kind"),
    ({"graph": {"every": -2, "kind": "ring"}}, "network.graph.every"),
    ({"graph": {"every": "round", "kind": "s_out", "s": 9}}, "network.graph.s"),
    ({"graph": {"schedule": [{"at_s": 3, "kind": "ring"}]}}, "network.graph.schedule"),
    ({"graph": {"schedule": [{"at_s": 0, "kind": "cube"}]}}, "network.graph.schedule.0.kind"),
    ({"lag": 1}, "network.lag"),
]


@pytest.mark.parametrize("changes,key", BAD, ids=[k for _, k in BAD])
def test_a_bad_network_value_is_one_error_line_before_anything_is_written(
    tmp_path, capsys, changes, key
):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE | {"network": changes}))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: {key}: "), lines
    assert not out.exists()


def test_a_trace_naming_an_unknown_peer_is_refused(tmp_path, capsys):
    (tmp_path / "trace.csv").write_text("0.5,2,down\n1.0,12,down\n")
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE | {"network": {"churn": {"trace": "trace.csv"}}}))
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"network.churn.trace: {tmp_path / 'trace.csv'} line 2: unknown peer 12" in err
    assert not (tmp_path / "out").exists()


def test_the_real_command_writes_fates_and_availability(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE | {"algorithm": FEDAVG_DEADLINE, "network": CHURN}))
    done = subprocess.run(
        [sys.executable, "-m", "p2pfl", "run", str(path), "--out", str(tmp_path / "o"), "--quiet"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    header = (tmp_path / "o/comm.csv").read_text().splitlines()[0]
    assert header == "time,round,src,dst,kind,bytes,arrival,fate"
    assert rows(tmp_path / "o/availability.csv")[0].keys() == {"peer", "online_from", "online_to"}
    assert yaml.safe_load((tmp_path / "o/config.yaml").read_text())["network"] == CHURN


def test_a_directed_graph_cannot_be_the_base_topology():
    with pytest.raises(ConfigError, match="directed"):
        build_topology({"kind": "s_out"}, 5, 0)


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "gossip", "rounds": 4},
        {"name": "adpsgd", "rounds": 4},
        {"name": "fedseq", "skip_offline": True},
    ],
)
def test_methods_without_a_round_barrier_send_on_the_graph_of_their_round(tmp_path, algorithm):
    """With a directed graph redrawn every round, gossip, AD-PSGD and FedSeq's chain ask
    for the neighbours of the round their message carries (AD-PSGD: a partner that can
    answer it): no message goes on an edge that is not there (they sent 16 of 24, 8 of 25
    and the chain's first hop on the static graph's edges, and FedSeq's chain ended there)."""
    summary = run_experiment(
        tmp_path,
        topology={"kind": "mesh" if algorithm["name"] == "fedseq" else "ring"},
        peers={"count": 6},
        algorithm=algorithm,
        network={"graph": {"every": "round", "kind": "s_out", "s": 2}},
    )
    assert summary["status"] == "ok"
    assert set(summary["comm"]["by_fate"]) == {"delivered"}
    if algorithm["name"] == "fedseq":  # the chain went on past its first hop (to 4 peers;
        # the 2 others it skipped: not among the out-neighbours when their turn came)
        assert summary["comm"]["messages"] == 3
        assert sum(p["accuracy"] is not None for p in summary["per_peer"]) == 4


@pytest.mark.parametrize(
    "online",
    [
        {"dist": "weibull", "mean_s": 60.0, "shape": 0.6},
        {"dist": "lognormal", "mean_s": 60.0, "sigma": 1.5},
        {"dist": "uniform", "mean_s": 60.0},
        {"dist": "constant", "mean_s": 10.0},
    ],
)
def test_churn_starts_in_its_stationary_state(online):
    """The first session is what is left of one under way, so the offline share is the
    asked one from t = 0, not only in the long run (heavy-tailed Weibull sessions had 39%
    offline at t = 5 s for 25% asked; constant ones all switched at once)."""
    peers = 2000
    topology = build_topology({"kind": "ring"}, peers, 0)
    net = Network({"churn": {"online": online, "offline_fraction": 0.25}}, topology, 0)
    for t in (0.0, 5.0, 10.0, 30.0, 300.0):
        offline = sum(not net.online(p, t) for p in range(peers)) / peers
        assert abs(offline - 0.25) < 0.035, (t, offline)
