"""The data layer on real files: loaders, partitioners and per-peer splits."""

from __future__ import annotations

import csv
import gzip
import pickle
import struct
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
import torchvision.transforms.functional as TF

from p2pfl.core.errors import ConfigError
from p2pfl.data import (
    PARTITIONERS,
    Dataset,
    SplitOptions,
    load_dataset,
    make_federated_data,
)
from p2pfl.data.datasets import DEBIAN_FASHION_MNIST, _read_digits, read_idx
from p2pfl.data.federated import rotate
from p2pfl.reporting.partition import save_partition

# --- writers for the real on-disk formats ------------------------------------------------


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    """An IDX file of uint8 ``array``: magic 0x0000 08 ndim, big-endian dims, raw bytes."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        raw = gzip.compress(raw)
    path.write_bytes(raw)


def write_idx_dataset(directory: Path, rng: np.random.Generator, gz: bool) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (30, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, 30, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, 12, dtype=np.uint8),
    }
    for name, a in arrays.items():
        write_idx(directory / name, a, gz)
    return arrays


def denormalise(x: torch.Tensor, mean: list[float], std: list[float]) -> np.ndarray:
    """Back to 0..255 pixel values."""
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return ((x * s + m) * 255).numpy()


# --- loaders ------------------------------------------------------------------------------


def test_digits_fixed_stratified_split() -> None:
    d = load_dataset({"name": "digits"}, seed=0)
    assert d.train_x.shape == (1437, 1, 8, 8) and d.test_x.shape == (360, 1, 8, 8)
    assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.int64
    assert d.input_shape == (1, 8, 8) and d.num_classes == 10
    assert abs(d.train_x.mean().item()) < 1e-4 and abs(d.train_x.std().item() - 1) < 1e-3
    assert torch.bincount(d.test_y, minlength=10).min() >= 35  # stratified: ~36 per class
    other = load_dataset({"name": "digits"}, seed=7)
    assert torch.equal(d.test_x, other.test_x) and torch.equal(d.train_y, other.train_y)


def test_digits_split_is_scikit_learns() -> None:
    """The stored split is ``train_test_split``'s, in its order (stored from scikit-learn
    1.9.1: should a later version split otherwise, p2pfl's test set stays, and this test
    says that they differ). That loading digits leaves scikit-learn unimported is checked
    in ``tests/test_layers.py``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.uint8).reshape(-1, 1, 8, 8)
    want = train_test_split(x, y, test_size=360, stratify=y, random_state=0)
    got = _read_digits()
    for a, b in zip((want[0], want[2], want[1], want[3]), got, strict=True):
        assert a.dtype.kind == b.dtype.kind and np.array_equal(a, b)


@pytest.mark.skipif(
    not DEBIAN_FASHION_MNIST.is_dir(),
    reason=f"{DEBIAN_FASHION_MNIST} absent (Debian package dataset-fashion-mnist)",
)
def test_fashion_mnist_from_debian_package() -> None:
    d = load_dataset({"name": "fashion_mnist"}, seed=0)
    assert d.train_x.shape == (60000, 1, 28, 28) and d.test_x.shape == (10000, 1, 28, 28)
    assert torch.bincount(d.train_y).tolist() == [6000] * 10
    assert torch.bincount(d.test_y).tolist() == [1000] * 10
    assert abs(d.train_x.mean().item()) < 0.01 and abs(d.train_x.std().item() - 1) < 0.01


@pytest.mark.parametrize(
    ("name", "subdir", "mean", "std"),
    [("mnist", "MNIST", 0.1307, 0.3081), ("fashion_mnist", "FashionMNIST", 0.2860, 0.3530)],
)
@pytest.mark.parametrize("gz", [False, True])
def test_idx_torchvision_root_round_trip(
    tmp_path: Path, name: str, subdir: str, mean: float, std: float, gz: bool
) -> None:
    arrays = write_idx_dataset(tmp_path / subdir / "raw", np.random.default_rng(0), gz)
    d = load_dataset({"name": name, "root": str(tmp_path)}, seed=0)
    assert d.train_x.shape == (30, 1, 28, 28) and d.test_x.shape == (12, 1, 28, 28)
    pixels = denormalise(d.train_x, [mean], [std])
    np.testing.assert_allclose(pixels[:, 0], arrays["train-images-idx3-ubyte"], atol=1e-3)
    np.testing.assert_allclose(
        denormalise(d.test_x, [mean], [std])[:, 0], arrays["t10k-images-idx3-ubyte"], atol=1e-3
    )
    assert d.train_y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert d.test_y.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()


