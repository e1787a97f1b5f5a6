"""The ``iid`` partition's ``samples_per_peer`` and ``replace`` keys (issue 38): more peers
than samples, each with its own draw, without per-peer copies of the images."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import experiment, run_cli
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import torch_generator
from p2pfl.data.datasets import Dataset
from p2pfl.data.federated import PeerData, make_federated_data
from p2pfl.data.partition import iid
from p2pfl.learning import batched
from p2pfl.learning.training import TrainConfig
from p2pfl.methods.attacks.label_flip import LabelFlip

CPU = torch.device("cpu")

LABELS = np.repeat(np.arange(10), 50)  # 500 samples


def draw(peers: int, seed: int = 0, labels: np.ndarray = LABELS, **kw) -> list[np.ndarray]:
    return iid(labels, peers, np.random.default_rng(seed), **kw)


def test_without_the_new_keys_iid_is_the_split_it_always_was() -> None:
    for peers in (1, 7, 500):
        parts = draw(peers, seed=3)
        old = np.array_split(np.random.default_rng(3).permutation(500), peers)
        assert len(parts) == len(old) and all(
            np.array_equal(a, b) for a, b in zip(parts, old, strict=True)
        )


def test_replace_gives_more_peers_than_samples_each_its_own_distinct_draw() -> None:
    parts = draw(2000, samples_per_peer=12, replace=True)
    assert len(parts) == 2000
    assert all(len(p) == 12 and len(np.unique(p)) == 12 for p in parts)  # distinct in a peer
    held = np.bincount(np.concatenate(parts), minlength=500)
    assert held.sum() == 24_000  # every sample held by ~48 peers: binomial(24,000, 1/500)
    assert held.min() > 20 and held.max() < 90  # 48 ± 7
    assert len({tuple(np.sort(p)) for p in parts}) == 2000  # shards overlap, none repeat
    assert parts[0].dtype == np.int64


def test_replace_is_seeded_and_takes_the_legacy_stream() -> None:
    a, b, c = (draw(300, s, samples_per_peer=5, replace=True) for s in (1, 1, 2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    legacy = iid(LABELS, 300, np.random.RandomState(4), samples_per_peer=5, replace=True)
    again = iid(LABELS, 300, np.random.RandomState(4), samples_per_peer=5, replace=True)
    assert all(np.array_equal(x, y) for x, y in zip(legacy, again, strict=True))
    assert all(len(np.unique(p)) == 5 for p in legacy)


def test_a_draw_close_to_the_whole_set_still_holds_distinct_samples() -> None:
    """Where most rows would repeat a sample (size² > n), each is a permutation's head."""
    parts = draw(40, samples_per_peer=499, replace=True)
    assert all(len(np.unique(p)) == 499 for p in parts)
    whole = draw(3, samples_per_peer=500, replace=True)
    assert all(np.array_equal(np.sort(p), np.arange(500)) for p in whole)


def test_samples_per_peer_without_replace_is_disjoint() -> None:
    parts = draw(30, samples_per_peer=16)
    assert [len(p) for p in parts] == [16] * 30
    assert len(np.unique(np.concatenate(parts))) == 480  # disjoint


@pytest.mark.parametrize(
    ("peers", "keys", "key", "message"),
    [
        (10, {"replace": True}, "replace", "needs samples_per_peer"),
        (10, {"samples_per_peer": 0}, "samples_per_peer", "between 1 and the 500"),
        (10, {"samples_per_peer": 501, "replace": True}, "samples_per_peer", "got 501"),
        (100, {"samples_per_peer": 6}, "samples_per_peer", "needs 600 but the train set has 500"),
        (0, {"samples_per_peer": 6, "replace": True}, "count", "at least 1 peer"),
    ],
)
def test_bad_values_are_config_errors(peers, keys, key, message) -> None:
    with pytest.raises(ConfigError) as e:
        draw(peers, **keys)
    assert e.value.key == key and message in str(e.value)


def tiny() -> Dataset:
    x = torch.arange(40 * 4, dtype=torch.float32).view(40, 1, 2, 2)
    y = torch.arange(40) % 4
    return Dataset("tiny", x, y, x[:8], y[:8], num_classes=4)


def test_peers_share_the_datasets_rows_instead_of_copies() -> None:
    """120 peers over 40 samples (480 training rows drawn): each peer's split is its rows
    of the dataset's own tensors, the indices of all peers end to end in one tensor (the
    layout batched training pools without a copy), holding exactly its drawn rows."""
    data = tiny()
    options = {"name": "iid", "samples_per_peer": 5, "replace": True, "val_fraction": 0.2}
    fed = make_federated_data(data, options, num_peers=120, seed=0)
    parts = iid(
        data.train_y.numpy(), 120, np.random.default_rng([0, 2]), samples_per_peer=5, replace=True
    )
    assert len(fed.peers) == 120
    assert all(p.source_x is data.train_x and p.source_y is data.train_y for p in fed.peers)
    rows = {p.rows.untyped_storage().data_ptr() for p in fed.peers if p.rows is not None}
    val = {p.val_x.untyped_storage().data_ptr() for p in fed.peers}
    assert len(rows) == 1 and len(val) == 1  # one tensor each, every peer a slice of it
    offsets = [p.rows.storage_offset() for p in fed.peers if p.rows is not None]
    assert offsets == [i * 4 for i in range(120)]  # end to end, 4 rows each
    for p, idx in zip(fed.peers, parts, strict=True):
        assert p.num_train == 4
        assert torch.equal(p.val_x, data.train_x[idx[:1]])  # the first fifth held out
        assert torch.equal(p.train_x, data.train_x[idx[1:]])
        assert torch.equal(p.train_y, data.train_y[idx[1:]])
    assert fed.counts.sum() == 600 and fed.counts.shape == (120, 4)
    again = make_federated_data(data, options, num_peers=120, seed=0)
    assert all(
        torch.equal(a.train_x, b.train_x) for a, b in zip(fed.peers, again.peers, strict=True)
    )
    # the pool is the dataset itself: its bytes do not grow with the peers
    pool = batched.DataPool(fed.peers)
    x, y = pool.on(CPU)
    assert x.data_ptr() == data.train_x.data_ptr() and y.data_ptr() == data.train_y.data_ptr()
    assert x.untyped_storage().nbytes() == data.train_x.untyped_storage().nbytes() == 40 * 16
    assert pool.rows is not None and pool.rows.data_ptr() == fed.peers[0].rows.data_ptr()
    assert torch.equal(pool.rows, torch.from_numpy(np.concatenate([i[1:] for i in parts])))


