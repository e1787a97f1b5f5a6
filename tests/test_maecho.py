"""MA-Echo (§5 and Algorithm 1 of the paper; docs/maecho.md): projector algebra, aggregation
identities, the QP, the upload accounting, the output ensemble, and whole runs on digits in
both placements."""

from __future__ import annotations

import csv
import itertools

import numpy as np
import pytest
import torch
from torch import nn

from conftest import experiment, run_experiment
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError
from p2pfl.data.federated import PeerData
from p2pfl.learning.ensemble import ensemble_logits, score_ensemble
from p2pfl.learning.models import build_model
from p2pfl.learning.state import state_bytes
from p2pfl.methods.maecho import (
    Contribution,
    Statistics,
    aggregate,
    class_weights,
    echo,
    feature_rows,
    local_statistics,
    owm_update,
    pack,
    qp_weights,
    unpack,
)
from p2pfl.network.message import Message
from p2pfl.network.wire import encode
from p2pfl.runtime.sim import SimRuntime

F64 = torch.float64
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: a second thread only adds overhead, and on a loaded 2-core
    machine OpenMP threads thrash (this file took 218 s with 2 threads, 16 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def recursive_projector(rows: torch.Tensor, damping: float, ridge: float) -> torch.Tensor:
    """P = I − Q after the recursion over ``rows``."""
    q = torch.eye(rows.shape[1], dtype=F64)
    owm_update(q, rows, damping, ridge)
    return torch.eye(rows.shape[1], dtype=F64) - q


def soft_projector(d: int, n: int, seed: int) -> torch.Tensor:
    rows = torch.randn(n, d, dtype=F64, generator=torch.Generator().manual_seed(seed))
    return recursive_projector(rows, 0.5, 0.01**0.8)


def mlp_state(seed: int, hidden: list[int], bias: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = build_model({"name": "mlp", "hidden": hidden, "bias": bias}, (1, 4, 4), 5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def contribution(seed: int, state=None, labels=(0, 1, 2, 3, 4)) -> Contribution:
    """A contribution for the 16-8-6-5 MLP: given or seeded weights, soft random projectors
    (one input wider when the model has biases)."""
    state = state if state is not None else mlp_state(seed, [8, 6])
    extra = "fc1.layer.bias" in state
    projectors = {
        "fc1.layer": soft_projector(16 + extra, 6, seed),
        "fc2.layer": soft_projector(8 + extra, 4, seed + 100),
    }
    mask = torch.zeros(5, dtype=torch.bool)
    mask[list(labels)] = True
    return Contribution(state, Statistics(projectors, "out", mask))


# --- projector algebra (§7.1-7.3) ----------------------------------------------------------


def test_damped_projector_is_symmetric_with_eigenvalues_in_zero_one() -> None:
    rows = torch.randn(20, 50, dtype=F64, generator=torch.Generator().manual_seed(0))
    p = recursive_projector(rows, 0.5, 0.01**0.8)
    assert (p - p.T).abs().max() < 1e-10
    eig = torch.linalg.eigvalsh(p)
    assert eig.min() > -1e-8 and eig.max() < 1.0
    assert p.trace() <= 20
    # soft: a direction seen once is only half projected, one seen many times nearly fully
    once = recursive_projector(rows[:1], 0.5, 1e-12)
    u = rows[0] / rows[0].norm()
    assert u @ once @ u == pytest.approx(0.5, abs=1e-9)
    many = recursive_projector(rows[:1].repeat(30, 1), 0.5, 1e-12)
    assert u @ many @ u > 0.999


def test_undamped_recursion_equals_the_closed_form() -> None:
    z = 0.01**0.8
    rows = torch.randn(20, 50, dtype=F64, generator=torch.Generator().manual_seed(1))
    closed = rows.T @ torch.linalg.solve(rows @ rows.T + z * torch.eye(20, dtype=F64), rows)
    p = recursive_projector(rows, 1.0, z)
    assert (p - closed).norm() / closed.norm() < 1e-10


def test_null_space_projector_removes_the_feature_span() -> None:
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(20, 50, dtype=F64, generator=gen)
    q = torch.eye(50, dtype=F64) - recursive_projector(rows, 1.0, 1e-10)
    delta = torch.randn(7, 50, dtype=F64, generator=gen)
    assert (delta @ q @ rows.T).norm() / (delta @ rows.T).norm() < 1e-8


def test_statistics_use_batch_mean_rows_with_a_bias_column() -> None:
    torch.manual_seed(0)
    model = build_model({"name": "mlp", "hidden": [6]}, (1, 2, 2), 3)
    x = torch.randn(10, 1, 2, 2)
    y = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 0, 2])
    stats = local_statistics(
        model, PeerData(x, y, x[:0], y[:0]), CPU,
        seed=3, batch_size=4, damping=0.5, ridge=0.01**0.8, ridge_conv=1e-4,
    )  # fmt: skip
    assert list(stats.projectors) == ["fc1.layer"] and stats.classifier == "out"
    assert stats.labels.tolist() == [True, True, False]  # class 2 has a single sample
    order = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    means = [x[order[i : i + 4]].reshape(-1, 4).double().mean(0) for i in (0, 4, 8)]
    rows = torch.stack([torch.cat([m, torch.ones(1, dtype=F64)]) for m in means])
    assert torch.equal(stats.projectors["fc1.layer"], recursive_projector(rows, 0.5, 0.01**0.8))


def test_conv_rows_are_stride_two_patches_of_the_batch_mean_map() -> None:
    conv = nn.Conv2d(2, 3, 3, bias=False)
    mean_map = torch.arange(2 * 7 * 7, dtype=F64).reshape(2, 7, 7)
    rows = feature_rows(conv, mean_map)
    assert rows.shape == (9, 18)  # 3x3 positions ((7-3)//2+1), C_in*k*k columns
    assert torch.equal(rows[4], mean_map[:, 2:5, 2:5].flatten())  # position (1, 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 6 * 6, 3))
    x, y = torch.randn(8, 1, 8, 8), torch.tensor([0, 1] * 4)
    stats = local_statistics(
        model, PeerData(x, y, x[:0], y[:0]), CPU,
        seed=0, batch_size=8, damping=0.5, ridge=0.01**0.8, ridge_conv=1e-4,
    )  # fmt: skip
    rows = feature_rows(model[0], x.double().mean(0))
    assert rows.shape == (9, 10)  # with the bias column
    assert torch.equal(stats.projectors["0"], recursive_projector(rows, 0.5, 1e-4))


def reference_echo(ws, ps, *, tau, eta, norm=False, qp_c=None, output="W"):
    """§2.4 transcribed literally with dense matrices (the check on echo's eigenbasis form)."""
    w, vs = ws.mean(0), ws.clone()
    alpha = torch.full((len(ws), 1, 1), 1 / len(ws), dtype=F64)
    for _ in range(tau):
        diffs = (w - vs) @ ps
        if qp_c is not None:
            alpha = qp_weights(diffs, qp_c).view(-1, 1, 1)
        w = w - eta * (alpha * diffs).sum(0)
        delta = (w - vs) - (w - vs) @ ps
        if norm:
            delta = delta / delta.norm(dim=2, keepdim=True).clamp_min(1e-12)
        vs = vs + eta * delta
    return w if output == "W" else vs.mean(0)


@pytest.mark.parametrize(
    "options", [{}, {"norm": True}, {"output": "mean_V"}, {"qp_c": 0.5}, {"eta": 0.7}]
)
def test_eigenbasis_iteration_equals_the_dense_recipe(options) -> None:
    """Low-rank (5 and 12 rows) and full-rank (60 rows) projectors on d = 24."""
    ps = torch.stack([soft_projector(24, rows, rows) for rows in (5, 12, 60)])
    ws = torch.randn(3, 7, 24, dtype=F64, generator=torch.Generator().manual_seed(8))
    kwargs = {"tau": 25, "eta": 1.6} | options
    ref = reference_echo(ws, ps, **kwargs)
    assert (echo(ws, ps, **kwargs) - ref).abs().max() < 1e-9 * ref.abs().max()


# --- aggregation identities (§7.4-7.6) -------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"norm": True}, {"qp_c": 0.5}, {"output": "mean_V"}])
def test_identical_models_come_back_unchanged(options) -> None:
    state = mlp_state(0, [8, 6], bias=True)
    contribs = [contribution(s, state, labels) for s, labels in enumerate([(0, 1), (2,), (3, 4)])]
    many = aggregate(contribs, tau=20, eta=1.6, **options)
    one = aggregate(contribs[:1], tau=20, eta=1.6, **options)
    for out in (many, one):
        assert out.keys() == state.keys()
        assert all(torch.equal(out[k], state[k]) for k in state)


def test_zero_projectors_give_class_aware_fedavg_and_identity_keeps_the_mean() -> None:
    contribs = [contribution(s, labels=labels) for s, labels in enumerate([(0, 1), (1, 2), (4,)])]
    zero = [
        Contribution(
            c.state,
            Statistics({k: 0 * p for k, p in c.stats.projectors.items()}, "out", c.stats.labels),
        )
        for c in contribs
    ]
    fedavg_ca = aggregate(contribs, tau=0, eta=1.6)
    out = aggregate(zero, tau=30, eta=1.6)
    assert all(torch.equal(out[k], fedavg_ca[k]) for k in out)
    # class-aware classifier: class 0 from peer 0 only, class 1 the mean of peers 0 and 1,
    # class 3 (owned by nobody) the mean of all
    w = [c.state["out.weight"].double() for c in contribs]
    assert torch.equal(out["out.weight"][0], w[0][0].float())
    assert torch.allclose(out["out.weight"][1].double(), (w[0][1] + w[1][1]) / 2, atol=1e-7)
    assert torch.allclose(
        out["out.weight"][3].double(), (w[0][3] + w[1][3] + w[2][3]) / 3, atol=1e-7
    )
    ws = torch.stack([c.state["fc1.layer.weight"].double() for c in contribs])
    eye = torch.eye(16, dtype=F64).expand(3, 16, 16)
    for output in ("W", "mean_V"):  # no null space: the V_i stay, W stays at their mean
        assert torch.allclose(echo(ws, eye, tau=10, eta=1.6, output=output), ws.mean(0), atol=1e-12)


def test_aggregation_matches_each_peer_on_its_own_feature_span() -> None:
    """Peers whose (non-negative, ReLU-like) features live on disjoint coordinates: after
    τ = 60, W's outputs on each peer's features are within 5 % of that peer's own model's,
    where plain averaging is off by 100 % of the reference gap (the point of the method)."""
    gen = torch.Generator().manual_seed(4)
    feats = []
    for i in range(3):
        f = torch.zeros(4, 16, dtype=F64)
        f[:, 5 * i : 5 * i + 5] = torch.rand(4, 5, dtype=F64, generator=gen)
        feats.append(f)
    ps = torch.stack([recursive_projector(f.repeat(20, 1), 0.5, 0.01**0.8) for f in feats])
    ws = torch.randn(3, 8, 16, dtype=F64, generator=gen)
    w = echo(ws, ps, tau=60, eta=1.6)
    for f, wi in zip(feats, ws, strict=True):
        assert ((w - wi) @ f.T).norm() < 0.05 * ((ws.mean(0) - wi) @ f.T).norm()


@pytest.mark.parametrize("qp_c", [None, 0.6])
def test_permuting_peers_does_not_change_the_result(qp_c) -> None:
    contribs = [
        contribution(s, labels=labels) for s, labels in enumerate([(0, 1), (1, 2), (3,), (4, 0)])
    ]
    ws = torch.stack([c.state["fc1.layer.weight"].double() for c in contribs])
    ps = torch.stack([c.stats.projectors["fc1.layer"] for c in contribs])
    ref = aggregate(contribs, tau=15, eta=1.6, qp_c=qp_c)
    w_ref = echo(ws, ps, tau=15, eta=1.6, qp_c=qp_c)
    for perm in ([3, 1, 0, 2], [2, 3, 1, 0]):
        w = echo(ws[perm], ps[perm], tau=15, eta=1.6, qp_c=qp_c)
        assert (w - w_ref).abs().max() < 1e-10
        out = aggregate([contribs[i] for i in perm], tau=15, eta=1.6, qp_c=qp_c)
        assert all(torch.allclose(out[k], ref[k], atol=1e-6, rtol=0) for k in ref)


# --- QP weights (§7.7) -----------------------------------------------------------------------


def test_qp_weights_meet_their_constraints_and_beat_uniform() -> None:
    gen = torch.Generator().manual_seed(5)
    diffs = torch.randn(5, 4, 6, dtype=F64, generator=gen) + torch.arange(5.0, dtype=F64).view(
        5, 1, 1
    )
    for c in (0.3, 0.5, 1.0):
        alpha = qp_weights(diffs, c)
        assert alpha.min() >= 0 and alpha.max() <= c and abs(float(alpha.sum()) - 1) < 1e-6
        objective = lambda a: float(((a.view(-1, 1, 1) * diffs).sum(0) ** 2).sum())  # noqa: E731
        assert objective(alpha) <= objective(torch.full((5,), 0.2, dtype=F64)) + 1e-9
    assert torch.equal(qp_weights(diffs, 0.2), torch.full((5,), 0.2, dtype=F64))  # C = 1/N
    assert torch.equal(qp_weights(diffs, 0.1), torch.full((5,), 0.2, dtype=F64))  # C < 1/N
    assert torch.equal(qp_weights(0 * diffs, 1.0), torch.full((5,), 0.2, dtype=F64))  # G = 0


@pytest.mark.parametrize("c", [0.6, 0.9, 1.0])
def test_two_peer_qp_matches_a_grid_search(c) -> None:
    gen = torch.Generator().manual_seed(6)
    diffs = torch.randn(2, 3, 4, dtype=F64, generator=gen)
    diffs[1] += 0.5 * diffs[0]
    grid = np.linspace(1 - c, c, 200_001)
    d0, d1 = diffs[0].flatten().numpy(), diffs[1].flatten().numpy()
    values = ((grid[:, None] * d0 + (1 - grid[:, None]) * d1) ** 2).sum(1)
    assert float(qp_weights(diffs, c)[0]) == pytest.approx(grid[values.argmin()], abs=1e-4)


# --- communication (§1, §7.10) ---------------------------------------------------------------


def test_upload_of_the_papers_mlp_is_4917024_bytes() -> None:
    torch.manual_seed(0)
    model = build_model({"name": "mlp", "hidden": [400, 200, 100], "bias": False}, (1, 28, 28), 10)
    x, y = torch.randn(64, 1, 28, 28), torch.arange(64) % 10
    stats = local_statistics(
        model, PeerData(x, y, x[:0], y[:0]), CPU,
        seed=0, batch_size=32, damping=0.5, ridge=0.01**0.8, ridge_conv=1e-4,
    )  # fmt: skip
    state = model.state_dict()
    tensors = pack(stats, rank=None)
    projector_bytes = state_bytes({k: v for k, v in tensors.items() if k != "labels"})
    assert state_bytes(state) == 1_658_400
    assert state_bytes(state) + projector_bytes == 4_917_024
    assert state_bytes({"labels": tensors["labels"]}) == 10
    frames = [
        encode(Message("model", 0, 1, 1, state)),
        encode(Message("statistics", 0, 1, 1, tensors, {"classifier": "out"})),
    ]
    assert 4_917_034 <= sum(map(len, frames)) < 4_917_034 + 4096


def test_rank_k_factors_rebuild_the_best_rank_k_projector() -> None:
    stats = contribution(0).stats
    small = pack(stats, rank=3)
    assert {k: tuple(v.shape) for k, v in small.items()} == {
        "U/fc1.layer": (16, 3), "S/fc1.layer": (3,), "U/fc2.layer": (8, 3), "S/fc2.layer": (3,),
        "labels": (5,),
    }  # fmt: skip
    p = stats.projectors["fc1.layer"]
    rebuilt = unpack(small, "out").projectors["fc1.layer"]
    assert (rebuilt - rebuilt.T).abs().max() < 1e-12
    eig = torch.linalg.eigvalsh(p)
    assert torch.linalg.matrix_norm(rebuilt - p, 2) == pytest.approx(float(eig[-4]), abs=1e-6)
    full = unpack(pack(stats, rank=100), "out").projectors["fc2.layer"]
    assert torch.allclose(full, stats.projectors["fc2.layer"], atol=1e-6)


# --- output ensemble ---------------------------------------------------------------------------


def test_ensemble_averages_logits_per_class() -> None:
    torch.manual_seed(0)
    module = build_model({"name": "mlp", "hidden": [8]}, (1, 2, 2), 3)
    states = [mlp_like(module, s) for s in range(3)]
    x = torch.randn(50, 1, 2, 2)
    logits = []
    for s in states:
        module.load_state_dict(s)
        logits.append(module(x).double().detach())
    plain = ensemble_logits(module, states, x, CPU)
    assert torch.allclose(plain, sum(logits) / 3, atol=1e-12)
    weights = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5], [0.0, 0.0, 0.0]], dtype=F64)
    masked = ensemble_logits(module, states, x, CPU, weights)
    expected = torch.stack(
        [logits[0][:, 0], logits[1][:, 1], (logits[0][:, 2] + logits[1][:, 2]) / 2], 1
    )
    assert torch.allclose(masked, expected, atol=1e-12)
    y = expected.argmax(1)
    acc, loss = score_ensemble(module, states, x, y, CPU, weights)
    assert acc == 1.0 and loss == pytest.approx(
        torch.nn.functional.cross_entropy(expected, y).item()
    )
    assert score_ensemble(module, states[:1], x, y, CPU) == pytest.approx(
        (
            (logits[0].argmax(1) == y).double().mean().item(),
            torch.nn.functional.cross_entropy(logits[0], y).item(),
        )
    )
    assert torch.equal(
        class_weights([torch.tensor([True, False, False]), torch.tensor([True, True, False])]),
        torch.tensor([[0.5, 0.0, 0.5], [0.5, 1.0, 0.5]], dtype=F64),
    )


