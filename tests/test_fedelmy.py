"""FedELMY (Algs. 1–3 of the paper; docs/fedelmy.md) and the DFedSAM baseline, on the built-in
digits data."""

from __future__ import annotations

import csv
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import experiment, run_experiment
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError
from p2pfl.data.federated import PeerData
from p2pfl.learning.state import average_states
from p2pfl.learning.training import TrainConfig, Trainer
from p2pfl.methods.fedelmy import FedELMY, PoolRegularizer, distance, log_scale
from p2pfl.network.message import Message
from p2pfl.network.wire import encode
from p2pfl.runtime.sim import SimRuntime
from p2pfl.runtime.worker import Worker

CPU = torch.device("cpu")
TRAIN = {"epochs": 2, "batch_size": 32, "optimizer": "adam", "lr": 0.003, "select": "best_val"}
RING = {
    "partition": {"name": "dirichlet", "alpha": 0.5},
    "topology": {"kind": "ring"},
    "peers": {"count": 4},
    "train": TRAIN,
}


def fedelmy(**keys: Any) -> dict[str, Any]:
    return {"name": "fedelmy", "pool_size": 2, "warmup_epochs": 1} | keys


def model_message_bytes(config: dict[str, Any]) -> int:
    """M: the serialized size of one model message for this experiment's model."""
    state = build(config).contexts()[0].init_state()
    return len(encode(Message("model", 0, 1, 1, state)))


