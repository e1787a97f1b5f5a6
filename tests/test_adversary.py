"""Adversarial peers and robust aggregation (issue 18).

The rules checked against numpy and against planted data; the attacks through the real
wrapper and in real simulated runs on digits: identities (a neutral attack or rule equals the
honest run bit for bit), replay, orderings, byte counts and the one-line config errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from conftest import ROOT, experiment, run_experiment
from p2pfl.app import cost
from p2pfl.app.cli import main
from p2pfl.app.config import read_experiment, resolve
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError
from p2pfl.learning.robust import AGGREGATORS, Krum, parse_aggregator
from p2pfl.learning.state import State
from p2pfl.learning.training import TrainResult
from p2pfl.methods.attacks import ATTACKS, Adversary, attacked
from p2pfl.methods.attacks.alie import z_max
from p2pfl.methods.base import NodeContext
from p2pfl.methods.effects import Behaviour, Evaluate, Finish, Recv, Send, Train
from p2pfl.network.message import Message
from p2pfl.network.topology import build_topology

ROBUST = ["median", "trimmed_mean", "krum", "centered_clipping", "clipped_gossip"]


def random_state(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> State:
    return {
        "w": torch.randn(5, 3, generator=gen, dtype=dtype),
        "b": torch.randn(3, generator=gen, dtype=dtype),
        "count": torch.tensor(7),
    }


# --- the rules ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mean", *ROBUST])
@pytest.mark.parametrize("center_weight", [0.0, 0.4])
def test_every_rule_on_identical_models_returns_that_model(name, center_weight):
    model = random_state(torch.Generator().manual_seed(0))
    rule = parse_aggregator(name)
    copies = [{k: v.clone() for k, v in model.items()} for _ in range(5)]
    out = rule(model, copies, [0.1, 0.2, 0.1, 0.1, 0.1], center_weight)
    for k in model:
        assert torch.equal(out[k], model[k]), (name, k)


@pytest.mark.parametrize("name", ["mean", *ROBUST, {"name": "krum", "m": 2}])
def test_every_rule_takes_integer_buffers_from_the_center(name):
    """The uploads' batch counters (100, 100, 100, 7) say nothing the rules can check: the
    aggregate keeps the centre's (5), as documented (Krum returned its upload's whole)."""
    gen = torch.Generator().manual_seed(1)
    center = random_state(gen) | {"count": torch.tensor(5)}
    others = [random_state(gen) | {"count": torch.tensor(c)} for c in (100, 100, 100, 7)]
    out = parse_aggregator(name)(center, others, [0.25] * 4, 0.0)
    if name == "mean":  # the plain mean averages every tensor (FedAvg's contract)
        assert out["count"].item() == round((100 * 3 + 7) / 4)
    else:
        assert out["count"].item() == 5


@pytest.mark.parametrize("n", [1, 2, 5, 6, 9])
def test_median_and_trimmed_mean_equal_numpy(n):
    gen = torch.Generator().manual_seed(n)
    models = [random_state(gen, torch.float64) for _ in range(n)]
    center = random_state(gen, torch.float64)
    median = parse_aggregator("median")(center, models, [1.0] * n, 0.0)
    for b in (0, 1, 2):
        trimmed = parse_aggregator({"name": "trimmed_mean", "b": b})(center, models, [1.0] * n, 0.0)
        for k in ("w", "b"):
            stack = np.stack([m[k].numpy() for m in models])
            kept = np.sort(stack, axis=0)[min(b, (n - 1) // 2) : n - min(b, (n - 1) // 2)]
            np.testing.assert_allclose(trimmed[k].numpy(), kept.mean(axis=0), rtol=0, atol=1e-15)
    for k in ("w", "b"):
        stack = np.stack([m[k].numpy() for m in models])
        assert np.array_equal(median[k].numpy(), np.median(stack, axis=0))
    assert torch.equal(median["count"], center["count"])  # integer buffers: the center's


def test_median_with_the_center_included_is_over_the_peer_and_its_neighbours():
    gen = torch.Generator().manual_seed(3)
    own, a, b = (random_state(gen, torch.float64) for _ in range(3))
    out = parse_aggregator("median")(own, [a, b], [0.3, 0.3], 0.4)
    assert np.array_equal(out["w"].numpy(), np.median(np.stack([own["w"], a["w"], b["w"]]), axis=0))


def test_krum_picks_the_planted_honest_cluster():
    gen = torch.Generator().manual_seed(1)
    base = random_state(gen)
    honest = [{k: v + 0.01 * torch.randn(v.shape, generator=gen) if v.is_floating_point()
               else v for k, v in base.items()} for _ in range(7)]  # fmt: skip
    liars = [{k: v + 5.0 if v.is_floating_point() else v for k, v in base.items()}
             for _ in range(3)]  # fmt: skip
    models = liars[:2] + honest + liars[2:]  # attackers at indices 0, 1 and 9
    assert Krum(f=3).select(models)[0] in range(2, 9)
    assert set(Krum(f=3, m=5).select(models)) <= set(range(2, 9))
    assert set(Krum(m=7).select(models)) == set(range(2, 9))  # f null: ⌊(10 − 3)/2⌋ = 3
    out = parse_aggregator({"name": "krum", "f": 3, "m": 7})(base, models, [1.0] * 10, 0.0)
    expected = torch.stack([m["w"] for m in honest]).double().mean(0).float()
    assert torch.allclose(out["w"], expected, atol=1e-6)


def test_clipping_with_a_radius_nobody_reaches_is_the_mean():
    gen = torch.Generator().manual_seed(2)
    own, *others = (random_state(gen, torch.float64) for _ in range(4))
    weights = [0.2, 0.3, 0.1]
    mean = parse_aggregator("mean")(own, others, weights, 0.4)
    gossip = parse_aggregator({"name": "clipped_gossip", "tau": 1e9})(own, others, weights, 0.4)
    center = random_state(gen, torch.float64)
    star_mean = parse_aggregator("mean")(center, others, [1.0] * 3, 0.0)
    cc = parse_aggregator({"name": "centered_clipping", "tau": 1e9})(center, others, weights, 0.0)
    for k in ("w", "b"):
        assert torch.allclose(gossip[k], mean[k], atol=1e-12)
        assert torch.allclose(cc[k], star_mean[k], atol=1e-12)  # uniform, whatever the weights


def test_clipped_gossip_bounds_an_attackers_pull_by_the_honest_distance():
    """He et al.'s adaptive radius: the farthest neighbour is clipped to the second-farthest."""
    own = {"w": torch.zeros(4, dtype=torch.float64)}
    near = {"w": torch.tensor([1.0, 0, 0, 0], dtype=torch.float64)}
    liar = {"w": torch.tensor([0, 0, 0, 1000.0], dtype=torch.float64)}
    out = parse_aggregator("clipped_gossip")(own, [near, liar], [1 / 3, 1 / 3], 1 / 3)
    assert torch.allclose(out["w"], torch.tensor([1 / 3, 0, 0, 1 / 3], dtype=torch.float64))
    mean = parse_aggregator("mean")(own, [near, liar], [1 / 3, 1 / 3], 1 / 3)
    assert float(mean["w"][3]) > 300


