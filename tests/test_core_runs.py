"""Whole runs on digits: ledger arithmetic, determinism, method identities, outputs."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from conftest import experiment, run_experiment
from p2pfl.app.experiment import build, run
from p2pfl.core.errors import RunError
from p2pfl.methods.base import Method, NodeContext
from p2pfl.methods.dfedavgm import metropolis_weights
from p2pfl.methods.effects import Behaviour, Recv
from p2pfl.network.message import Message
from p2pfl.network.topology import build_topology
from p2pfl.network.wire import encode


def model_message_bytes(config) -> int:
    """M: the serialized size of one model message for this experiment's model."""
    setup = build(config)
    state = setup.contexts()[0].init_state()
    return len(encode(Message("model", 0, 1, 1, state)))


def rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_fedavg_round_moves_two_k_models(tmp_path):
    sections = {
        "peers": {"count": 6},
        "algorithm": {"name": "fedavg", "rounds": 3, "participation": 0.5},
    }
    summary = run_experiment(tmp_path, **sections)
    m = model_message_bytes(experiment(**sections))
    k = 3
    model = summary["comm"]["by_kind"]["model"]
    assert model["messages"] == 3 * 2 * k
    assert model["bytes"] == 3 * 2 * k * m
    per_round = {}
    for row in rows(tmp_path / "comm.csv"):
        if row["kind"] == "model":
            per_round[row["round"]] = per_round.get(row["round"], 0) + int(row["bytes"])
    assert per_round == {"1": 2 * k * m, "2": 2 * k * m, "3": 2 * k * m}


@pytest.mark.parametrize("cycles", [1, 2])
def test_fedseq_ring_moves_n_minus_one_models_per_cycle(tmp_path, cycles):
    sections = {
        "topology": {"kind": "ring"},
        "peers": {"count": 5},
        "algorithm": {"name": "fedseq", "cycles": cycles},
    }
    summary = run_experiment(tmp_path, **sections)
    m = model_message_bytes(experiment(**sections))
    assert summary["comm"]["messages"] == cycles * 5 - 1
    assert summary["comm"]["total_bytes"] == (cycles * 5 - 1) * m
    hops = [(r["src"], r["dst"]) for r in rows(tmp_path / "comm.csv")]
    assert hops[:4] == [("0", "1"), ("1", "2"), ("2", "3"), ("3", "4")]