def rows(path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: a second intra-op thread only adds contention (10x slower when
    another process holds a core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def spy(monkeypatch):
    """Records every node's Finish and every Train (node, effect, result) of the next runs."""
    seen: dict[str, Any] = {"finals": {}, "trains": []}
    run, train = SimRuntime.run, Worker.train

    def spy_run(self, behaviours):
        seen["finals"] = run(self, behaviours)
        return seen["finals"]

    def spy_train(self, node, eff):
        result, seconds = train(self, node, eff)
        seen["trains"].append((node, eff, result))
        return result, seconds

    monkeypatch.setattr(SimRuntime, "run", spy_run)
    monkeypatch.setattr(Worker, "train", spy_train)
    return seen


def pools(seen: dict[str, Any]) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Each node's pool [m0, m1, ..., mS], rebuilt from the recorded trainings (one-shot
    chain): m0 is the warm-up result on node 0 and the previous node's forwarded model on
    the others."""
    out: dict[int, list] = {}
    for node, eff, result in seen["trains"]:
        if eff.tag == "warmup":
            out[node] = [result.state]
            continue
        if node not in out:
            out[node] = [seen["finals"][node - 1].state]
        out[node].append(result.state)
    return out


# --- pieces --------------------------------------------------------------------------------


def test_log_scale_matches_the_official_rule():
    assert log_scale(6.02, 45.0) == 100  # the paper's example: 45 -> 0.45
    assert log_scale(2.3, 1.0) == 10
    assert log_scale(2.3, 0.5) == 1
    assert log_scale(0.3, 2.0) == 100
    assert log_scale(2.3, 0.0) == 1
    assert log_scale(0.0, 5.0) == 1e9  # ce clamped at 1e-8, no crash
    assert log_scale(math.nan, 5.0) == 1 and log_scale(1.0, math.inf) == 1


def small_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(3, 5, generator=g), "bias": torch.randn(3, generator=g)}


def linear_at(state: dict[str, torch.Tensor]) -> nn.Linear:
    module = nn.Linear(5, 3)
    module.load_state_dict(state)
    return module


def test_l2sq_d1_by_centroid_equals_the_mean_over_anchors():
    anchors = [small_state(s) for s in range(4)]
    module = linear_at(small_state(9))
    reg = PoolRegularizer(anchors, anchors[0], 1.0, 0.0, "l2sq", "none")
    via_centroid = -reg(module, torch.tensor(1.0))
    (g_centroid,) = torch.autograd.grad(via_centroid, module.weight)
    theta = list(module.parameters())
    direct = sum(distance(theta, [a["weight"], a["bias"]], "l2sq") for a in anchors) / len(anchors)
    (g_direct,) = torch.autograd.grad(direct, module.weight)
    assert abs(via_centroid.item() - direct.item()) <= 1e-5 * direct.item()
    torch.testing.assert_close(g_centroid, g_direct, rtol=1e-5, atol=1e-6)


def test_distances_and_the_l2_gradient_at_the_anchor():
    a = [torch.tensor([3.0, 0.0]), torch.tensor([0.0])]
    b = [torch.tensor([0.0, 4.0]), torch.tensor([0.0])]
    assert distance(a, b, "l2sq").item() == 25
    assert distance(a, b, "l2").item() == pytest.approx(5)
    assert distance(a, b, "l1").item() == 7
    assert distance(a, b, "cosine").item() == pytest.approx(1)
    assert distance(a, [2 * t for t in a], "cosine").item() == pytest.approx(0, abs=1e-7)
    theta = [t.clone().requires_grad_() for t in a]
    (grad,) = torch.autograd.grad(distance(theta, a, "l2"), theta[0])
    assert torch.isfinite(grad).all()  # the 1e-12 under the root


def test_with_alpha_equal_beta_the_first_model_gets_no_regularisation():
    m0 = small_state(0)
    module = linear_at(small_state(1))
    reg = PoolRegularizer([m0, m0], m0, 0.7, 0.7, "l2sq", "d2")  # S = 1: anchors {m0, start}
    x, y = torch.randn(8, 5), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    ce = F.cross_entropy(module(x), y)
    value = reg(module, ce)
    grads = torch.autograd.grad(value, list(module.parameters()))
    ce_grads = torch.autograd.grad(ce, list(module.parameters()))
    assert reg.sums["d1"] == reg.sums["d2"] > 0
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    assert norm <= 1e-6 * torch.sqrt(sum(g.pow(2).sum() for g in ce_grads))
    reg(module, torch.tensor(0.0))  # a zero loss must not crash the scaling


def digits_peer(n: int = 60, n_val: int = 40) -> tuple[Trainer, PeerData]:
    setup = build(experiment())
    data = setup.data.peers[0]
    return setup.trainer, PeerData(
        data.train_x[:n], data.train_y[:n], data.val_x[:n_val], data.val_y[:n_val]
    )


def test_best_val_returns_the_earliest_epoch_with_the_best_validation_accuracy():
    trainer, data = digits_peer()
    init = trainer.init_state(0)
    cfg = TrainConfig(epochs=8, batch_size=16, lr=0.2)

    def train(epochs: int, select: str):
        gen = torch.Generator().manual_seed(3)
        c = cfg.with_overrides({"epochs": epochs, "select": select})
        return trainer.train(init, data, c, gen, CPU)

    per_epoch = [train(e, "last").state for e in range(1, 9)]
    accs = [trainer.evaluate(s, data.val_x, data.val_y, CPU)[0] for s in per_epoch]
    best = train(8, "best_val")
    first = accs.index(max(accs))
    assert accs.count(max(accs)) > 1 and first < 7  # a later tie and a worse last epoch
    assert best.val_accuracy == max(accs)
    assert same_state(best.state, per_epoch[first])


def test_sam_steps_from_w_with_the_gradient_at_the_ascent_point():
    trainer, data = digits_peer(n=48)
    init = trainer.init_state(0)
    cfg = TrainConfig(epochs=1, batch_size=64, optimizer="sam", lr=0.1, rho=0.05)
    out = trainer.train(init, data, cfg, torch.Generator().manual_seed(0), CPU)

    model = trainer.module(CPU)
    model.load_state_dict(init)
    params = list(model.parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(data.train_x), data.train_y), params)
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p.add_(0.05 * g / norm)
    grads = torch.autograd.grad(F.cross_entropy(model(data.train_x), data.train_y), params)
    for (name, _), g in zip(model.named_parameters(), grads, strict=True):
        torch.testing.assert_close(out.state[name], init[name] - 0.1 * g, rtol=0, atol=1e-6)
    assert out.train_samples == 2 * 48  # two passes per sample for the compute model


def test_sam_updates_batchnorm_statistics_once_per_step():
    setup = build(experiment(model={"name": "cnn_s"}))
    trainer, data = setup.trainer, setup.data.peers[0]
    init = trainer.init_state(0)

    def train(optimizer: str):
        cfg = TrainConfig(epochs=1, batch_size=512, optimizer=optimizer, momentum=0.9)
        gen = torch.Generator().manual_seed(0)
        return trainer.train(init, data, cfg, gen, CPU).state

    sam, sgd = train("sam"), train("sgd")
    buffers = [k for k in init if "running" in k or "num_batches" in k]
    assert buffers and all(torch.equal(sam[k], sgd[k]) for k in buffers)
    assert sam["conv1.norm.num_batches_tracked"].item() == 1
    assert not torch.equal(sam["out.weight"], sgd["out.weight"])


# --- whole runs ----------------------------------------------------------------------------


def test_one_shot_ring_of_ten_moves_n_minus_one_models(tmp_path):
    sections = RING | {"peers": {"count": 10}, "algorithm": fedelmy(pool_size=1)}
    sections["train"] = TRAIN | {"epochs": 1}
    summary = run_experiment(tmp_path, **sections)
    m = model_message_bytes(experiment(**sections))
    assert summary["comm"]["by_kind"] == {"model": {"messages": 9, "bytes": 9 * m}}
    assert summary["comm"]["total_bytes"] == (10 - 1) * m
    hops = [(int(r["src"]), int(r["dst"])) for r in rows(tmp_path / "comm.csv")]
    assert hops == [(i, i + 1) for i in range(9)]


def test_few_shot_moves_t_n_minus_one_models_and_keeps_its_prefix(tmp_path):
    one = run_experiment(tmp_path / "t1", **RING, algorithm=fedelmy())
    two = run_experiment(tmp_path / "t2", **RING, algorithm=fedelmy(cycles=2))
    assert one["comm"]["messages"] == 4 - 1 and two["comm"]["messages"] == 2 * 4 - 1
    hops = [(int(r["src"]), int(r["dst"])) for r in rows(tmp_path / "t2/comm.csv")]
    assert hops == [(0, 1), (1, 2), (2, 3), (3, 0), (0, 1), (1, 2), (2, 3)]

    def cycle_one(run: str) -> list[tuple[str, ...]]:
        return [
            (r["round"], r["peer"], r["metric"], r["value"])
            for r in rows(tmp_path / run / "metrics.csv")
            if r["peer"] != "final" and int(r["round"]) <= 4
        ]

    assert cycle_one("t1") == cycle_one("t2")  # cycle 1 does not depend on T
    last = [float(v) for rnd, peer, metric, v in cycle_one("t1") if metric == "accuracy"]
    assert one["final"]["accuracy"] == pytest.approx(last[-1], abs=1e-8)  # the last pool mean


def test_without_pool_the_output_is_the_warm_up_model_or_the_init(tmp_path, spy):
    run_experiment(tmp_path / "a", **RING, algorithm=fedelmy(pool_size=0, warmup_epochs=2))
    ((node, eff, warm),) = spy["trains"]  # clients 2..N train nothing
    assert node == 0 and eff.tag == "warmup" and eff.overrides == {"epochs": 2}
    assert same_state(spy["finals"][3].state, warm.state)

    run_experiment(tmp_path / "b", **RING, algorithm=fedelmy(pool_size=0, warmup_epochs=0))
    init = build(experiment(**RING, algorithm=fedelmy())).contexts()[0].init_state()
    assert same_state(spy["finals"][3].state, init)


def test_one_plain_model_sent_as_is_is_fedseq_bit_for_bit(tmp_path, spy):
    keys = {"pool_size": 1, "warmup_epochs": 0, "alpha": 0.0, "beta": 0.0, "send": "last"}
    elmy = run_experiment(tmp_path / "elmy", **RING, algorithm=fedelmy(**keys))
    elmy_final = spy["finals"][3].state
    seq = run_experiment(tmp_path / "seq", **RING, algorithm={"name": "fedseq"})
    assert same_state(elmy_final, spy["finals"][3].state)
    assert elmy["final"] == seq["final"] and elmy["per_peer"] == seq["per_peer"]


def test_pools_start_from_their_mean_and_forward_it_with_batchnorm_buffers(tmp_path, spy):
    sections = RING | {"peers": {"count": 3}, "model": {"name": "cnn_s"}}
    sections["train"] = TRAIN | {"epochs": 1}
    sections["algorithm"] = fedelmy(pool_size=3)
    summary = run_experiment(tmp_path, **sections)
    by_node = pools(spy)
    starts: dict[int, list] = {}
    for node, eff, _ in spy["trains"]:
        if eff.tag != "warmup":
            starts.setdefault(node, []).append(eff.state)
    for node, pool in by_node.items():
        assert len(pool) == 3 + 1
        for j, start in enumerate(starts[node], 1):
            mean = average_states(pool[:j])
            assert max((start[k].double() - mean[k].double()).abs().max() for k in mean) < 1e-6
        sent = spy["finals"][node].state
        assert same_state(sent, average_states(pool))  # BN buffers included
        assert any("running_mean" in k for k in sent)
    assert spy["finals"][2].output  # m_final = the mean of the last pool
    setup = build(experiment(**sections))  # the last model alone is reported as a baseline
    alone = setup.trainer.evaluate(by_node[2][-1], setup.data.test_x, setup.data.test_y, CPU)
    assert summary["baselines"] == {"last_model": alone[0]}


def test_pool_distances_are_saved_and_grow_with_alpha(tmp_path, spy):
    spreads = []
    for alpha in (0.0, 0.5, 1.0):
        out = tmp_path / f"alpha{alpha}"
        run_experiment(out, **RING, algorithm=fedelmy(pool_size=3, alpha=alpha, beta=1.0))
        matrix = torch.tensor(
            [[float(v) for v in r.values()][1:] for r in rows(out / "pool_distances.csv")],
            dtype=torch.float64,
        )
        assert (out / "pool_distances.png").is_file()
        last = pools(spy)[3]
        flat = torch.stack([torch.cat([s[k].flatten().double() for k in s]) for s in last])
        torch.testing.assert_close(matrix, torch.cdist(flat, flat))  # MLP: all are parameters
        off = matrix[~torch.eye(4, dtype=torch.bool)]
        assert (off > 0).all()
        spreads.append(off.mean().item())
        spy["trains"].clear()
    assert spreads[0] < spreads[1] < spreads[2]


def test_parallel_variant_leaves_every_peer_with_the_mean_of_the_pool_means(tmp_path, spy):
    sections = RING | {"topology": {"kind": "mesh"}, "algorithm": fedelmy(variant="parallel")}
    summary = run_experiment(tmp_path, **sections)
    m = model_message_bytes(experiment(**sections))
    assert summary["comm"]["by_kind"] == {"model": {"messages": 4 * 3, "bytes": 4 * 3 * m}}
    by_node: dict[int, list] = {}
    for node, _, result in spy["trains"]:
        by_node.setdefault(node, []).append(result.state)
    means = [average_states(by_node[n]) for n in range(4)]
    finals = [spy["finals"][n].state for n in range(4)]
    assert all(same_state(f, finals[0]) for f in finals)
    assert same_state(finals[0], average_states(means))
    assert (tmp_path / "pool_distances.csv").is_file()


def test_same_seed_same_run(tmp_path):
    for name in ("a", "b"):
        run_experiment(tmp_path / name, **RING, algorithm=fedelmy(dist="l2", scale_key="separate"))
    for name in ("metrics.csv", "comm.csv", "pool_distances.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("dist", ["l1", "cosine"])
def test_every_diversity_measure_trains_a_finite_pool(tmp_path, dist):
    sections = RING | {"peers": {"count": 2}}
    run_experiment(tmp_path, **sections, algorithm=fedelmy(dist=dist, scale_key="separate"))
    logged = {
        r["metric"]: float(r["value"]) for r in rows(tmp_path / "metrics.csv") if r["peer"] == "1"
    }
    assert logged["pool2_d1"] > 0 and logged["pool2_d2"] > 0
    assert logged["pool2_skipped_steps"] == 0 and math.isfinite(logged["loss"])


def test_bad_fedelmy_settings_are_config_errors():
    with pytest.raises(ConfigError, match="complete mesh"):
        build(experiment(**RING, algorithm=fedelmy(variant="parallel")))
    with pytest.raises(ConfigError, match="cycles"):
        FedELMY(variant="parallel", cycles=2)
    with pytest.raises(ConfigError, match="pool_size"):
        FedELMY(pool_size=-1)
    with pytest.warns(UserWarning, match="unbounded"):
        FedELMY(alpha=1.0, beta=0.0)


# --- baselines -----------------------------------------------------------------------------


def test_dfedsam_is_one_shot_dfedavgm_with_sam_local_steps(tmp_path, spy):
    sections = RING | {"topology": {"kind": "mesh"}}
    sections["train"] = TRAIN | {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
    rounds = {"rounds": 1}
    sam = run_experiment(tmp_path / "sam", **sections, algorithm={"name": "dfedsam"} | rounds)
    assert sam["comm"]["messages"] == 4 * 3
    assert [eff.overrides for _, eff, _ in spy["trains"]] == [{"optimizer": "sam"}] * 4
    sam_local = [result.state for _, _, result in spy["trains"]]
    spy["trains"].clear()
    run_experiment(tmp_path / "avg", **sections, algorithm={"name": "dfedavgm"} | rounds)
    local = [result.state for _, _, result in spy["trains"]]
    assert not any(same_state(a, b) for a, b in zip(sam_local, local, strict=True))
    # One-shot DFedAvgM on a mesh (FedELMY's App. A protocol): every peer holds the uniform
    # average.
    for n in range(4):
        torch.testing.assert_close(spy["finals"][n].state, average_states(local), rtol=0, atol=1e-6)