def mlp_like(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) for k, v in module.state_dict().items()}


# --- whole runs on digits -----------------------------------------------------------------------

DIGITS = {
    "partition": {"name": "dirichlet", "alpha": 0.05, "val_fraction": 0.0},
    "model": {"name": "mlp", "hidden": [32, 16], "bias": False},
    "peers": {"count": 3},
    "train": {"epochs": 5, "batch_size": 16, "lr": 0.05, "momentum": 0.5},
}


def test_star_and_mesh_give_the_same_model_and_the_expected_ledger(tmp_path) -> None:
    algo = {"name": "maecho", "tau": 10, "batch_size": 16}
    star = run_experiment(tmp_path / "star", topology={"kind": "star"}, algorithm=algo, **DIGITS)
    mesh = run_experiment(
        tmp_path / "mesh",
        topology={"kind": "mesh"},
        algorithm=algo | {"placement": "mesh"},
        **DIGITS,
    )
    assert star["final"] == mesh["final"]
    assert star["baselines"] == mesh["baselines"]
    assert len({p["accuracy"] for p in star["per_peer"] + mesh["per_peer"]}) == 1
    fedavg = max(star["baselines"]["fedavg"], star["baselines"]["fedavg_classaware"])
    assert star["final"]["accuracy"] > fedavg + 0.05
    assert {"ensemble", "ensemble_masked"} <= star["baselines"].keys()  # the default
    assert star["baselines"]["ensemble"] > star["baselines"]["fedavg"]
    n, m = 3, state_bytes(build(experiment(**DIGITS, algorithm=algo)).contexts()[0].init_state())
    p_bytes = 4 * (64**2 + 32**2)  # layers 1-2 (inputs 64 and 32); the classifier sends none
    by_kind = star["comm"]["by_kind"]
    assert by_kind["model"]["messages"] == 2 * n and by_kind["statistics"]["messages"] == n
    assert by_kind["statistics"]["bytes"] >= n * (p_bytes + 10)
    assert by_kind["model"]["bytes"] >= 2 * n * m
    by_kind = mesh["comm"]["by_kind"]
    assert by_kind["model"]["messages"] == by_kind["statistics"]["messages"] == n * (n - 1)
    assert (
        n * (n - 1) * (p_bytes + 10)
        <= by_kind["statistics"]["bytes"]
        < n * (n - 1) * (p_bytes + 2000)
    )
    with open(tmp_path / "mesh" / "comm.csv") as f:
        sent = sorted((r["src"], r["dst"], r["kind"]) for r in csv.DictReader(f))
    pairs = itertools.permutations("012", 2)
    assert sent == sorted((a, b, k) for a, b in pairs for k in ("model", "statistics"))


