"""``dataset: {download: true}``: torchvision's own downloader, against a server on loopback.

Each test builds small archives in the official formats (gzipped IDX files, the CIFAR
python pickles in their tar.gz, SVHN's .mat files, EMNIST's zip of gzipped IDX files),
serves them with ``http.server`` on 127.0.0.1 and points torchvision's dataset classes at
it by their own attributes (``mirrors``/``resources``, ``url`` and the md5 sums): the
download, checksum and extraction code that runs is torchvision's. Nothing needs the
internet.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import pickle
import struct
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torchvision.datasets as tv
import yaml

import p2pfl
from conftest import BASE, ROOT, run_cli
from p2pfl.app.config import resolve
from p2pfl.core.errors import ConfigError
from p2pfl.data.datasets import load_dataset

N_TRAIN, N_TEST = 40, 20


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def idx(array: np.ndarray) -> bytes:
    """An IDX file (uint8) of ``array``."""
    head = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return head + array.astype(np.uint8).tobytes()


def images(n: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


def labels(n: int, low: int, high: int, seed: int) -> np.ndarray:
    return (np.arange(n) % (high - low + 1) + low).astype(np.uint8)[
        np.random.default_rng(seed).permutation(n)
    ]


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An HTTP server on loopback serving the folder it returns (empty at first)."""
    served = tmp_path / "served"
    served.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    handler = partial(Quiet, directory=str(served))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", served
    finally:
        httpd.shutdown()
        httpd.server_close()


def serve_mnist(
    monkeypatch: pytest.MonkeyPatch, url: str, served: Path, cls: type = tv.MNIST
) -> np.ndarray:
    """MNIST's four gzipped IDX files on the server; torchvision's MNIST (or ``cls``, which
    shares its format: Fashion-MNIST) pointed at them. Returns the train images."""
    train_x, test_x = images(N_TRAIN, (28, 28), 1), images(N_TEST, (28, 28), 2)
    files = {
        "train-images-idx3-ubyte.gz": idx(train_x),
        "train-labels-idx1-ubyte.gz": idx(labels(N_TRAIN, 0, 9, 3)),
        "t10k-images-idx3-ubyte.gz": idx(test_x),
        "t10k-labels-idx1-ubyte.gz": idx(labels(N_TEST, 0, 9, 4)),
    }
    resources = []
    for name, raw in files.items():
        data = gzip.compress(raw, mtime=0)
        (served / name).write_bytes(data)
        resources.append((name, md5(data)))
    monkeypatch.setattr(cls, "mirrors", [url])
    monkeypatch.setattr(cls, "resources", resources)
    return train_x


def serve_fashion_mnist(monkeypatch: pytest.MonkeyPatch, url: str, served: Path) -> np.ndarray:
    return serve_mnist(monkeypatch, url, served, tv.FashionMNIST)


def cifar_tar(folder: str, members: dict[str, dict[str, Any]]) -> tuple[bytes, dict[str, str]]:
    """A tar.gz of pickled CIFAR files under ``folder``; also each member's md5."""
    buf, sums = io.BytesIO(), {}
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, entry in members.items():
            data = pickle.dumps(entry)
            sums[name] = md5(data)
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), sums


def serve_cifar10(monkeypatch: pytest.MonkeyPatch, url: str, served: Path) -> None:
    batch = {"data": images(8, (3072,), 5), "labels": list(labels(8, 0, 9, 6))}
    members = {f"data_batch_{i}": batch for i in range(1, 6)}
    members["test_batch"] = batch
    members["batches.meta"] = {"label_names": [str(i) for i in range(10)]}
    archive, sums = cifar_tar("cifar-10-batches-py", members)
    (served / "cifar-10-python.tar.gz").write_bytes(archive)
    monkeypatch.setattr(tv.CIFAR10, "url", f"{url}cifar-10-python.tar.gz")
    monkeypatch.setattr(tv.CIFAR10, "tgz_md5", md5(archive))
    monkeypatch.setattr(
        tv.CIFAR10,
        "train_list",
        [[f"data_batch_{i}", sums[f"data_batch_{i}"]] for i in range(1, 6)],
    )
    monkeypatch.setattr(tv.CIFAR10, "test_list", [["test_batch", sums["test_batch"]]])
    meta = {"filename": "batches.meta", "key": "label_names", "md5": sums["batches.meta"]}
    monkeypatch.setattr(tv.CIFAR10, "meta", meta)


