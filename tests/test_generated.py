"""Generated benchmarks (p2pfl/data/generated.py): MNIST-1D from its reference generator and
FedProx's Synthetic(α, β); the models MNIST-1D's paper uses (logreg, mlp on signals,
cnn1d); FedAvg's and FedProx's stragglers (p2pfl/methods/stragglers.py). Sizes and
determinism exactly, the models' accuracy ordering on real data, runs from YAML in a
simulation, a sweep and over ZeroMQ, p2pfl cost against the ledger, and bad keys."""

from __future__ import annotations

import csv
import random
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import p2pfl
from conftest import ROOT, run_cli, sim_and_zmq
from p2pfl.app.config import resolve
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError
from p2pfl.data import generated
from p2pfl.data.datasets import load_dataset
from p2pfl.learning.models import build_model, forward_flops
from p2pfl.methods.stragglers import Stragglers

M1D: dict[str, Any] = {
    "name": "m1d-small",
    "seed": 0,
    "dataset": {"name": "mnist1d", "num_samples": 600},
    "partition": {"name": "dirichlet", "alpha": 0.5},
    "model": {"name": "cnn1d", "channels": 8},
    "topology": {"kind": "star"},
    "peers": {"count": 4},
    "algorithm": {"name": "fedavg", "rounds": 2},
    "train": {"epochs": 1, "batch_size": 50, "optimizer": "adam", "lr": 0.01},
    "eval": {"every": 1, "per_peer": False},
}

SYN: dict[str, Any] = {
    "name": "syn-small",
    "seed": 0,
    "dataset": {"name": "synthetic", "alpha": 1, "beta": 1},
    "partition": {"name": "natural", "val_fraction": 0},
    "model": {"name": "logreg"},
    "topology": {"kind": "star"},
    "peers": {"count": 10},  # the 10 largest of the 30 devices
    "algorithm": {
        "name": "fedprox",
        "rounds": 3,
        "participation": 0.5,
        "mu": 1.0,
        "stragglers": {"fraction": 0.6, "epochs": [1, 2]},
    },
    "train": {"epochs": 3, "batch_size": 10, "lr": 0.01},
    "eval": {"every": 1, "per_peer": False},
}


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


# --- MNIST-1D -----------------------------------------------------------------------------


def test_mnist1d_is_the_reference_generators_output_built_offline(monkeypatch):
    """The same arrays as the package's own make_dataset, with every socket refused (its
    get_dataset may download: never called), and the global random state left alone."""
    from mnist1d.data import get_dataset_args, make_dataset

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("MNIST-1D tried the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    generated._make_mnist1d.cache_clear()
    np.random.seed(7)
    random.seed(7)
    before = (np.random.random(), random.random())
    np.random.seed(7)
    random.seed(7)
    d = load_dataset({"name": "mnist1d", "num_samples": 500}, seed=3)
    assert (np.random.random(), random.random()) == before
    assert d.train_x.shape == (400, 1, 40) and d.test_x.shape == (100, 1, 40)
    assert d.train_x.dtype == torch.float32 and d.num_classes == 10 and d.input_shape == (1, 40)
    counts = torch.bincount(torch.cat([d.train_y, d.test_y]), minlength=10)
    assert counts.tolist() == [50] * 10  # num_samples // 10 of each digit
    args = get_dataset_args()
    args.num_samples = 500
    ref = make_dataset(args)
    assert np.array_equal(d.train_x[:, 0].numpy(), ref["x"].astype(np.float32))
    assert np.array_equal(d.test_y.numpy(), ref["y_test"])
    again = load_dataset({"name": "mnist1d", "num_samples": 500}, seed=9)
    assert again.train_x.equal(d.train_x)  # the run seed does not change the data
    other = load_dataset({"name": "mnist1d", "num_samples": 500, "seed": 1}, seed=3)
    assert not other.train_x.equal(d.train_x)


@pytest.mark.slow  # 10 s: the reference set, generated twice
def test_mnist1d_reference_set_sizes():
    d = load_dataset({"name": "mnist1d"}, seed=0)
    assert d.train_x.shape == (4000, 1, 40) and d.test_x.shape == (1000, 1, 40)
    x = torch.cat([d.train_x, d.test_x])
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1) < 5e-3
    shuffled = load_dataset({"name": "mnist1d", "shuffle_seq": True}, seed=0)
    assert torch.equal(shuffled.train_y, d.train_y) and not shuffled.train_x.equal(d.train_x)