def test_centered_clipping_iterations_move_towards_the_honest_majority():
    honest = [{"w": torch.tensor([1.0 + 0.01 * i, 0.0], dtype=torch.float64)} for i in range(7)]
    liars = [{"w": torch.tensor([-100.0, 50.0], dtype=torch.float64)} for _ in range(3)]
    center = {"w": torch.zeros(2, dtype=torch.float64)}
    one = parse_aggregator("centered_clipping")(center, honest + liars, [1.0] * 10, 0.0)
    three = parse_aggregator({"name": "centered_clipping", "iterations": 3})(
        center, honest + liars, [1.0] * 10, 0.0
    )
    target = torch.tensor([1.03, 0.0], dtype=torch.float64)
    assert (three["w"] - target).norm() < (one["w"] - target).norm() < 1.0


# --- the attacks, through the wrapper ------------------------------------------------------


def context(node: int, num_peers: int = 3, seed: int = 0) -> NodeContext:
    topology = build_topology({"kind": "ring"}, num_peers, 0)
    return NodeContext(node, topology, 10, seed, lambda: {}, frozenset({"w"}))


def drive(behaviour: Behaviour, answers: dict[type, Any]) -> list[Any]:
    """Run a behaviour, answering each effect by type; return every effect it yielded."""
    seen, value = [], None
    while True:
        try:
            eff = behaviour.send(value)
        except StopIteration:
            return seen
        seen.append(eff)
        value = answers.get(type(eff))


def honest_peer(start: State) -> Behaviour:
    """Train from ``start``, hear the neighbours, send, evaluate, finish."""
    result = yield Train(start, round=1)
    heard = yield Recv(count=2, round=1)
    assert len(heard) == 2
    yield Send(2, "model", 1, result.state | {"buf": torch.ones(1)})
    yield Send(2, "control", 1, {}, {"num_samples": 3})
    acc, _ = yield Evaluate(result.state, 1)
    yield Finish(result.state)