def test_rank_k_sends_fewer_statistics_bytes(tmp_path) -> None:
    algo = {"name": "maecho", "tau": 2, "rank": 4}
    summary = run_experiment(tmp_path, topology={"kind": "star"}, algorithm=algo, **DIGITS)
    sent = summary["comm"]["by_kind"]["statistics"]["bytes"]
    tensors = 4 * (4 * 64 + 4 + 4 * 32 + 4) + 10
    assert 3 * tensors <= sent < 3 * (tensors + 2000)


@pytest.mark.parametrize(
    ("placement", "kind"), [("star", "mesh"), ("mesh", "star"), ("mesh", "ring")]
)
def test_placement_needs_its_topology(placement, kind) -> None:
    sections = DIGITS | {"peers": {"count": 4}}  # a ring of 3 would be complete
    config = experiment(
        topology={"kind": kind}, algorithm={"name": "maecho", "placement": placement}, **sections
    )
    with pytest.raises(ConfigError, match=f"placement: {placement}") as err:
        build(config)
    assert err.value.key == "topology.kind"


@pytest.mark.parametrize(
    ("key", "value"), [("tau", -1), ("eta", 0.0), ("damping", 1.5), ("qp_c", 0.0), ("rank", 0)]
)
def test_bad_keys_are_config_errors(key, value) -> None:
    with pytest.raises(ConfigError) as err:
        build(experiment(topology={"kind": "star"}, algorithm={"name": "maecho", key: value}))
    assert err.value.key == f"algorithm.{key}"


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "maecho", "placement": "mesh", "tau": 5, "batch_size": 16, "ensemble": False},
        {"name": "regmean", "placement": "mesh", "select": "final"},
    ],
)
def test_mesh_peers_merge_the_same_values_under_a_compression_section(tmp_path, algorithm):
    """With ``compression:`` packing every model in int8, each mesh peer takes its own upload
    as the others decode it, so all of them end with the same model, bit for bit (a peer
    that merged its exact model with the others' int8 copies ended apart from them)."""
    finals = {}
    real = SimRuntime.run

    def run(self, behaviours):
        finals.update(real(self, behaviours))
        return finals

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SimRuntime, "run", run)
        summary = run_experiment(
            tmp_path,
            model={"name": "mlp", "hidden": [16]},
            topology={"kind": "mesh"},
            peers={"count": 3},
            algorithm=algorithm,
            train={"epochs": 1, "batch_size": 32, "lr": 0.05},
            compression={"model": {"codec": "int8"}},
        )
    assert summary["status"] == "ok"
    states = [finals[p].state for p in (0, 1, 2)]
    for state in states[1:]:
        assert all(torch.equal(state[k], states[0][k]) for k in state)