def test_fashion_mnist_plain_directory(tmp_path: Path) -> None:
    arrays = write_idx_dataset(tmp_path, np.random.default_rng(1), gz=True)
    d = load_dataset({"name": "fashion_mnist", "root": str(tmp_path)}, seed=0)
    assert d.train_y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()


@pytest.mark.parametrize("damage", ["truncate", "truncate_gz", "magic"])
def test_corrupt_idx_is_a_config_error_on_root(tmp_path: Path, damage: str) -> None:
    raw = tmp_path / "MNIST" / "raw"
    write_idx_dataset(raw, np.random.default_rng(0), gz=damage == "truncate_gz")
    suffix = ".gz" if damage == "truncate_gz" else ""
    path = raw / f"train-images-idx3-ubyte{suffix}"
    data = path.read_bytes()
    path.write_bytes(b"\x00\x00\x99\x03" + data[4:] if damage == "magic" else data[:-100])
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": "mnist", "root": str(tmp_path)}, seed=0)
    assert e.value.key == "root" and "train-images-idx3-ubyte" in e.value.message


@pytest.mark.parametrize("name", ["mnist", "cifar10", "svhn"])
def test_missing_files_name_root_and_never_download(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": name, "root": str(tmp_path)}, seed=0)
    assert e.value.key == "root" and "never downloads" in e.value.message
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": name}, seed=0)
    assert e.value.key == "root"


def test_cifar10_pickle_batches_round_trip(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    batches = {}
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        data = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, 4).tolist()
        batches[name] = (data, labels)
        entry = {"batch_label": name, "labels": labels, "data": data, "filenames": ["x"] * 4}
        (folder / name).write_bytes(pickle.dumps(entry))
    meta = {"label_names": [f"c{i}" for i in range(10)], "num_cases_per_batch": 4}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))

    d = load_dataset({"name": "cifar10", "root": str(tmp_path)}, seed=0)
    assert d.train_x.shape == (20, 3, 32, 32) and d.test_x.shape == (4, 3, 32, 32)
    mean, std = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
    train = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    np.testing.assert_allclose(
        denormalise(d.train_x, mean, std), train.reshape(-1, 3, 32, 32), atol=1e-3
    )
    assert d.train_y.tolist() == [y for i in range(1, 6) for y in batches[f"data_batch_{i}"][1]]
    assert d.test_y.tolist() == batches["test_batch"][1]


def test_svhn_mat_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    images = {}
    for split, n in [("train", 6), ("test", 3)]:
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)  # H x W x C x N
        y = np.array([[10], [1], [9], [10], [5], [2]][:n], dtype=np.uint8)
        scipy.io.savemat(tmp_path / f"{split}_32x32.mat", {"X": x, "y": y})
        images[split] = x
    d = load_dataset({"name": "svhn", "root": str(tmp_path)}, seed=0)
    assert d.train_x.shape == (6, 3, 32, 32) and d.test_x.shape == (3, 3, 32, 32)
    assert d.train_y.tolist() == [0, 1, 9, 0, 5, 2] and d.test_y.tolist() == [0, 1, 9]
    pixels = denormalise(d.train_x, [0.4377, 0.4438, 0.4728], [0.1980, 0.2010, 0.1970])
    np.testing.assert_allclose(pixels, images["train"].transpose(3, 2, 0, 1), atol=1e-3)


