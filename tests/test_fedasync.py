"""FedAsync (Xie, Koyejo, Gupta 2019, Algorithm 1) on a star of digits peers: §5's staleness
functions, every update mixed with α·s(t − τ) (replayed from what the server received), the
staleness of a slow peer, the cost plan against the ledger, determinism, bad keys, sockets."""

from __future__ import annotations

import csv
import json
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import BASE, experiment, finals, on_device, run_cli, run_experiment
from p2pfl.app import cost
from p2pfl.app.cli import main
from p2pfl.app.experiment import build
from p2pfl.learning.state import average_states
from p2pfl.methods.effects import Finish, Recv, Send
from p2pfl.methods.fedasync import FedAsync, Staleness

STAR = {"model": {"name": "mlp", "hidden": [16]}, "topology": {"kind": "star"}}


def recording(gen: Generator, log: list[tuple[Any, Any]]) -> Generator:
    """``gen`` as it runs, each effect it yields logged with what it got back."""
    value = None
    while True:
        try:
            eff = gen.send(value)
        except StopIteration:
            return
        value = yield eff
        log.append((eff, value))


def record_server(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[tuple[Any, Any]]:
    """Every effect of ``cls``'s server in the runs that follow, with its result."""
    log: list[tuple[Any, Any]] = []
    server = cls.server
    monkeypatch.setattr(cls, "server", lambda self, ctx: recording(server(self, ctx), log))
    return log


def ledger(out: Path) -> list[dict[str, str]]:
    """comm.csv's rows in order of arrival."""
    with (out / "comm.csv").open() as f:
        return sorted(csv.DictReader(f), key=lambda r: float(r["arrival"]))


def staleness_rows(out: Path) -> list[tuple[int, int]]:
    """(round, value) of every ``staleness`` row of metrics.csv, in order."""
    with (out / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["metric"] == "staleness"]
    return [(int(r["round"]), int(float(r["value"]))) for r in rows]


def test_staleness_functions_take_section_5s_values():
    assert [Staleness()(lag) for lag in (1, 5, 50)] == [1.0, 1.0, 1.0]
    poly = Staleness("polynomial")  # a = 0.5: (t − τ + 1)^(−1/2)
    assert poly.a == 0.5
    assert poly(1) == pytest.approx(2**-0.5, rel=1e-15)
    assert poly(3) == 0.5
    assert Staleness("polynomial", a=1)(4) == 0.2
    hinge = Staleness("hinge")  # a = 10, b = 4
    assert (hinge.a, hinge.b) == (10, 4)
    assert [hinge(lag) for lag in (1, 4)] == [1.0, 1.0]
    assert hinge(5) == pytest.approx(1 / 11, rel=1e-15)  # 1 / (10·(5 − 4) + 1)
    assert hinge(7) == pytest.approx(1 / 31, rel=1e-15)
    assert Staleness("hinge", a=0.5, b=0)(2) == 0.5


def test_alpha_one_with_constant_staleness_makes_the_server_model_the_last_arrived(
    tmp_path, monkeypatch
):
    """x_R = (1 − 1)·x_{R−1} + 1·x_new: bit for bit the model that made version R."""
    rounds, n = 7, 3
    sections = STAR | {
        "peers": {"count": n},
        "algorithm": {"name": "fedasync", "rounds": rounds, "alpha": 1.0},
    }
    summary, models = finals(monkeypatch, tmp_path, **sections)
    server = build(experiment(**sections)).topology.hub
    ups = [r for r in ledger(tmp_path) if r["dst"] == "server" and r["kind"] == "model"]
    assert len(ups) == n + rounds - 1
    last = int(ups[rounds - 1]["src"])  # the update that made version R
    for k, v in models[server].items():
        assert torch.equal(v, models[last][k]), k
    for p in (p for p in range(n) if p != last):  # the others ended elsewhere
        assert not all(torch.equal(v, models[p][k]) for k, v in models[server].items())
    assert summary["status"] == "ok"


def hinge(lag: int, a: float, b: float) -> float:
    return 1.0 if lag <= b else 1.0 / (a * (lag - b) + 1.0)


def test_every_update_is_mixed_with_alpha_times_s_of_its_staleness(tmp_path, monkeypatch):
    """Replayed from the pairs (x_new, τ) the server received, in order: each version it
    sent is x_t = (1 − α_t)·x_{t−1} + α_t·x_new with α_t = α·s(t − τ), stamped t."""
    log = record_server(monkeypatch, FedAsync)
    alpha, a, b, rounds = 0.7, 2.0, 3, 30
    algorithm = {
        "name": "fedasync", "rounds": rounds, "alpha": alpha,
        "staleness": {"name": "hinge", "a": a, "b": b},
    }  # fmt: skip
    peers = {"count": 4, "slow_fraction": 0.25, "slow_factor": 0.2, "flops_per_s": 1e7}
    run_experiment(tmp_path, **STAR, peers=peers, algorithm=algorithm)
    sends = [eff for eff, _ in log if isinstance(eff, Send)]
    x, t, lags, checked = sends[0].tensors, 0, [], 0
    for eff, value in log:
        if isinstance(eff, Recv) and t < rounds:
            (msg,) = value
            t += 1
            lags.append(t - msg.round)
            alpha_t = alpha * hinge(t - msg.round, a, b)
            x = average_states([x, msg.tensors], [1 - alpha_t, alpha_t])
        elif isinstance(eff, Send) and eff.kind == "model" and t > 0:
            assert eff.round == t
            assert all(torch.equal(v, x[k]) for k, v in eff.tensors.items())
            checked += 1
        elif isinstance(eff, Finish):
            assert eff.output and all(torch.equal(v, x[k]) for k, v in eff.state.items())
    assert checked == rounds - 1 and t == rounds
    assert min(lags) == 1 and max(lags) > b  # both branches of the hinge were taken
    assert staleness_rows(tmp_path) == list(enumerate(lags, 1))


def test_the_slow_peers_updates_carry_the_larger_staleness_and_runs_repeat(tmp_path):
    """Six peers, one of them 10x slower: the server's logged t − τ of each update is its
    version t minus the round its model carried (comm.csv), and every update of the slow
    peer is staler than any other's after the first sweep. Two runs: the same bytes."""
    peers = {"count": 6, "slow_fraction": 1 / 6, "slow_factor": 0.1, "flops_per_s": 1e7}
    sections = STAR | {"peers": peers, "algorithm": {"name": "fedasync", "rounds": 80}}
    slow = min(range(6), key=lambda p: build(experiment(**sections)).population.profiles[p].speed)
    run_experiment(tmp_path / "a", **sections)
    run_experiment(tmp_path / "b", **sections)
    ups = [r for r in ledger(tmp_path / "a") if r["dst"] == "server" and r["kind"] == "model"]
    logged = staleness_rows(tmp_path / "a")
    assert logged == [(t, t - int(r["round"])) for t, r in enumerate(ups[:80], 1)]
    by_peer: dict[int, list[int]] = {}
    for (t, lag), r in zip(logged, ups, strict=False):
        if t > 6:  # the first sweep: 1, 2, ..., 5 for everyone but the slow peer
            by_peer.setdefault(int(r["src"]), []).append(lag)
    fast = [lag for p, lags in by_peer.items() if p != slow for lag in lags]
    assert by_peer[slow] and min(by_peer[slow]) > 5 * max(fast)
    for name in ("comm.csv", "metrics.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    clock = ("wall_time_s", "compute_wall_s")
    assert {k: v for k, v in a.items() if k not in clock} == {
        k: v for k, v in b.items() if k not in clock
    }


def test_cost_plan_is_the_ledger_with_equal_speeds_and_its_totals_always(tmp_path):
    """Equal speeds and data sizes: every message of the plan is in comm.csv (round, ends,
    kind, bytes). A slow peer and skewed data: the same totals, another split."""
    for name, extra in (
        ("equal", {"peers": {"count": 4}}),
        ("skewed", {
            "peers": {"count": 4, "slow_fraction": 0.25, "flops_per_s": 1e7},
            "partition": {"name": "dirichlet", "alpha": 0.3},
        }),
    ):  # fmt: skip
        sections = STAR | extra | {"algorithm": {"name": "fedasync", "rounds": 9}}
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
        assert row["messages"] == 2 * (4 + 9 - 1) + 4
        server = [r for r in rows if r["src"] == "server"]
        assert row["server_up"] == sum(int(r["bytes"]) for r in server)
        assert (analytic == measured) == (name == "equal")


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"alpha": 0}, "algorithm.alpha: must be in (0, 1], got 0"),
        ({"alpha": 1.5}, "algorithm.alpha: must be in (0, 1]"),
        ({"rounds": 0}, "algorithm.rounds: must be >= 1"),
        ({"rho": -1}, "algorithm.rho: must be >= 0"),
        ({"staleness": "linear"}, "algorithm.staleness.name: unknown staleness function 'linear'"),
        ({"staleness": {"name": "polynomial", "b": 2}}, "algorithm.staleness.b: polynomial takes"),
        ({"staleness": {"name": "constant", "a": 2}}, "algorithm.staleness.a: constant takes no"),
        ({"staleness": {"name": "hinge", "b": -1}}, "algorithm.staleness.b: must be >= 0"),
        ({"staleness": {"name": "hinge", "c": 1}}, "algorithm.staleness.c: unknown key"),
    ],
)
def test_bad_keys_are_one_error_line_and_exit_2_before_anything_is_written(
    tmp_path, capsys, algorithm, message
):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(BASE | {"algorithm": {"name": "fedasync", **algorithm}}))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err
    assert not out.exists()