def serve_cifar100(monkeypatch: pytest.MonkeyPatch, url: str, served: Path) -> None:
    def part(n: int, seed: int) -> dict[str, Any]:
        return {
            "data": images(n, (3072,), seed),
            "fine_labels": list(labels(n, 0, 99, seed)),
            "coarse_labels": list(labels(n, 0, 19, seed)),
        }

    members = {"train": part(30, 7), "test": part(10, 8)}
    members["meta"] = {"fine_label_names": [str(i) for i in range(100)]}
    archive, sums = cifar_tar("cifar-100-python", members)
    (served / "cifar-100-python.tar.gz").write_bytes(archive)
    monkeypatch.setattr(tv.CIFAR100, "url", f"{url}cifar-100-python.tar.gz")
    monkeypatch.setattr(tv.CIFAR100, "tgz_md5", md5(archive))
    monkeypatch.setattr(tv.CIFAR100, "train_list", [["train", sums["train"]]])
    monkeypatch.setattr(tv.CIFAR100, "test_list", [["test", sums["test"]]])
    meta = {"filename": "meta", "key": "fine_label_names", "md5": sums["meta"]}
    monkeypatch.setattr(tv.CIFAR100, "meta", meta)


def serve_svhn(monkeypatch: pytest.MonkeyPatch, url: str, served: Path) -> None:
    import scipy.io

    split_list = dict(tv.SVHN.split_list)
    for split, n in (("train", 12), ("test", 6)):
        buf = io.BytesIO()
        x = images(n, (32, 32, 3), 9).transpose(1, 2, 3, 0)
        scipy.io.savemat(buf, {"X": x, "y": labels(n, 1, 10, 10).reshape(-1, 1)})
        name = f"{split}_32x32.mat"
        (served / name).write_bytes(buf.getvalue())
        split_list[split] = [f"{url}{name}", name, md5(buf.getvalue())]
    monkeypatch.setattr(tv.SVHN, "split_list", split_list)


