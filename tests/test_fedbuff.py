"""FedBuff (Nguyen et al., AISTATS 2022, Algorithm 1) on a star of digits peers: the first
step against FedAvg's round, every step replayed from the updates the server received
(buffer, staleness scaling, concurrency), a slow peer's staleness, the cost plan against
the ledger, determinism, bad keys, sockets."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from test_fedasync import STAR, STRAGGLER, ledger, record_server, staleness_rows

from conftest import BASE, experiment, finals, on_device, run_cli, run_experiment
from p2pfl.app import cost
from p2pfl.app.cli import main
from p2pfl.app.experiment import build
from p2pfl.methods.effects import Finish, Recv, Send
from p2pfl.methods.fedbuff import FedBuff

FULL_BATCH = {"epochs": 1, "batch_size": 1000, "lr": 0.5}
"""One gradient step on a peer's whole data: the same model whatever the batch order."""


def test_with_k_clients_the_first_step_is_fedavgs_uniform_round(tmp_path, monkeypatch):
    """K = N: the first step applies the N updates from x_0, x_0 + η_g·mean(y_i − x_0): with
    η_g = 1, FedAvg's uniform round (to float rounding); with η_g = 0.5, half way there.
    It is no more than that: the first N − 1 clients to return train on x_0 again, so the
    second step is not FedAvg's second round."""
    sections = STAR | {"peers": {"count": 3}, "train": FULL_BATCH}
    x0 = build(experiment(**sections)).contexts()[0].init_state()
    fedavg = {"name": "fedavg", "weighting": "uniform"}
    runs = {
        name: finals(monkeypatch, tmp_path / name, **sections, algorithm=algorithm)[1][3]
        for name, algorithm in {
            "avg1": fedavg | {"rounds": 1},
            "avg2": fedavg | {"rounds": 2},
            "buff1": {"name": "fedbuff", "rounds": 1, "buffer_size": 3},
            "half": {"name": "fedbuff", "rounds": 1, "buffer_size": 3, "server_lr": 0.5},
            "buff2": {"name": "fedbuff", "rounds": 2, "buffer_size": 3},
        }.items()
    }
    for k, v in x0.items():
        moved = runs["avg1"][k] - v
        assert moved.abs().max() > 1e-3
        assert torch.allclose(runs["buff1"][k], runs["avg1"][k], rtol=0, atol=1e-6)
        assert torch.allclose(runs["half"][k], v + 0.5 * moved, rtol=0, atol=1e-6)
    assert any(not torch.allclose(runs["buff2"][k], runs["avg2"][k], rtol=0, atol=1e-4) for k in x0)