def test_the_reference_models_sizes_and_flops():
    shape = (1, 40)
    sizes = {"logreg": 410, "mlp": 40 * 100 + 100 + 100 * 100 + 100 + 100 * 10 + 10}
    sizes["cnn1d"] = (5 * 25 + 25) + 2 * (3 * 25 * 25 + 25) + (125 * 10 + 10)
    for name, size in sizes.items():
        keys = {"hidden": [100, 100]} if name == "mlp" else {}
        net = build_model({"name": name, **keys}, shape, 10)
        assert sum(p.numel() for p in net.parameters()) == size, name
    cnn = build_model({"name": "cnn1d"}, shape, 10)
    # conv1: 19 outputs x 25 channels x 2·1·5, conv2: 10 x 25 x 2·25·3, conv3: 5 x 25 x 2·25·3
    assert forward_flops(cnn, shape) == 19 * 25 * 10 + 10 * 25 * 150 + 5 * 25 * 150 + 2 * 125 * 10
    assert cnn(torch.zeros(3, 1, 40)).shape == (3, 10)
    with pytest.raises(ConfigError, match="signals"):
        build_model({"name": "cnn1d"}, (1, 8, 8), 10)


def test_logreg_mlp_cnn_order_on_mnist1d(tmp_path):
    """One peer, the reference training (Adam, lr 0.01, batch 100) for 10 epochs on 2,000
    signals: the paper's ordering, linear < MLP < CNN, with margins (measured 0.28, 0.49,
    0.68 with 2,000 signals; 0.31, 0.67, 0.92 on the reference set for 150 epochs)."""
    acc = {}
    for model in ({"name": "logreg"}, {"name": "mlp", "hidden": [100, 100]}, {"name": "cnn1d"}):
        config = {
            **M1D,
            "dataset": {"name": "mnist1d", "num_samples": 2000},
            "partition": {"name": "iid", "val_fraction": 0},
            "model": model,
            "peers": {"count": 1},
            "algorithm": {"name": "fedavg", "rounds": 1},
            "train": {"epochs": 10, "batch_size": 100, "optimizer": "adam", "lr": 0.01},
        }
        result = p2pfl.run(config, out=tmp_path / model["name"])
        acc[model["name"]] = result.summary["final"]["accuracy"]
    assert acc["logreg"] + 0.1 < acc["mlp"] < acc["cnn1d"] - 0.1, acc
    assert 0.2 < acc["logreg"] < 0.4, acc


def test_a_run_counts_the_bytes_cost_predicts(tmp_path):
    for name, config in (("m1d", M1D), ("syn", SYN)):
        result = p2pfl.run(config, out=tmp_path / name)
        comm = rows(tmp_path / name / "comm.csv")
        total = sum(int(r["bytes"]) for r in comm)
        assert total == result.summary["comm"]["total_bytes"]
        table = p2pfl.cost(config, topologies="star", out=tmp_path / f"{name}-cost")
        assert int(table["total_bytes"].iloc[0]) == total, name
        assert int(table["messages"].iloc[0]) == len(comm), name


# --- Synthetic(alpha, beta) ---------------------------------------------------------------


def test_synthetic_sizes_are_exact_and_seeded():
    d = load_dataset({"name": "synthetic"}, seed=5)
    assert d.train_x.shape == (6351, 60) and d.test_x.shape == (708, 60)  # seed 0's draw
    assert d.num_classes == 10 and d.train_x.dtype == torch.float32
    assert d.train_groups is not None and d.test_groups is not None
    train, test = torch.bincount(d.train_groups), torch.bincount(d.test_groups)
    total = train + test
    assert len(total) == 30 and int(total.min()) >= 50  # lognormal(4, 2) + 50 each
    assert test.tolist() == [max(1, round(0.1 * int(n))) for n in total]
    assert d.group_names is not None and d.group_names[0] == "f_00000"
    assert load_dataset({"name": "synthetic"}, seed=6).train_x.equal(d.train_x)
    other = load_dataset({"name": "synthetic", "seed": 1}, seed=5)
    assert other.train_x.shape != d.train_x.shape
    fewer = load_dataset({"name": "synthetic", "devices": 5, "alpha": 0.5}, seed=5)
    assert len(torch.bincount(fewer.train_groups)) == 5