def test_subsets_and_option_errors() -> None:
    a = load_dataset({"name": "digits", "subset": 100, "test_subset": 50}, seed=0)
    b = load_dataset({"name": "digits", "subset": 100, "test_subset": 50}, seed=0)
    c = load_dataset({"name": "digits", "subset": 100, "test_subset": 50}, seed=1)
    assert len(a.train_y) == 100 and len(a.test_y) == 50
    assert torch.equal(a.train_x, b.train_x) and not torch.equal(a.train_x, c.train_x)
    assert torch.equal(a.test_x, c.test_x)  # the test subset does not follow the seed
    for options, key in [
        ({"name": "nope"}, "name"),
        ({}, "name"),
        ({"name": "digits", "colour": 1}, "colour"),
        ({"name": "digits", "subset": 5000}, "subset"),
        ({"name": "mnist", "root": 3}, "root"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_dataset(options, seed=0)
        assert e.value.key == key


def write_float_idx(path: Path, array: np.ndarray) -> None:
    """An IDX file of big-endian float32 ``array`` (type code 0x0D)."""
    header = bytes([0, 0, 0x0D, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(">f4").tobytes())


def test_a_gzip_bomb_idx_is_refused_without_inflating_it(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    body = [z.compress(bytes([0, 0, 8, 3]) + struct.pack(">3I", 1, 28, 28))]
    body += [z.compress(bytes(1 << 20)) for _ in range(100)]  # 100 MB past the 784 declared
    path.write_bytes(b"".join([*body, z.flush()]))
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as e:
            read_idx(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.key == "root" and "more than 784 bytes" in e.value.message
    assert peak < 10 << 20


@pytest.mark.parametrize("bad", [np.nan, 0.5])
def test_idx_labels_must_be_whole_numbers(tmp_path: Path, bad: float) -> None:
    write_idx_dataset(tmp_path, np.random.default_rng(0), gz=False)
    write_float_idx(tmp_path / "train-labels-idx1-ubyte", np.array([bad] + [1.0] * 29))
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": "mnist", "root": str(tmp_path)}, seed=0)
    assert e.value.key == "root" and "whole numbers 0..9" in e.value.message


@pytest.mark.parametrize(
    ("train", "test"),
    [((30, 28, 28), (12, 32, 32)), ((30, 28, 28), (0, 28, 28)), ((30, 0, 0), (12, 0, 0))],
    ids=["shapes-differ", "empty-test", "0x0"],
)
def test_train_and_test_images_must_match_and_be_non_empty(
    tmp_path: Path, train: tuple, test: tuple
) -> None:
    rng = np.random.default_rng(0)
    write_idx_dataset(tmp_path, rng, gz=False)
    for name, shape in [("train", train), ("t10k", test)]:
        write_idx(tmp_path / f"{name}-images-idx3-ubyte", rng.integers(0, 256, shape), gz=False)
        write_idx(tmp_path / f"{name}-labels-idx1-ubyte", rng.integers(0, 10, shape[0]), gz=False)
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": "mnist", "root": str(tmp_path)}, seed=0)
    assert e.value.key == "root" and "share one shape" in e.value.message


@pytest.mark.parametrize(("x", "y"), [((32, 32, 1, 4), [[1]] * 4), ((32, 32, 3, 2), [[1.5], [2]])])
def test_svhn_checks_image_shape_and_labels(tmp_path: Path, x: tuple, y: list) -> None:
    for split in ("train", "test"):
        scipy.io.savemat(tmp_path / f"{split}_32x32.mat", {"X": np.zeros(x, np.uint8), "y": y})
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": "svhn", "root": str(tmp_path)}, seed=0)
    assert e.value.key == "root" and "SVHN" in e.value.message


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist", "cifar10", "svhn"])
def test_a_root_of_an_unknown_user_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": name, "root": "~p2pfl-no-such-user/x"}, seed=0)
    assert e.value.key == "root" and "cannot expand" in e.value.message


# --- partitioners -------------------------------------------------------------------------

LABELS = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 100))


def split(name: str, seed: int = 0, peers: int = 10, labels: np.ndarray = LABELS, **kw):
    return PARTITIONERS.get(name)(labels, peers, np.random.default_rng(seed), **kw)


def entropy(labels: np.ndarray) -> float:
    p = np.bincount(labels, minlength=10) / len(labels)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@pytest.mark.parametrize("name", ["iid", "dirichlet", "shards", "disjoint"])
def test_partition_covers_every_sample_exactly_once(name: str) -> None:
    parts = split(name, peers=5)
    assert len(parts) == 5
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))


@pytest.mark.parametrize("name", ["iid", "dirichlet", "shards", "disjoint", "domain"])
def test_partition_is_seeded(name: str) -> None:
    same = [np.array_equal(a, b) for a, b in zip(split(name, 1), split(name, 1), strict=True)]
    diff = [np.array_equal(a, b) for a, b in zip(split(name, 1), split(name, 2), strict=True)]
    assert all(same) and not all(diff)


def test_partitions_are_shuffled_and_iid_is_even() -> None:
    parts = split("iid", peers=3)
    assert sorted(len(p) for p in parts) == [333, 333, 334]
    assert all(not np.array_equal(p, np.sort(p)) for p in split("disjoint", peers=3))


def test_dirichlet_min_size_and_skew() -> None:
    parts = split("dirichlet", alpha=0.1, min_size=40)
    assert min(len(p) for p in parts) >= 40
    skewed = np.mean([entropy(LABELS[p]) for p in split("dirichlet", alpha=0.05, min_size=1)])
    flat = np.mean([entropy(LABELS[p]) for p in split("dirichlet", alpha=100.0)])
    assert skewed < 1.0 < 2.0 < flat  # log(10) = 2.30 is a uniform label mix


def test_dirichlet_impossible_min_size_fails_fast() -> None:
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        split("dirichlet", peers=20, alpha=0.01, min_size=40)  # ~1 peer per class
    assert e.value.key == "min_size" and "100 tries" in e.value.message
    assert time.perf_counter() - start < 5
    with pytest.raises(ConfigError) as e:
        split("dirichlet", min_size=101)  # 10 peers x 101 > 1000 samples
    assert e.value.key == "min_size"


@pytest.mark.parametrize("alpha", [0.0, -1.0])
def test_dirichlet_rejects_non_positive_alpha(alpha: float) -> None:
    with pytest.raises(ConfigError) as e:
        split("dirichlet", alpha=alpha)
    assert e.value.key == "alpha"


@pytest.mark.parametrize("k", [1, 2, 3])
def test_shards_give_each_peer_k_classes(k: int) -> None:
    parts = split("shards", classes_per_peer=k)
    assert all(len(np.unique(LABELS[p])) == k for p in parts)
    assert len(np.unique(LABELS[np.concatenate(parts)])) == 10  # every class used
    for bad in (0, 11):
        with pytest.raises(ConfigError) as e:
            split("shards", classes_per_peer=bad)
        assert e.value.key == "classes_per_peer"


def test_disjoint_label_sets() -> None:
    sets = [set(LABELS[p].tolist()) for p in split("disjoint", peers=4)]
    assert sorted(len(s) for s in sets) == [2, 2, 3, 3]
    assert all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1 :])
    assert set().union(*sets) == set(range(10))
    with pytest.raises(ConfigError):
        split("disjoint", peers=11)