def serve_emnist(monkeypatch: pytest.MonkeyPatch, url: str, served: Path) -> np.ndarray:
    """EMNIST's zip (gzip/emnist-SPLIT-*.gz) with the ``letters`` split (labels 1..26)."""
    train_x = images(N_TRAIN, (28, 28), 11)
    parts = {
        "train-images-idx3-ubyte": idx(train_x),
        "train-labels-idx1-ubyte": idx(labels(N_TRAIN, 1, 26, 12)),
        "test-images-idx3-ubyte": idx(images(N_TEST, (28, 28), 13)),
        "test-labels-idx1-ubyte": idx(labels(N_TEST, 1, 26, 14)),
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, raw in parts.items():
            z.writestr(f"gzip/emnist-letters-{name}.gz", gzip.compress(raw, mtime=0))
    (served / "gzip.zip").write_bytes(buf.getvalue())
    monkeypatch.setattr(tv.EMNIST, "url", f"{url}gzip.zip")
    monkeypatch.setattr(tv.EMNIST, "md5", md5(buf.getvalue()))
    return train_x


def test_mnist_downloads_through_torchvision_then_reads_offline(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, served = server
    train_x = serve_mnist(monkeypatch, url, served)
    root = tmp_path / "data" / "deeper"  # created by the download
    d = load_dataset({"name": "mnist", "root": str(root), "download": True}, seed=0)
    assert d.train_x.shape == (N_TRAIN, 1, 28, 28) and d.test_x.shape == (N_TEST, 1, 28, 28)
    expected = (train_x.astype(np.float32) / 255 - 0.1307) / 0.3081
    assert np.allclose(d.train_x[:, 0].numpy(), expected, atol=1e-6)
    assert (root / "MNIST" / "raw" / "train-images-idx3-ubyte.gz").is_file()
    assert not [p for p in root.iterdir() if p.name.startswith(".p2pfl-download")]
    # the files are there: the same data without download, and with it nothing is fetched
    for name in list(served.iterdir()):
        name.unlink()
    again = load_dataset({"name": "mnist", "root": str(root), "download": True}, seed=0)
    assert again.train_x.equal(d.train_x)


@pytest.mark.parametrize(
    ("name", "serve", "shape", "classes", "keys"),
    [
        ("fashion_mnist", serve_fashion_mnist, (40, 1, 28, 28), 10, {}),
        ("cifar10", serve_cifar10, (40, 3, 32, 32), 10, {}),
        ("cifar100", serve_cifar100, (30, 3, 32, 32), 100, {}),
        ("cifar100", serve_cifar100, (30, 3, 32, 32), 20, {"labels": "coarse"}),
        ("svhn", serve_svhn, (12, 3, 32, 32), 10, {}),
        ("emnist", serve_emnist, (40, 1, 28, 28), 26, {"split": "letters"}),
    ],
)
def test_each_dataset_downloads_in_its_official_format(
    server: tuple[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    serve: Any,
    shape: tuple[int, ...],
    classes: int,
    keys: dict[str, str],
) -> None:
    url, served = server
    serve(monkeypatch, url, served)
    options = {"name": name, "root": str(tmp_path / "root"), "download": True} | keys
    d = load_dataset(options, seed=0)
    assert tuple(d.train_x.shape) == shape and d.num_classes == classes
    assert int(d.train_y.min()) >= 0 and int(d.train_y.max()) < classes
    assert int(d.test_y.max()) < classes


def test_emnist_images_are_turned_upright(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, served = server
    train_x = serve_emnist(monkeypatch, url, served)
    d = load_dataset(
        {"name": "emnist", "root": str(tmp_path), "split": "letters", "download": True}, seed=0
    )
    # normalisation is affine and increasing: each image is the file's, transposed
    got = d.train_x[:, 0].numpy().reshape(N_TRAIN, -1)
    upright = train_x.transpose(0, 2, 1).reshape(N_TRAIN, -1).astype(np.float64)
    slope, intercept = np.polyfit(upright.ravel(), got.ravel(), 1)
    assert slope > 0 and np.allclose(got, upright * slope + intercept, atol=1e-4)
    stored = train_x.reshape(N_TRAIN, -1) * slope + intercept  # as the file holds them
    assert not np.allclose(got, stored, atol=1e-4)


def test_no_download_key_fetches_nothing(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, served = server
    serve_mnist(monkeypatch, url, served)
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": "mnist", "root": str(tmp_path / "r")}, seed=0)
    assert e.value.key == "root" and "download: true" in e.value.message
    assert not (tmp_path / "r").exists()


def test_a_failed_download_names_the_url_and_root_and_leaves_nothing(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, served = server
    serve_mnist(monkeypatch, url, served)
    (served / "t10k-labels-idx1-ubyte.gz").unlink()  # the last file: a 404 after three arrived
    root = tmp_path / "new" / "root"
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": "mnist", "root": str(root), "download": True}, seed=0)
    assert e.value.key == "download"
    assert f"{url}train-images-idx3-ubyte.gz" in e.value.message and str(root) in e.value.message
    assert not (tmp_path / "new").exists()  # the folders it made are gone with the files


def test_a_bad_checksum_is_a_failed_download(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, served = server
    serve_cifar10(monkeypatch, url, served)
    monkeypatch.setattr(tv.CIFAR10, "tgz_md5", "0" * 32)
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": "cifar10", "root": str(root), "download": True}, seed=0)
    assert e.value.key == "download" and "cifar-10-python.tar.gz" in e.value.message
    assert root.is_dir() and not list(root.iterdir())  # a root that was there stays, empty


def test_cli_failed_download_is_one_error_line_exit_2_nothing_written(
    server: tuple[str, Path], tmp_path: Path
) -> None:
    """Over the command line: a plug-in points torchvision's MNIST at the local server,
    which has none of its files."""
    url, _ = server
    plugin = tmp_path / "local_mirror.py"
    plugin.write_text(f"import torchvision.datasets as tv\ntv.MNIST.mirrors = [{url!r}]\n")
    root, out = tmp_path / "mnist-root", tmp_path / "out"
    config = BASE | {
        "dataset": {"name": "mnist", "root": str(root), "download": True},
        "plugins": [str(plugin)],
    }
    r = run_cli(tmp_path / "exp.yaml", config, out)
    assert r.returncode == 2, r.stderr
    # (under load, a note that the plug-in's import of torchvision is slow may come first)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and r.stderr.strip().splitlines()[-1] == errors[0]
    assert "dataset.download" in errors[0] and url in errors[0] and str(root) in errors[0]
    assert not out.exists() and not root.exists()


@pytest.mark.slow  # 4 s: a command line (test_no_download_key_fetches_nothing is in-process)
def test_missing_root_without_download_exits_2(tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = BASE | {"dataset": {"name": "cifar100", "root": str(tmp_path / "none")}}
    r = run_cli(tmp_path / "exp.yaml", config, out)
    assert r.returncode == 2 and "dataset.root" in r.stderr and "download: true" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
    assert ROOT.is_dir()


# --- the seed papers' recipes (experiments/papers/) ----------------------------------------

RECIPES = sorted((ROOT / "experiments" / "papers").glob("*.yaml"))


@pytest.fixture(scope="module")
def local_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root holding small MNIST, CIFAR-10 and SVHN sets in torchvision's layouts (3,000
    train and 200 test images each: FedInit's 100 clients need 10 samples each at
    Dirichlet 0.1), so a recipe finds its files and downloads nothing."""
    import scipy.io

    root = tmp_path_factory.mktemp("data")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    n, m = 3000, 200
    for name, array in (
        ("train-images-idx3-ubyte.gz", images(n, (28, 28), 21)),
        ("train-labels-idx1-ubyte.gz", labels(n, 0, 9, 22)),
        ("t10k-images-idx3-ubyte.gz", images(m, (28, 28), 23)),
        ("t10k-labels-idx1-ubyte.gz", labels(m, 0, 9, 24)),
    ):
        (raw / name).write_bytes(gzip.compress(idx(array), mtime=0))
    cifar = root / "cifar-10-batches-py"
    cifar.mkdir()
    for i in range(1, 6):
        batch = {"data": images(n // 5, (3072,), 30 + i), "labels": list(labels(n // 5, 0, 9, i))}
        (cifar / f"data_batch_{i}").write_bytes(pickle.dumps(batch))
    test = {"data": images(m, (3072,), 40), "labels": list(labels(m, 0, 9, 41))}
    (cifar / "test_batch").write_bytes(pickle.dumps(test))
    for split, count in (("train", n), ("test", m)):
        x = images(count, (32, 32, 3), 50).transpose(1, 2, 3, 0)
        y = labels(count, 1, 10, 51).reshape(-1, 1)
        scipy.io.savemat(root / f"{split}_32x32.mat", {"X": x, "y": y})
    return root


def test_every_recipe_says_what_it_reproduces_and_downloads() -> None:
    assert len(RECIPES) >= 5
    for path in RECIPES:
        text = path.read_text()
        config = yaml.safe_load(text)
        head = text.split("\nname:")[0]
        assert "Table" in head or "Fig" in head, path.name  # what of the paper it reproduces
        assert config["dataset"]["download"] is True and "sweep" in config, path.name
        resolve({k: v for k, v in config.items() if k != "sweep"}, path)  # every key known


@pytest.mark.slow  # 40 s: every cell of every recipe built (ResNet-18s among them)
@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_resolves_and_prices(path: Path, local_data: Path, tmp_path: Path) -> None:
    """Every cell of the recipe's sweep is checked and its cost priced (no training) on the
    local root: the keys, the model on the dataset's shapes, the method on its graph."""
    table = p2pfl.cost(path, out=tmp_path / "cost", dataset__root=str(local_data))
    assert int(table["total_bytes"].dropna().iloc[0]) > 0


SHRINK: dict[str, dict[str, Any]] = {
    # per method: its keys that set the work, cut to a couple of rounds of a few steps
    "fedelmy": {"pool_size": 2, "warmup_epochs": 1},
    "fedfisher": {"steps": 20, "val_every": 10},
    "fedavg": {"rounds": 2},
    "maecho": {"tau": 5},
}


@pytest.mark.slow  # 20 min at load 10 with 10 peers (FedELMY's ResNet-18s 4-6 min each): now 4
@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_runs_a_couple_of_rounds_on_a_subset(
    path: Path, local_data: Path, tmp_path: Path
) -> None:
    config = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "sweep"}
    config["dataset"] |= {"root": str(local_data), "subset": 600, "test_subset": 100}
    config["peers"] = config["peers"] | {"count": min(config["peers"]["count"], 4)}
    config["algorithm"] |= SHRINK.get(config["algorithm"]["name"], {})
    config["train"] |= {"epochs": 1}
    if "matching" in config.get("eval", {}):
        config["eval"]["matching"] = {"peers": 2, "epochs": 1, "samples": 50}
    result = p2pfl.run(config, out=tmp_path / "run")
    assert result.summary["status"] == "ok"
    assert 0 <= result.summary["final"]["accuracy"] <= 1
    comm = result.comm
    assert int(comm["bytes"].sum()) == result.summary["comm"]["total_bytes"] > 0


def test_fashion_mnist_downloads_only_into_a_root() -> None:
    """Its default is the Debian package's read-only folder: a download needs a root."""
    with pytest.raises(ConfigError) as e:
        load_dataset({"name": "fashion_mnist", "download": True}, seed=0)
    assert e.value.key == "download" and "needs root" in e.value.message