def test_each_device_has_its_own_linear_model_unless_iid():
    """Device k's labels are argmax(W_k x + b_k): a linear classifier fitted to one device's
    samples labels them (almost) perfectly but is poor on another device's, whose model
    differs under Synthetic(1, 1); in the IID variant every device shares one model, so it
    carries over."""

    def fit(x: torch.Tensor, y: torch.Tensor) -> torch.nn.Linear:
        torch.manual_seed(0)
        layer = torch.nn.Linear(60, 10)
        opt = torch.optim.Adam(layer.parameters(), lr=0.05)
        for _ in range(300):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(layer(x), y).backward()
            opt.step()
        return layer

    def accuracy(layer: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float((layer(x).argmax(1) == y).float().mean())

    for iid in (False, True):
        d = load_dataset({"name": "synthetic", "iid": iid}, seed=0)
        assert d.train_groups is not None
        a, b = torch.bincount(d.train_groups).argsort(descending=True)[:2].tolist()
        xa, ya = d.train_x[d.train_groups == a], d.train_y[d.train_groups == a]
        xb, yb = d.train_x[d.train_groups == b], d.train_y[d.train_groups == b]
        layer = fit(xa, ya)
        assert accuracy(layer, xa, ya) > 0.97, iid
        if iid:
            assert accuracy(layer, xb, yb) > 0.75  # measured 0.82: a 743-sample fit
            assert float(d.train_x.mean(0).abs().max()) < 0.1  # one feature distribution, mean 0
        else:
            assert accuracy(layer, xb, yb) < 0.5
            means = torch.stack([d.train_x[d.train_groups == k].mean(0) for k in range(30)])
            assert float(means.mean(1).std()) > 0.5  # each device's own feature mean


def test_the_natural_partition_gives_each_peer_one_device(tmp_path):
    setup = p2pfl.run(SYN | {"algorithm": {"name": "fedavg", "rounds": 1}}, out=tmp_path)
    assert setup.summary["num_peers"] == 10
    d = load_dataset({"name": "synthetic"}, seed=0)
    assert d.train_groups is not None and d.test_groups is not None
    sizes = sorted(torch.bincount(d.train_groups).tolist(), reverse=True)[:10]
    built = build(resolve(SYN, ROOT / "experiments" / "x.yaml"))
    assert [p.num_train for p in built.data.peers] == sizes
    largest = set(torch.bincount(d.train_groups).argsort(descending=True)[:10].tolist())
    assert len(built.data.test_y) == int(sum((d.test_groups == k).sum() for k in largest))


# --- stragglers ---------------------------------------------------------------------------


def test_stragglers_are_a_seeded_share_of_each_round():
    s = Stragglers(fraction=0.9, epochs=(1, 19))
    chosen = list(range(3, 13))
    picks = [s.pick(chosen, 0, r) for r in range(1, 6)]
    assert all(len(p) == 9 and set(p) <= set(chosen) for p in picks)
    assert all(1 <= e <= 19 for p in picks for e in p.values())
    assert picks[0] == s.pick(chosen, 0, 1) and picks[0] != picks[1]
    assert len(Stragglers(fraction=0.25).pick([1, 2], 0, 1)) == 1  # 0.5 rounds half up
    assert Stragglers(fraction=0.2).pick([1, 2], 0, 1) == {}
    assert Stragglers(fraction=0.5, epochs=3).pick([1, 2, 3, 4], 4, 2).keys() <= {1, 2, 3, 4}
    assert set(Stragglers(fraction=0.5, epochs=3).pick([1, 2, 3, 4], 4, 2).values()) == {3}


def test_fedavg_drops_stragglers_and_fedprox_takes_their_partial_work(tmp_path):
    base = SYN | {"algorithm": {"name": "fedavg", "rounds": 2, "participation": 0.5}}
    plain = p2pfl.run(base, out=tmp_path / "plain")
    drop = p2pfl.run(
        base | {"algorithm": base["algorithm"] | {"stragglers": {"fraction": 0.6, "drop": True}}},
        out=tmp_path / "drop",
    )
    partial = p2pfl.run(SYN | {"algorithm": SYN["algorithm"] | {"rounds": 2}}, out=tmp_path / "p")
    models = {
        name: [r for r in rows(tmp_path / name / "comm.csv") if r["kind"] == "model"]
        for name in ("plain", "drop", "p")
    }
    # K = 5 a round; 3 of them straggle: dropped, 2 models go down and come back
    assert len(models["plain"]) == 2 * 2 * 5 and len(models["drop"]) == 2 * 2 * 2
    assert len(models["p"]) == 2 * 2 * 5
    down = [int(r["bytes"]) for r in models["p"] if r["src"] == "server" or r["src"] == "10"]
    assert len(set(down)) == 2  # a straggler's model carries its epochs in the header
    # their partial work counts: not the run without stragglers, nor the one that drops them
    finals = {r.summary["final"]["accuracy"] for r in (plain, drop, partial)}
    assert len(finals) == 3
    off = base | {"algorithm": base["algorithm"] | {"stragglers": {"fraction": 0.0}}}
    p2pfl.run(off, out=tmp_path / "off")
    for name in ("comm.csv", "metrics.csv"):
        assert (tmp_path / "off" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


# --- runs, sweeps, sockets, bad keys ------------------------------------------------------


@pytest.mark.slow  # 30 s: 2 cells x 2 seeds
def test_a_sweep_over_the_reference_models(tmp_path):
    config = M1D | {"sweep": {"model": [{"name": "logreg"}, {"name": "cnn1d"}], "seed": [0, 1]}}
    cells = p2pfl.sweep(config, out=tmp_path / "sweep")
    assert set(cells.cells["status"]) == {"ok"} and len(cells.table) == 2


@pytest.mark.slow  # 30 s: two runs, one of them 5 processes, for each dataset
@pytest.mark.parametrize("config", [M1D, SYN], ids=["mnist1d", "synthetic"])
def test_zmq_run_gives_the_simulated_models(tmp_path, config):
    config = config | {"transport": {"timeout_s": 120.0}}
    a, b = sim_and_zmq(tmp_path, config)
    assert a["final"] == b["final"] and a["comm"] == b["comm"]


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ({"name": "synthetic", "alpha": -1}, "dataset.alpha: must be >= 0, got -1"),
        pytest.param({"name": "no_such_set"}, "dataset.name", marks=pytest.mark.slow),
    ],
)
def test_bad_keys_exit_2_and_write_nothing(tmp_path, dataset, message):
    out = tmp_path / "out"
    run = run_cli(tmp_path / "exp.yaml", SYN | {"dataset": dataset}, out, "--quiet")
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and run.stderr.startswith("error: ")
    assert len(run.stderr.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"dataset": {"name": "no_such_set"}}, "dataset.name"),
        ({"dataset": {"name": "synthetic", "beta": -0.5}}, "dataset.beta"),
        ({"dataset": {"name": "synthetic", "test_fraction": 1}}, "dataset.test_fraction"),
        ({"dataset": {"name": "mnist1d", "train_split": 1.5}}, "dataset.train_split"),
        ({"dataset": {"name": "mnist1d", "num_samples": 5}}, "dataset.num_samples"),
        ({"model": {"name": "cnn1d", "channels": 0}}, "model.channels"),
        (
            {"algorithm": {"name": "fedavg", "stragglers": {"fraction": 1.5}}},
            "algorithm.stragglers.fraction",
        ),
        (
            {"algorithm": {"name": "fedprox", "stragglers": {"fraction": 0.5, "epochs": [3, 1]}}},
            "algorithm.stragglers.epochs",
        ),
        ({"algorithm": {"name": "fedavg", "stragglers": {"share": 0.5}}}, "stragglers.share"),
    ],
)
def test_bad_keys_are_refused_before_the_run(tmp_path, change, key):
    config = M1D | change
    with pytest.raises(ConfigError) as e:
        p2pfl.run(config, out=tmp_path / "out")
    assert key in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()