def test_more_peers_than_samples() -> None:
    for name in ["iid", "dirichlet", "shards", "disjoint", "domain"]:
        with pytest.raises(ConfigError) as e:
            split(name, peers=6, labels=np.arange(5) % 2)
        assert e.value.key == "count" and "only 5 samples" in e.value.message


def test_domain_samples_are_disjoint() -> None:
    parts = split("domain", peers=4, samples_per_peer=100)
    assert [len(p) for p in parts] == [100] * 4
    assert len(np.unique(np.concatenate(parts))) == 400
    with pytest.raises(ConfigError) as e:
        split("domain", peers=4, samples_per_peer=251)
    assert e.value.key == "samples_per_peer"


# --- federated data -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset({"name": "digits"}, seed=0)


def test_domain_rotation_is_exact_rot90(digits: Dataset) -> None:
    options = {"name": "domain", "angles": [0, 90], "val_fraction": 0.0}
    fed = make_federated_data(digits, options, num_peers=4, seed=0)
    n = len(digits.test_y)
    assert fed.test_x.shape == (2 * n, 1, 8, 8)
    assert fed.test_y.tolist() == digits.test_y.tolist() * 2
    assert torch.equal(fed.test_x[:n], digits.test_x)
    assert torch.equal(fed.test_x[n:], torch.rot90(digits.test_x, 1, dims=(2, 3)))
    assert torch.allclose(TF.rotate(digits.test_x, 90), fed.test_x[n:])  # same direction
    originals = {row.numpy().tobytes() for row in digits.train_x}
    for i, peer in enumerate(fed.peers):
        back = torch.rot90(peer.train_x, -(i % 2), dims=(2, 3))
        assert all(row.numpy().tobytes() in originals for row in back)
    assert sum(p.num_train for p in fed.peers) == 4 * (len(digits.train_y) // 4)


@pytest.mark.parametrize("fraction", [0.1, 0.0])
def test_domain_rotation_turns_each_peers_images(digits: Dataset, fraction: float) -> None:
    """A peer's training and validation images are its unrotated ones turned by its angle
    (bilinear for 30 degrees), also where a peer holds no validation images."""

    def split_with(angles: list[int]) -> list:
        options = {"name": "domain", "angles": angles, "val_fraction": fraction}
        return make_federated_data(digits, options, num_peers=3, seed=0).peers

    fill = digits.train_x.amin(dim=(0, 2, 3)).tolist()
    for still, turned in zip(split_with([0]), split_with([30]), strict=True):
        assert torch.equal(turned.train_x, rotate(still.train_x, 30, fill))
        assert torch.equal(turned.train_y, still.train_y)
        assert len(turned.val_x) == len(still.val_x) == (47 if fraction else 0)
        if fraction:
            assert torch.equal(turned.val_x, rotate(still.val_x, 30, fill))
        assert not torch.equal(turned.train_x, still.train_x)


def test_domain_default_angles(digits: Dataset) -> None:
    fed = make_federated_data(digits, {"name": "domain"}, num_peers=4, seed=0)
    assert fed.test_x.shape[0] == 4 * len(digits.test_y)
    quarter = len(digits.test_y)
    assert not torch.equal(fed.test_x[quarter : 2 * quarter], digits.test_x)  # 15 degrees


@pytest.mark.parametrize(("fraction", "expected"), [(0.1, 28), (0.0, 0), (0.5, 143)])
def test_validation_split(digits: Dataset, fraction: float, expected: int) -> None:
    options = {"name": "iid", "val_fraction": fraction}
    fed = make_federated_data(digits, options, num_peers=5, seed=0)  # 287 or 288 each
    assert all(len(p.val_y) in (expected, expected + 1) for p in fed.peers)
    for peer, row in zip(fed.peers, fed.counts, strict=True):
        assert len(peer.val_y) == int(fraction * row.sum())
        both = torch.cat([peer.train_y, peer.val_y])
        assert np.bincount(both.numpy(), minlength=10).tolist() == row.tolist()
    assert fed.counts.sum() == len(digits.train_y)


def test_validation_split_keeps_one_sample(digits: Dataset) -> None:
    tiny = load_dataset({"name": "digits", "subset": 6}, seed=0)
    fed = make_federated_data(tiny, {"name": "iid", "val_fraction": 0.1}, num_peers=3, seed=0)
    assert [(p.num_train, len(p.val_y)) for p in fed.peers] == [(1, 1)] * 3


def test_federated_data_is_seeded(digits: Dataset) -> None:
    def make(seed: int):
        return make_federated_data(digits, {"name": "dirichlet"}, num_peers=5, seed=seed)

    a, b, c = make(3), make(3), make(4)
    assert np.array_equal(a.counts, b.counts) and not np.array_equal(a.counts, c.counts)
    assert torch.equal(a.peers[0].train_x, b.peers[0].train_x)
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10


def test_partition_seed_fixes_the_split_across_run_seeds(digits: Dataset) -> None:
    def make(run_seed: int, split_seed: int):
        options = {"name": "dirichlet", "seed": split_seed}
        return make_federated_data(digits, options, num_peers=5, seed=run_seed).counts

    assert np.array_equal(make(0, 3), make(1, 3))
    assert not np.array_equal(make(0, 3), make(0, 4))


def test_partition_seed_reproduces_the_fedfisher_reference_split() -> None:
    """The FedFisher authors' code seeds numpy's global RNG with 3, draws one
    Dir(alpha) class mix per client, then per class shuffles that class's indices and cuts
    them by q_ik / sum_j q_jk, then shuffles each client's list."""
    labels = np.random.default_rng(1).integers(0, 10, 3000)
    np.random.seed(3)
    q = np.array([np.random.dirichlet(np.repeat(0.1, 10)) for _ in range(5)])
    clients: list[list[int]] = [[] for _ in range(5)]
    for k in range(10):
        idx = np.where(labels == k)[0]
        np.random.shuffle(idx)
        cuts = (np.cumsum(q[:, k] / q[:, k].sum()) * len(idx)).astype(int)[:-1]
        for c, chunk in zip(clients, np.split(idx, cuts), strict=True):
            c += chunk.tolist()
    for c in clients:
        np.random.shuffle(c)

    rng = SplitOptions(seed=3).rng(run_seed=0)
    ours = PARTITIONERS.get("peer_dirichlet")(labels, 5, rng, alpha=0.1, min_size=0)
    assert [p.tolist() for p in ours] == clients


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"name": "nope"}, "name"),
        ({"name": "iid", "alpha": 1.0}, "alpha"),
        ({"name": "dirichlet", "alpha": "big"}, "alpha"),
        ({"name": "iid", "val_fraction": 1.0}, "val_fraction"),
        ({"name": "iid", "val_fraction": -0.1}, "val_fraction"),
        ({"name": "iid", "seed": -1}, "seed"),
        ({"name": "iid", "seed": 1.5}, "seed"),
    ],
)
def test_partition_option_errors(digits: Dataset, options: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        make_federated_data(digits, options, num_peers=5, seed=0)
    assert e.value.key == key


def test_save_partition(digits: Dataset, tmp_path: Path) -> None:
    fed = make_federated_data(digits, {"name": "dirichlet"}, num_peers=5, seed=0)
    save_partition(fed, tmp_path / "out")
    with (tmp_path / "out" / "partition.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["peer", *(f"class_{c}" for c in range(10)), "total"]
    assert len(rows) == 5 and sum(int(r["total"]) for r in rows) == len(digits.train_y)
    assert all(int(r["total"]) == sum(int(r[f"class_{c}"]) for c in range(10)) for r in rows)
    png = (tmp_path / "out" / "partition.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_tiny_alpha_with_a_legacy_seed_keeps_the_skew_and_the_cap() -> None:
    """RandomState.dirichlet draws NaN for alpha below ~1e-3: the NaNs count as zeros."""
    labels = np.repeat(np.arange(10), 100)
    parts = PARTITIONERS.get("dirichlet")(labels, 5, np.random.RandomState(0), alpha=1e-5)
    assert max(len(p) for p in parts) <= 200 + 100  # a full peer takes no more classes
    rng = np.random.RandomState(0)  # draws two NaN rows (peers 0 and 2) out of five
    parts = PARTITIONERS.get("peer_dirichlet")(labels, 5, rng, alpha=1e-4, min_size=0)
    assert sorted(len(p) for p in parts) != [200] * 5  # not the even fallback for every class


def test_shards_refuse_to_leave_classes_unused() -> None:
    with pytest.raises(ConfigError) as e:
        split("shards", peers=4, classes_per_peer=2)
    assert e.value.key == "classes_per_peer" and "leave 2 of the 10 classes" in e.value.message


def test_a_val_fraction_leaving_a_peer_no_training_samples_names_it() -> None:
    tiny = load_dataset({"name": "digits", "subset": 30}, seed=0)
    options = {"name": "iid", "val_fraction": 0.99999999999}
    with pytest.raises(ConfigError) as e:
        make_federated_data(tiny, options, num_peers=3, seed=0)
    assert e.value.key == "val_fraction" and "peer 0 (10 samples)" in e.value.message