START = {"w": torch.tensor([1.0, 2.0])}
TRAINED = {"w": torch.tensor([1.5, 1.0])}
NEIGHBOUR = {"w": torch.tensor([2.0, 0.0])}


def attacked_sends(name: str, **options: Any) -> tuple[list[Any], Adversary]:
    adversary = Adversary((0, 2), ATTACKS.get(name)(**options))
    heard = [
        Message("model", 1, 0, 1, NEIGHBOUR),
        Message("model", 2, 0, 1, {"w": 9 + NEIGHBOUR["w"]}),
    ]
    answers = {Train: TrainResult(TRAINED, 0.5, 10, 0, 0.0), Recv: heard}
    return drive(attacked(honest_peer(START), adversary, context(0)), answers), adversary


def sent_model(effects: list[Any]) -> State:
    (send,) = [e for e in effects if isinstance(e, Send) and e.kind == "model"]
    assert torch.equal(send.tensors["buf"], torch.ones(1))  # buffers go as they are
    return send.tensors


def test_sign_flip_and_scale_send_the_reversed_and_boosted_update():
    flipped = sent_model(attacked_sends("sign_flip", scale=2.0)[0])
    assert torch.equal(flipped["w"], torch.tensor([0.0, 4.0]))  # 1 − 2·0.5, 2 − 2·(−1)
    boosted = sent_model(attacked_sends("scale", factor=3.0)[0])
    assert torch.equal(boosted["w"], torch.tensor([2.5, -1.0]))
    same = sent_model(attacked_sends("scale", factor=1.0)[0])
    assert torch.equal(same["w"], TRAINED["w"])  # factor 1 is the honest model, bit for bit


def test_the_wrapper_hides_the_attackers_model_and_passes_other_messages():
    effects, _ = attacked_sends("sign_flip")
    assert not any(isinstance(e, Evaluate) for e in effects)  # no metric rows for attackers
    assert [e.state for e in effects if isinstance(e, Finish)] == [None]
    (control,) = [e for e in effects if isinstance(e, Send) and e.kind == "control"]
    assert control.meta == {"num_samples": 3} and control.tensors == {}


def test_alie_and_ipm_use_the_honest_neighbours_they_heard_not_fellow_attackers():
    """Node 0 heard peer 1 (honest) and peer 2 (a fellow attacker, left out)."""
    z = 1.5
    alie = sent_model(attacked_sends("alie", z=z)[0])["w"].double()
    stack = torch.stack([TRAINED["w"], NEIGHBOUR["w"]]).double()
    assert torch.allclose(alie, stack.mean(0) - z * stack.std(0))
    ipm = sent_model(attacked_sends("ipm", epsilon=0.5)[0])["w"].double()
    mean_update = stack.mean(0) - START["w"].double()
    assert torch.allclose(ipm, START["w"].double() - 0.5 * mean_update)
    assert z_max(20, 4) == pytest.approx(0.1573, abs=1e-4)  # Baruch et al.'s z for n=20, m=4


def test_gaussian_noise_is_seeded_per_message():
    a = sent_model(attacked_sends("gaussian", std=0.1)[0])["w"]
    b = sent_model(attacked_sends("gaussian", std=0.1)[0])["w"]
    assert torch.equal(a, b) and not torch.equal(a, TRAINED["w"])
    assert float((a - TRAINED["w"]).abs().max()) < 1.0


def test_a_free_rider_skips_training_and_sends_what_came():
    effects, _ = attacked_sends("free_ride")
    assert not any(isinstance(e, Train) for e in effects)
    assert torch.equal(sent_model(effects)["w"], START["w"])


# --- real runs -----------------------------------------------------------------------------

RING = {"kind": "ring"}
FAST = {"epochs": 1, "batch_size": 32, "lr": 0.1}
STAR10 = {"peers": {"count": 10}, "algorithm": {"name": "fedavg", "rounds": 4}}


def stripped(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("wall_time_s", "compute_wall_s")}