STRAGGLER = {
    "partition": {"name": "dirichlet", "alpha": 0.5},
    "model": {"name": "mlp", "hidden": [64]},
    "peers": {"count": 16, "flops_per_s": 3e8, "slow_fraction": 0.0625, "slow_factor": 0.1},
}
"""Digits on a star of 16 peers, one of them 10x slower (docs/asynchrony.md section 6)."""


def test_with_a_straggler_it_beats_fedavg_at_equal_simulated_time(tmp_path):
    """320 updates (as many trainings as FedAvg's 20 rounds) take 0.75 s; FedAvg's rounds
    wait for the straggler, and the 6 that fit in that time end 18 points lower (measured:
    0.786 against 0.603; chance is 0.1)."""
    algorithm = {"name": "fedasync", "rounds": 320, "staleness": "polynomial"}
    fedasync = run_experiment(tmp_path / "fedasync", **STRAGGLER, algorithm=algorithm)
    fedavg = run_experiment(
        tmp_path / "fedavg", **STRAGGLER, algorithm={"name": "fedavg", "rounds": 6}
    )
    assert fedavg["sim_time_s"] < fedasync["sim_time_s"]
    assert fedasync["final"]["accuracy"] > fedavg["final"]["accuracy"] + 0.1
    assert fedasync["final"]["accuracy"] > 0.75


def test_over_sockets_it_ends_with_every_worker_told(tmp_path):
    """Three worker processes and the server over ZeroMQ: no hang, every message in comm.csv
    (N + R − 1 models each way and N stops), R staleness rows."""
    n, rounds = 3, 6
    config = on_device(BASE | {"transport": {"timeout_s": 120.0}} | STAR) | {
        "peers": {"count": n, "slow_fraction": 1 / 3},
        "algorithm": {"name": "fedasync", "rounds": rounds, "staleness": "hinge"},
    }
    out = tmp_path / "zmq"
    proc = run_cli(tmp_path / "exp.yaml", config, out, "--quiet", "--transport", "zmq")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["transport"]) == ("ok", "zmq")
    rows = ledger(out)
    kinds = [(r["src"] == "server", r["kind"]) for r in rows]
    assert kinds.count((True, "model")) == kinds.count((False, "model")) == n + rounds - 1
    assert kinds.count((True, "control")) == n
    assert [t for t, _ in staleness_rows(out)] == list(range(1, rounds + 1))