def test_every_step_is_the_scaled_mean_of_k_buffered_updates(tmp_path, monkeypatch):
    """Replayed from the updates the server received, in order: every K of them make
    x ← x + η_g·(1/K)·Σ Δ_i/√(1 + t − τ_i) (summed in float64), each model sent carries the
    version t and goes to a client that is not training, at most C train at once, and the
    traffic is R·K + C − 1 models each way and N stops."""
    log = record_server(monkeypatch, FedBuff)
    n, rounds, k, lr, c = 5, 6, 3, 0.7, 3
    algorithm = {
        "name": "fedbuff", "rounds": rounds, "buffer_size": k, "server_lr": lr,
        "staleness_scaling": True, "concurrency": c,
    }  # fmt: skip
    peers = {"count": n, "slow_fraction": 0.2, "slow_factor": 0.2, "flops_per_s": 1e7}
    run_experiment(tmp_path, **STAR, peers=peers, algorithm=algorithm)
    sends = [eff for eff, _ in log if isinstance(eff, Send)]
    x, t, buffer, lags = sends[0].tensors, 0, [], []
    training = {s.dst for s in sends[:c]}
    assert len(training) == c
    for eff, value in log[c:]:
        if isinstance(eff, Recv):
            (msg,) = value
            training.remove(msg.src)
            if t < rounds:
                lags.append(t - msg.round)
                buffer.append((msg.tensors, 1 / math.sqrt(1 + t - msg.round)))
            if len(buffer) == k:
                step = {}
                for name, v in x.items():
                    acc = v.to(torch.float64, copy=True)
                    for delta, s in buffer:
                        acc.add_(delta[name], alpha=lr * s / k)
                    step[name] = acc.to(v.dtype)
                x, t, buffer = step, t + 1, []
        elif isinstance(eff, Send) and eff.kind == "model":
            assert eff.round == t and eff.dst not in training
            assert all(torch.equal(v, x[name]) for name, v in eff.tensors.items())
            training.add(eff.dst)
            assert len(training) <= c
        elif isinstance(eff, Finish):
            assert eff.output and all(torch.equal(v, x[name]) for name, v in eff.state.items())
    assert t == rounds and max(lags) >= 2
    assert staleness_rows(tmp_path) == [(i // k, lag) for i, lag in enumerate(lags)]  # t: i // k
    rows = ledger(tmp_path)
    down = [r for r in rows if r["src"] == "server"]
    assert sum(r["kind"] == "model" for r in down) == rounds * k + c - 1
    assert sum(r["kind"] == "model" for r in rows if r["dst"] == "server") == rounds * k + c - 1
    assert sorted(r["dst"] for r in down if r["kind"] == "control") == [str(p) for p in range(n)]


def test_the_slow_peers_updates_are_the_stalest_and_runs_repeat(tmp_path):
    """Six clients, one 10x slower, K = 3: the slow client's updates arrive many steps
    after its download, everyone else's within two. Two runs: the same bytes."""
    peers = {"count": 6, "slow_fraction": 1 / 6, "slow_factor": 0.1, "flops_per_s": 1e7}
    algorithm = {"name": "fedbuff", "rounds": 30, "buffer_size": 3}
    sections = STAR | {"peers": peers, "algorithm": algorithm}
    slow = min(range(6), key=lambda p: build(experiment(**sections)).population.profiles[p].speed)
    run_experiment(tmp_path / "a", **sections)
    run_experiment(tmp_path / "b", **sections)
    ups = [r for r in ledger(tmp_path / "a") if r["dst"] == "server" and r["kind"] == "model"]
    logged = staleness_rows(tmp_path / "a")
    assert len(logged) == 90
    pairs = list(zip(logged, ups[:90], strict=True))
    assert [lag for (_, lag), _ in pairs] == [t - int(r["round"]) for (t, _), r in pairs]
    by_peer: dict[int, list[int]] = {}
    for (_, lag), r in pairs:
        by_peer.setdefault(int(r["src"]), []).append(lag)
    fast = [lag for p, lags in by_peer.items() if p != slow for lag in lags]
    assert max(fast) <= 2 and min(by_peer[slow][1:]) >= 5 * max(fast)
    for name in ("comm.csv", "metrics.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    clock = ("wall_time_s", "compute_wall_s")
    assert {k: v for k, v in a.items() if k not in clock} == {
        k: v for k, v in b.items() if k not in clock
    }


@pytest.mark.parametrize("concurrency", [None, 2])
def test_cost_plan_is_the_ledger_with_equal_speeds_and_its_totals_always(tmp_path, concurrency):
    """Equal speeds and data sizes: every message of the plan is in comm.csv (round, ends,
    kind, bytes), the seeded draws of idle clients included. A slow peer and skewed data:
    the same totals, another split."""
    algorithm = {"name": "fedbuff", "rounds": 4, "buffer_size": 3, "concurrency": concurrency}
    for name, extra in (
        ("equal", {"peers": {"count": 4}}),
        ("skewed", {
            "peers": {"count": 4, "slow_fraction": 0.25, "flops_per_s": 1e7},
            "partition": {"name": "dirichlet", "alpha": 0.3},
        }),
    ):  # fmt: skip
        sections = STAR | extra | {"algorithm": algorithm}
        summary = run_experiment(tmp_path / name, **sections)
        setup = build(experiment(**sections))
        plan = cost.transfers(setup.method, cost.make_plan(setup, setup.topology, None))
        named = setup.topology.name
        analytic = sorted((t.round, named(t.src), named(t.dst), t.kind, t.bytes) for t in plan)
        rows = ledger(tmp_path / name)
        measured = sorted(
            (int(r["round"]), r["src"], r["dst"], r["kind"], int(r["bytes"])) for r in rows
        )
        row = cost.summarize(plan, setup.topology)
        assert (row["messages"], row["total_bytes"]) == (len(rows), summary["comm"]["total_bytes"])
        assert row["messages"] == 2 * (4 * 3 + (concurrency or 4) - 1) + 4
        server = [r for r in rows if r["src"] == "server"]
        assert row["server_up"] == sum(int(r["bytes"]) for r in server)
        assert (analytic == measured) == (name == "equal")


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"buffer_size": 0}, "algorithm.buffer_size: must be >= 1, got 0"),
        ({"buffer_size": -3}, "algorithm.buffer_size: must be >= 1, got -3"),
        ({"server_lr": 0}, "algorithm.server_lr: must be > 0"),
        ({"rounds": 0}, "algorithm.rounds: must be >= 1"),
        ({"concurrency": 0}, "algorithm.concurrency: must be >= 1"),
        ({"concurrency": 5}, "algorithm.concurrency: must be <= the 4 peers, got 5"),
        ({"staleness_scaling": "yes"}, "algorithm.staleness_scaling:"),
        ({"buffer": 3}, "algorithm.buffer: unknown key"),
    ],
)
def test_bad_keys_are_one_error_line_and_exit_2_before_anything_is_written(
    tmp_path, capsys, algorithm, message
):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE | {"algorithm": {"name": "fedbuff", **algorithm}}))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err
    assert not out.exists()