def test_an_attacked_run_replays_bit_for_bit(tmp_path):
    sections = STAR10 | {
        "algorithm": {"name": "fedavg", "rounds": 3, "aggregator": "trimmed_mean"},
        "adversary": {"fraction": 0.3, "attack": {"name": "gaussian", "std": 0.5}},
    }
    a = run_experiment(tmp_path / "a", **sections)
    b = run_experiment(tmp_path / "b", **sections)
    assert stripped(a) == stripped(b)
    for name in ("comm.csv", "metrics.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert a["adversary"]["attack"] == "gaussian" and len(a["adversary"]["peers"]) == 3
    assert [p["accuracy"] is None for p in a["per_peer"]] == [
        p in a["adversary"]["peers"] for p in range(10)
    ]


def test_no_attackers_is_the_run_without_the_section(tmp_path):
    plain = run_experiment(tmp_path / "plain", **STAR10)
    none = run_experiment(
        tmp_path / "none", **STAR10, adversary={"fraction": 0.0, "attack": "sign_flip"}
    )
    assert stripped(plain) == stripped(none)
    assert (tmp_path / "plain/comm.csv").read_bytes() == (tmp_path / "none/comm.csv").read_bytes()


def test_a_neutral_attack_leaves_the_servers_model_bit_for_bit(tmp_path):
    plain = run_experiment(tmp_path / "plain", **STAR10)
    neutral = run_experiment(
        tmp_path / "neutral", **STAR10,
        adversary={"peers": [1, 4], "attack": {"name": "scale", "factor": 1.0}},
    )  # fmt: skip
    assert plain["final"] == neutral["final"]
    assert plain["comm"] == neutral["comm"]


def test_sign_flipping_breaks_the_mean_and_the_robust_rules_hold(tmp_path):
    """Digits, 10 peers, 3 attackers sending start − 4·Δ: the mean moves by (0.7 − 1.2)·Δ̄."""
    acc = {}
    for rule in ("mean", "median", "krum", "centered_clipping"):
        summary = run_experiment(
            tmp_path / rule, peers={"count": 10},
            algorithm={"name": "fedavg", "rounds": 10, "aggregator": rule}, train=FAST,
            adversary={"fraction": 0.3, "attack": {"name": "sign_flip", "scale": 4.0}},
        )  # fmt: skip
        acc[rule] = summary["final"]["accuracy"]
    clean = run_experiment(
        tmp_path / "clean", peers={"count": 10}, algorithm={"name": "fedavg", "rounds": 10},
        train=FAST,
    )["final"]["accuracy"]  # fmt: skip
    assert acc["mean"] < 0.2 < 0.8 < clean  # 0.10 and 0.825 when written
    for rule in ("median", "krum", "centered_clipping"):
        assert acc[rule] > 0.5, acc  # 0.73, 0.73, 0.57


def test_clipped_gossip_holds_on_a_ring_where_gossip_averaging_breaks(tmp_path):
    acc = {}
    for rule in ("mean", "clipped_gossip"):
        summary = run_experiment(
            tmp_path / rule, peers={"count": 10}, topology={"kind": "ring"},
            algorithm={"name": "dfedavgm", "rounds": 8, "aggregator": rule}, train=FAST,
            adversary={"peers": [0, 5], "attack": {"name": "sign_flip", "scale": 4.0}},
        )  # fmt: skip
        acc[rule] = summary["adversary"]["honest_accuracy"]
    assert acc["clipped_gossip"] > acc["mean"] + 0.2, acc  # 0.55 against 0.31 when written


def test_label_flipping_trains_the_attackers_on_flipped_labels():
    setup = build(experiment(peers={"count": 4}, adversary={"peers": [2], "attack": "label_flip"}))
    clean = build(experiment(peers={"count": 4}))
    assert torch.equal(setup.data.peers[2].train_y, 9 - clean.data.peers[2].train_y)
    assert torch.equal(setup.data.peers[2].train_x, clean.data.peers[2].train_x)
    assert torch.equal(setup.data.peers[1].train_y, clean.data.peers[1].train_y)


def test_a_robust_server_asks_for_no_sample_counts_and_cost_says_so(tmp_path):
    """The ledger and ``p2pfl cost`` agree on what each defence sends."""
    for rule, extra in (("mean", 4 * 10), ("median", 0)):
        algorithm = {"name": "fedavg", "rounds": 4, "aggregator": rule}
        summary = run_experiment(tmp_path / rule, peers={"count": 10}, algorithm=algorithm)
        setup = build(experiment(peers={"count": 10}, algorithm=algorithm))
        plan = cost.transfers(setup.method, cost.make_plan(setup, setup.topology, None))
        row = cost.summarize(plan, setup.topology)
        assert (row["messages"], row["total_bytes"]) == (
            summary["comm"]["messages"], summary["comm"]["total_bytes"]
        )  # fmt: skip
        assert summary["comm"]["by_kind"]["control"]["messages"] == 10 + extra


# --- the configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"fraction": 0.2, "peers": [1], "attack": "sign_flip"}, "adversary.peers: give fraction"),
        ({"fraction": 1.5, "attack": "sign_flip"}, "adversary.fraction: must be in [0, 1)"),
        ({"fraction": 0.2, "attack": "nope"}, "adversary.attack.name: unknown attack 'nope'"),
        ({"fraction": 0.2, "attack": {"name": "sign_flip", "scale": -1}}, "adversary.attack.scale"),
        ({"fraction": 0.2, "attack": {"name": "ipm", "eps": 1}}, "adversary.attack.eps: unknown"),
        ({"fraction": 0.2}, "adversary.attack: missing"),
        ({"peers": [4], "attack": "sign_flip"}, "adversary.peers: 4 is not a data-holding peer"),
    ],
)
def test_a_bad_adversary_section_is_one_line_before_anything_is_written(
    tmp_path, capsys, section, message
):
    config = {
        "name": "bad", "topology": {"kind": "star"}, "peers": {"count": 4},
        "algorithm": {"name": "fedavg", "rounds": 1}, "adversary": section,
    }  # fmt: skip
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(config))
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("nope", "algorithm.aggregator.name: unknown aggregator 'nope'"),
        ({"name": "krum", "m": 0}, "algorithm.aggregator.m: must be >= 1"),
        ({"name": "trimmed_mean", "beta": 1}, "algorithm.aggregator.beta: unknown key"),
        ({"b": 1}, "algorithm.aggregator.name: missing"),
    ],
)
def test_a_bad_aggregator_is_a_config_error(option, message):
    with pytest.raises(ConfigError) as info:
        build(experiment(algorithm={"name": "dfedavgm", "aggregator": option}, topology=RING))
    assert message in str(info.value)