def test_same_seed_same_outputs_different_seed_different_partition(tmp_path):
    sections = {"partition": {"name": "dirichlet", "alpha": 0.5}, "peers": {"count": 5}}
    a = run_experiment(tmp_path / "a", **sections)
    b = run_experiment(tmp_path / "b", **sections)
    c = run_experiment(tmp_path / "c", seed=1, **sections)
    for name in ("metrics.csv", "comm.csv", "partition.csv", "config.yaml"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    drop = ("wall_time_s", "compute_wall_s")
    assert {k: v for k, v in a.items() if k not in drop} == {
        k: v for k, v in b.items() if k not in drop
    }
    assert (tmp_path / "a/partition.csv").read_text() != (tmp_path / "c/partition.csv").read_text()
    assert a["final"] != c["final"]


def test_fedprox_with_mu_zero_is_fedavg_bit_for_bit(tmp_path):
    avg = run_experiment(tmp_path / "avg", algorithm={"name": "fedavg", "rounds": 2})
    prox = run_experiment(tmp_path / "prox", algorithm={"name": "fedprox", "rounds": 2, "mu": 0.0})
    assert (tmp_path / "avg/metrics.csv").read_text() == (tmp_path / "prox/metrics.csv").read_text()
    assert avg["final"] == prox["final"]
    strong = run_experiment(tmp_path / "s", algorithm={"name": "fedprox", "rounds": 2, "mu": 1.0})
    assert strong["final"] != avg["final"]


def test_dfedavgm_on_a_mesh_leaves_every_peer_with_the_same_model(tmp_path):
    summary = run_experiment(
        tmp_path,
        topology={"kind": "mesh"},
        peers={"count": 4},
        algorithm={"name": "dfedavgm", "rounds": 2},
        train={"epochs": 1, "lr": 0.05, "momentum": 0.9},
    )
    accs = {p["accuracy"] for p in summary["per_peer"]}
    assert len(accs) == 1 and summary["final"]["accuracy"] in accs
    assert summary["comm"]["by_kind"]["model"]["messages"] == 2 * 4 * 3


def test_a_figure_that_cannot_be_drawn_fails_the_run_after_it(tmp_path, monkeypatch, capfd):
    """partition.png is drawn by a forked child while the run goes on: the child's failure
    (here, a drawing function that raises, which the fork inherits) is the run's error,
    reported once the run's own outputs are written."""

    def broken(data, out):
        raise OSError("no room for the figure")

    monkeypatch.setattr("p2pfl.app.experiment.save_partition", broken)
    monkeypatch.setattr("p2pfl.app.experiment._in_process", lambda: False)  # as a command
    with pytest.raises(RunError, match=r"partition.png: drawing it failed \(exit status 1\)"):
        run_experiment(tmp_path, peers={"count": 3}, algorithm={"name": "fedavg", "rounds": 1})
    assert "no room for the figure" in capfd.readouterr().err  # the child's traceback
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok" and (tmp_path / "comm.csv").stat().st_size > 0
    assert not (tmp_path / "partition.png").exists()


@pytest.mark.parametrize("kind,n", [("ring", 6), ("mesh", 5), ("watts_strogatz", 10)])
def test_metropolis_weights_are_doubly_stochastic(kind, n):
    topo = build_topology({"kind": kind}, n, 0)
    w = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j, v in metropolis_weights(topo, i).items():
            w[i, j] = v
    assert torch.allclose(w, w.T)
    assert torch.allclose(w.sum(0), torch.ones(n, dtype=torch.float64))
    assert (w >= 0).all()
    if kind == "mesh":
        assert torch.allclose(w, torch.full((n, n), 1 / n, dtype=torch.float64))


def test_fedavg_learns_digits_and_writes_every_output(tmp_path):
    summary = run_experiment(
        tmp_path,
        peers={"count": 5},
        algorithm={"name": "fedavg", "rounds": 10},
        train={"epochs": 2, "lr": 0.05, "momentum": 0.9},
    )
    assert summary["status"] == "ok"
    assert summary["final"]["accuracy"] > 0.9
    assert len(summary["per_peer"]) == 5
    for name in ("config.yaml", "summary.json", "metrics.csv", "comm.csv"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = rows(tmp_path / "metrics.csv")
    server_acc = [
        float(r["value"]) for r in metrics if r["metric"] == "accuracy" and r["peer"] == "server"
    ]
    assert len(server_acc) == 10 and server_acc[-1] > server_acc[0]
    assert json.loads((tmp_path / "summary.json").read_text())["final"] == summary["final"]
    times = [float(r["time"]) for r in metrics]
    assert times == sorted(times) and times[-1] == pytest.approx(summary["sim_time_s"])


def test_slower_peers_and_links_take_more_simulated_time(tmp_path):
    fast = run_experiment(tmp_path / "f")
    slow = run_experiment(
        tmp_path / "s",
        peers={"count": 4, "speed": 0.1, "link": {"latency_s": 0.5, "bandwidth_bps": 1e6}},
    )
    assert slow["sim_time_s"] > 10 * fast["sim_time_s"]
    assert slow["final"] == fast["final"]  # the clock never changes what is computed


def test_label_skew_hurts_fedavg_on_digits(tmp_path):
    common = {
        "peers": {"count": 10},
        "algorithm": {"name": "fedavg", "rounds": 5},
        "train": {"epochs": 1, "lr": 0.05, "momentum": 0.9},
    }
    iid = run_experiment(tmp_path / "iid", **common)
    skew = run_experiment(tmp_path / "skew", partition={"name": "disjoint"}, **common)
    assert iid["final"]["accuracy"] > skew["final"]["accuracy"] + 0.05


class _Stuck(Method):
    """Every peer waits for a message nobody sends: the run deadlocks at once."""

    def total_rounds(self, num_peers: int) -> int:
        return 1

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        yield Recv(kinds=("model",), round=1)


def test_a_deadlock_names_its_time_once(tmp_path):
    setup = build(experiment(topology={"kind": "ring"}, algorithm={"name": "dfedavgm"}))
    setup.method = _Stuck()
    with pytest.raises(RunError) as e:
        run(setup, tmp_path)
    assert str(e.value).startswith("run failed: at t=0.000s: deadlock: 0 waits for 1 model")
    assert str(e.value).count("at t=") == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].count("at t=") == 1