def test_with_a_straggler_it_beats_fedavg_at_equal_simulated_time(tmp_path):
    """32 steps of K = 10 (as many trainings as FedAvg's 20 rounds) take 0.75 s; the 6
    FedAvg rounds that fit in that time, waiting for the straggler, end far lower
    (measured: 0.897 against 0.603; chance is 0.1)."""
    algorithm = {"name": "fedbuff", "rounds": 32, "buffer_size": 10}
    fedbuff = run_experiment(tmp_path / "fedbuff", **STRAGGLER, algorithm=algorithm)
    fedavg = run_experiment(
        tmp_path / "fedavg", **STRAGGLER, algorithm={"name": "fedavg", "rounds": 6}
    )
    assert fedavg["sim_time_s"] < fedbuff["sim_time_s"]
    assert fedbuff["final"]["accuracy"] > fedavg["final"]["accuracy"] + 0.2
    assert fedbuff["final"]["accuracy"] > 0.85


def test_over_sockets_it_ends_with_every_client_told(tmp_path):
    """Three client processes and the server over ZeroMQ, one client drawn slow: no hang,
    every message in comm.csv (R·K + N − 1 models each way and N stops), R·K staleness rows."""
    n, rounds, k = 3, 3, 2
    config = on_device(BASE | {"transport": {"timeout_s": 120.0}} | STAR) | {
        "peers": {"count": n, "slow_fraction": 1 / 3},
        "algorithm": {"name": "fedbuff", "rounds": rounds, "buffer_size": k},
    }
    out = tmp_path / "zmq"
    proc = run_cli(tmp_path / "exp.yaml", config, out, "--quiet", "--transport", "zmq")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["transport"]) == ("ok", "zmq")
    rows = ledger(out)
    kinds = [(r["src"] == "server", r["kind"]) for r in rows]
    assert kinds.count((True, "model")) == kinds.count((False, "model")) == rounds * k + n - 1
    assert kinds.count((True, "control")) == n
    assert len(staleness_rows(out)) == rounds * k
