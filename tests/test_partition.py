"""The ``iid`` partition's ``samples_per_peer`` and ``replace`` keys (issue 38): more peers
than samples, each with its own draw, without per-peer copies of the images."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import run_cli
from p2pfl.core.errors import ConfigError
from p2pfl.data.datasets import Dataset
from p2pfl.data.federated import make_federated_data
from p2pfl.data.partition import iid

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


def test_peers_are_views_of_one_gather_not_copies_each() -> None:
    """120 peers over 40 samples: each peer's split is a slice of one tensor (the layout
    batched training pools without a copy), holding exactly its drawn rows."""
    data = tiny()
    options = {"name": "iid", "samples_per_peer": 5, "replace": True, "val_fraction": 0.2}
    fed = make_federated_data(data, options, num_peers=120, seed=0)
    parts = iid(
        data.train_y.numpy(), 120, np.random.default_rng([0, 2]), samples_per_peer=5, replace=True
    )
    assert len(fed.peers) == 120
    train = {p.train_x.untyped_storage().data_ptr() for p in fed.peers}
    val = {p.val_x.untyped_storage().data_ptr() for p in fed.peers}
    assert len(train) == 1 and len(val) == 1  # one tensor each, every peer a slice of it
    offsets = [p.train_x.storage_offset() for p in fed.peers]
    assert offsets == [i * 4 * 4 for i in range(120)]  # end to end, 4 rows of 4 values
    for p, idx in zip(fed.peers, parts, strict=True):
        assert torch.equal(p.val_x, data.train_x[idx[:1]])  # the first fifth held out
        assert torch.equal(p.train_x, data.train_x[idx[1:]])
        assert torch.equal(p.train_y, data.train_y[idx[1:]])
    assert fed.counts.sum() == 600 and fed.counts.shape == (120, 4)
    again = make_federated_data(data, options, num_peers=120, seed=0)
    assert all(
        torch.equal(a.train_x, b.train_x) for a, b in zip(fed.peers, again.peers, strict=True)
    )


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