def test_fewer_rows_than_the_dataset_are_copied_as_before() -> None:
    """6 peers x 5 over 40 samples: the copies (24 rows) are smaller than the dataset, so
    each peer holds its own, a slice of one gathered tensor, and the pool takes it as is."""
    data = tiny()
    options = {"name": "iid", "samples_per_peer": 5, "replace": True, "val_fraction": 0.2}
    fed = make_federated_data(data, options, num_peers=6, seed=0)
    assert all(p.rows is None for p in fed.peers)
    assert len({p.train_x.untyped_storage().data_ptr() for p in fed.peers}) == 1
    assert fed.peers[0].train_x.untyped_storage().nbytes() == 24 * 16
    pool = batched.DataPool(fed.peers)
    assert pool.rows is None and pool.on(CPU)[0].data_ptr() == fed.peers[0].train_x.data_ptr()


@pytest.mark.parametrize(
    ("hidden", "cfg"),
    [
        ([], TrainConfig(batch_size=4, lr=0.5)),
        ([16], TrainConfig(epochs=2, batch_size=3, momentum=0.9, weight_decay=1e-3)),
    ],
)
def test_batched_training_on_shared_rows_gives_the_bits_of_copies(hidden, cfg) -> None:
    """90 peers x 7 digits of 150 (with replacement, so the peers share the dataset's
    rows): batched training through the pool's index gives every peer the bits that
    batched training on copies of its rows gives, and the one-by-one loop the bits of
    the loop on the copies; an attacker's own rows (label flipping) among the shared
    ones make the pool copy them all, to the same bits."""
    setup = build(
        experiment(
            dataset={"name": "digits", "subset": 150, "test_subset": 50},
            partition={"name": "iid", "samples_per_peer": 7, "replace": True, "val_fraction": 0},
            model={"name": "mlp", "hidden": hidden},
            peers={"count": 90},
        )
    )
    shared = setup.data.peers
    assert all(p.rows is not None for p in shared)
    copies = [PeerData(p.train_x.clone(), p.train_y.clone(), p.val_x, p.val_y) for p in shared]
    init, module = setup.trainer.init_state(0), setup.trainer.module(CPU)

    def together(peers: list[PeerData]) -> list[dict[str, torch.Tensor]]:
        pool = batched.DataPool(peers)
        jobs = [batched.Job(init, p, torch_generator(0, "t", p)) for p in range(len(peers))]
        return [r.state for r in batched.train_batched(module, pool, jobs, cfg, CPU)]

    def loop(peers: list[PeerData]) -> list[dict[str, torch.Tensor]]:
        train = setup.trainer.train
        return [
            train(init, p, cfg, torch_generator(0, "t", i), CPU).state for i, p in enumerate(peers)
        ]

    def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
        return all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)

    pooled = together(shared)
    assert same(pooled, together(copies))
    one_by_one = loop(shared)
    assert same(one_by_one, loop(copies))
    for a, b in zip(one_by_one, pooled, strict=True):  # the loop sums in another order
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    mixed = list(shared)
    mixed[3] = LabelFlip().poison(shared[3], 10)
    assert mixed[3].rows is None  # the attacker holds rows of its own
    result = together(mixed)
    assert all(p.rows is None for p in mixed)  # the pool copied every peer's rows
    assert same(result[:3] + result[4:], pooled[:3] + pooled[4:])
    assert not same(result[3:4], pooled[3:4])  # it trained on its flipped labels


def test_a_gossip_run_with_more_peers_than_samples_from_the_command_line(tmp_path) -> None:
    """300 gossip peers over 150 digits, 4 periods; then a bad value: one line, exit 2."""
    config = {
        "name": "crowd",
        "seed": 0,
        "dataset": {"name": "digits", "subset": 150, "test_subset": 100},
        "partition": {"name": "iid", "samples_per_peer": 4, "replace": True, "val_fraction": 0},
        "model": {"name": "mlp", "hidden": []},
        "topology": {"kind": "random_regular", "d": 4},
        "peers": {"count": 300, "batched": True},
        "algorithm": {"name": "gossip", "rounds": 4, "train_idle": True},
        "train": {"epochs": 1, "batch_size": 4, "lr": 0.5},
        "eval": {"every": 4, "per_peer": False},
    }
    done = run_cli(tmp_path / "crowd.yaml", config, tmp_path / "out", "--quiet")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["comm"]["messages"] == 1200  # every peer pushes once a period
    assert summary["final"]["accuracy"] > 0.5  # 10 classes: it learned
    config["partition"] = {"name": "iid", "samples_per_peer": 4}
    bad = run_cli(tmp_path / "bad.yaml", config, tmp_path / "bad", "--quiet")
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("error:") and "partition.samples_per_peer" in line
    assert "replace: true" in line