def test_every_rule_and_attack_is_documented():
    text = (ROOT / "docs/adversaries.md").read_text()
    for name in AGGREGATORS.names() + ATTACKS.names():
        assert f"`{name}`" in text, name


@pytest.mark.parametrize("name", ["fedavg", "ring", "random_regular"])
def test_the_results_experiments_resolve(name):
    path = ROOT / "experiments" / f"adversary-{name}.yaml"
    raw = read_experiment(path)
    raw.pop("sweep")
    config = resolve(raw, path).config
    assert config["adversary"]["attack"] == {"name": "sign_flip", "scale": 4.0}


def test_the_plugin_examples_attack_and_rule_run_from_the_command_line(tmp_path):
    """examples/plugin/adversary.yaml: the ``stale`` attack against the ``near_mean`` rule."""
    cmd = [sys.executable, "-m", "p2pfl", "run", "adversary.yaml", "--out", str(tmp_path / "a")]
    done = subprocess.run(
        cmd + ["--quiet"], cwd=ROOT / "examples/plugin", capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "a/summary.json").read_text())
    assert summary["adversary"]["attack"] == "stale" and summary["adversary"]["peers"] == [2, 6]
    assert [p["accuracy"] is None for p in summary["per_peer"]] == [p in (2, 6) for p in range(9)]
    assert summary["final"]["accuracy"] > 0.5


def test_attacked_runs_in_two_processes_with_other_hash_seeds_agree(tmp_path):
    """What an attacker draws must not depend on Python's per-process string hashing."""
    config = {
        "name": "h", "topology": {"kind": "ring"}, "peers": {"count": 6},
        "algorithm": {"name": "dfedavgm", "rounds": 2, "aggregator": "trimmed_mean"},
        "adversary": {"peers": [1, 4], "attack": {"name": "gaussian", "std": 0.1}},
    }  # fmt: skip
    path = tmp_path / "h.yaml"
    path.write_text(json.dumps(config))
    for seed in ("1", "2"):
        out = tmp_path / seed
        cmd = [sys.executable, "-m", "p2pfl", "run", str(path), "--out", str(out), "--quiet"]
        env = os.environ | {"PYTHONHASHSEED": seed}
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
    for name in ("comm.csv", "metrics.csv"):
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes()


def test_a_model_attack_on_push_sum_is_refused_and_a_data_attack_runs(tmp_path):
    """Push-sum sends shares of x, not models: a model attack would corrupt the wrong
    quantity (sign_flip with no training moved the loss from 2.34 to 7.86), so it is one
    error naming the key; a data attack (label_flip) applies as on any method."""
    sections = {
        "topology": {"kind": "ring"},
        "peers": {"count": 4},
        "algorithm": {"name": "pushsum", "rounds": 2},
    }
    with pytest.raises(ConfigError, match="adversary.attack: pushsum sends shares"):
        build(experiment(**sections, adversary={"peers": [0], "attack": "sign_flip"}))
    flipped = run_experiment(tmp_path, **sections, adversary={"peers": [0], "attack": "label_flip"})
    assert flipped["status"] == "ok"
