"""Dataset loaders: offline only, from files already on disk, cached per process.

Each loader is registered in :data:`DATASETS` and its keyword arguments are the keys of the
YAML ``dataset:`` section. Loaders read the raw on-disk formats themselves (IDX, the CIFAR
python pickles, the SVHN ``.mat`` files), laid out as torchvision expects, because
torchvision's classes insist on the md5 of the official archives and may try to download.
scipy is imported only by the loader that needs it (import time); digits reads
scikit-learn's data file without importing scikit-learn. A gzipped IDX file is inflated
once per machine: :func:`read_idx` keeps what it read in the user's cache (see
:func:`cache_dir`), keyed by the compressed file's SHA-256.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import importlib.util
import io
import math
import os
import pickle
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import Registry, bind_with_common
from p2pfl.data.download import needs

DATASETS: Registry[Callable[..., Dataset]] = Registry("dataset")

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
"""Where the Debian package ``dataset-fashion-mnist`` installs its IDX files."""

_SUBSET_TAG = 1  # mixes into the run seed so the subset draw is its own random stream
_TEST_SUBSET_SEED = 0  # the test subset ignores the run seed: every seed sees the same test set

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Raw ``(train_x, train_y, test_x, test_y)``: images integer ``[n, C, H, W]``, labels int64."""


@dataclass
class Dataset:
    """A classification dataset held in memory: images, signals or token sequences."""

    name: str
    train_x: torch.Tensor  # one sample per row: float32 [n, C, H, W] images (normalised), ...
    train_y: torch.Tensor  # int64 [n]
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    # natural groups (Shakespeare's speaking roles, Synthetic's devices): int64 [n] per
    # train (and test) sample, the ``natural`` partition's peers; None where there are none
    train_groups: torch.Tensor | None = None
    test_groups: torch.Tensor | None = None
    group_names: tuple[str, ...] | None = None  # by group index, where groups have names

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample: ``(C, H, W)`` for images."""
        return tuple(self.train_x.shape[1:])

    @property
    def tokens(self) -> bool:
        """Whether samples are token ids (integer sequences such as text) rather than floats."""
        return not self.train_x.is_floating_point()


def load_dataset(options: dict[str, Any], seed: int) -> Dataset:
    """Load the dataset described by the YAML ``dataset:`` mapping (``name`` included).

    Besides the loader's own keys every dataset takes ``subset`` and ``test_subset``
    (see :func:`take_subsets`). Error keys are relative to the ``dataset`` section.
    """
    if "name" not in options:
        raise ConfigError("name", "missing required key")
    rest = {k: v for k, v in options.items() if k != "name"}
    loader = DATASETS.get(options["name"])
    kwargs, common = bind_with_common(loader, take_subsets, rest, common_skip=2)
    if _loaded is None:
        return take_subsets(loader(**kwargs), seed, **common)
    key = repr((options["name"], sorted(kwargs.items())))
    if key not in _loaded:
        _loaded[key] = loader(**kwargs)
    return take_subsets(_loaded[key], seed, **common)


_loaded: dict[str, Dataset] | None = None
"""Datasets by their loader keys while :func:`loaded_once` is active (else no cache)."""


@contextlib.contextmanager
def loaded_once() -> Iterator[None]:
    """Within this block each distinct ``dataset:`` section is loaded and normalised once: a
    sweep builds every cell to check it, then again to run it. Outside, nothing is kept,
    so a single run holds one copy of its data."""
    global _loaded
    outer = _loaded
    _loaded = {} if outer is None else outer
    try:
        yield
    finally:
        _loaded = outer


def take_subsets(
    data: Dataset, seed: int, *, subset: int | None = None, test_subset: int | None = None
) -> Dataset:
    """Keep a random ``subset`` of the train set (seeded by the run seed) and a random
    ``test_subset`` of the test set (fixed, so every seed is scored on the same images).

    Args:
        subset: keep a random subset of this many training samples, drawn from the run's seed (null:
            all).
        test_subset: keep this many test samples, a fixed draw that is the same for every seed
            (null: all).
    """
    train = _pick(len(data.train_y), subset, "subset", [seed, _SUBSET_TAG])
    test = _pick(len(data.test_y), test_subset, "test_subset", [_TEST_SUBSET_SEED])
    return Dataset(
        data.name,
        data.train_x[train],
        data.train_y[train],
        data.test_x[test],
        data.test_y[test],
        data.num_classes,
        None if data.train_groups is None else data.train_groups[train],
        None if data.test_groups is None else data.test_groups[test],
        data.group_names,
    )


def _pick(n: int, size: int | None, key: str, entropy: list[int]) -> slice | torch.Tensor:
    """Sorted random indices of ``size`` out of ``n``, or everything when ``size`` is None."""
    if size is None:
        return slice(None)
    if not 1 <= size <= n:
        raise ConfigError(key, f"must be between 1 and the {n} samples available, got {size}")
    rng = np.random.default_rng(np.random.SeedSequence(entropy))
    return torch.from_numpy(np.sort(rng.choice(n, size, replace=False)))


def _to_dataset(
    name: str,
    arrays: Arrays,
    scale: float,
    mean: Sequence[float],
    std: Sequence[float],
    num_classes: int = 10,
) -> Dataset:
    """Scale integer images to [0, 1] and normalise each channel with ``mean``/``std``."""
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def images(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x.astype(np.float32)).div_(scale).sub_(m).div_(s)

    train_x, train_y, test_x, test_y = arrays
    shape = train_x.shape[1:]
    if test_x.shape[1:] != shape or min(shape[1:]) < 1 or not len(train_x) or not len(test_x):
        raise ConfigError(
            "root",
            f"{name}: train images {list(train_x.shape)} and test images "
            f"{list(test_x.shape)} must share one shape [C, H, W] with H, W >= 1 and "
            "hold at least one image each",
        )
    return Dataset(
        name,
        images(train_x),
        torch.from_numpy(train_y.astype(np.int64)),
        images(test_x),
        torch.from_numpy(test_y.astype(np.int64)),
        num_classes=num_classes,
    )


def _root(root: str) -> Path:
    """``root`` with ``~`` expanded; an unknown ``~user`` is a ConfigError."""
    try:
        return Path(root).expanduser()
    except RuntimeError as e:
        raise ConfigError("root", f"cannot expand {root!r}: {e}") from None


def _frozen(*arrays: np.ndarray) -> Arrays:
    """Make cached arrays read-only so no caller can corrupt the cache."""
    for a in arrays:
        a.flags.writeable = False
    train_x, train_y, test_x, test_y = arrays
    return train_x, train_y, test_x, test_y


# --- digits ---------------------------------------------------------------------------

DIGITS_TEST = 360  # test samples of the fixed split


@DATASETS.register("digits")
def digits() -> Dataset:
    """scikit-learn's 8x8 digits, 1437 train / 360 test (fixed stratified split)."""
    arrays = _read_digits()
    pixels = arrays[0] / 16.0
    return _to_dataset("digits", arrays, 16.0, [float(pixels.mean())], [float(pixels.std())])


@functools.cache
def _read_digits() -> Arrays:
    """scikit-learn's digits file, read without importing scikit-learn (about 2 s).

    The split is the one ``train_test_split(x, y, test_size=360, stratify=y,
    random_state=0)`` makes, stored in ``digits_split.npy`` (train order, then test order):
    the test set must never change, whatever scikit-learn is installed
    (``tests/test_data.py`` checks the two agree).
    """
    spec = importlib.util.find_spec("sklearn")  # a dependency; found without running it
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    x = data[:, :-1].astype(np.uint8).reshape(-1, 1, 8, 8)
    y = data[:, -1].astype(np.int64)
    order = np.load(Path(__file__).with_name("digits_split.npy")).astype(np.int64)
    train, test = order[:-DIGITS_TEST], order[-DIGITS_TEST:]
    return _frozen(x[train], y[train], x[test], y[test])


# --- IDX: MNIST, Fashion-MNIST ----------------------------------------------------------

_IDX_DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_IDX_DTYPES_SET = frozenset(np.dtype(d) for d in _IDX_DTYPES.values())
_IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file, gzipped or plain; a corrupt or truncated one is a ConfigError.

    A gzipped file is streamed: only the bytes its header declares are inflated (a few more
    show it is too long), so a small file that inflates to gigabytes is never held. What
    it inflates to is kept in :func:`cache_dir` under the compressed bytes' SHA-256, so the
    next read of the same bytes (any path) loads it instead (Fashion-MNIST's training
    images: 0.2 s of inflating for 0.04 s of hashing and loading)."""
    try:
        with path.open("rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        if not gz:
            with path.open("rb") as f:
                return _parse_idx(f, path)
        packed = path.read_bytes()
    except OSError as e:
        raise ConfigError("root", f"cannot read {path}: {e}") from None
    entry = _cache_entry(packed)
    if entry is not None and (cached := _cached(entry)) is not None:
        return cached
    with gzip.GzipFile(fileobj=io.BytesIO(packed), mode="rb") as f:
        array = _parse_idx(f, path)
    if entry is not None:
        _keep(array, entry)
    return array


def _parse_idx(f: Any, path: Path) -> np.ndarray:
    """The IDX array in the open (possibly gzip) stream ``f``, read from ``path``."""
    try:
        magic = f.read(4)
        if len(magic) < 4 or magic[:2] != b"\0\0" or magic[2] not in _IDX_DTYPES:
            raise ConfigError("root", f"{path} is not an IDX file (magic number {magic.hex()})")
        head = f.read(4 * magic[3])
        if len(head) < 4 * magic[3]:
            raise ConfigError("root", f"{path} is truncated (incomplete IDX header)")
        dims = struct.unpack(f">{magic[3]}I", head)
        dtype = np.dtype(_IDX_DTYPES[magic[2]])
        expected = math.prod(dims) * dtype.itemsize
        chunks, got = [], 0
        while got < expected and (chunk := f.read(min(expected - got, 1 << 24))):
            chunks.append(chunk)
            got += len(chunk)
        extra = len(f.read(1 << 16))
    except (OSError, EOFError, zlib.error) as e:
        raise ConfigError("root", f"cannot read {path}: {e}") from None
    if got != expected or extra:
        size = f"{got} bytes" if got < expected else f"more than {expected} bytes"
        raise ConfigError(
            "root",
            f"{path} is truncated or corrupt: {size} of data, expected {expected} "
            f"for shape {list(dims)}",
        )
    return np.frombuffer(b"".join(chunks), dtype).reshape(dims)


CACHE_VERSION = 1
"""Part of every cache entry's folder name: a change to what an entry holds bumps it."""


def cache_dir() -> Path:
    """p2pfl's folder in the user's cache: ``$XDG_CACHE_HOME/p2pfl`` (an absolute
    ``XDG_CACHE_HOME``, per the XDG base directory specification), else
    ``~/.cache/p2pfl``. It only ever holds what can be made again: delete it at will."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "p2pfl"


def _cache_entry(packed: bytes) -> Path | None:
    """Where the array inflated from the gzip bytes ``packed`` is kept (None: no home)."""
    try:
        folder = cache_dir() / f"idx-v{CACHE_VERSION}"
    except RuntimeError:  # no home directory to put it in
        return None
    return folder / f"{hashlib.sha256(packed).hexdigest()}.npy"


def _cached(entry: Path) -> np.ndarray | None:
    """The array kept at ``entry``, or None if there is none or it cannot be read whole
    (it is then made again and replaced)."""
    try:
        array = np.load(entry, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if not isinstance(array, np.ndarray) or array.dtype not in _IDX_DTYPES_SET:
        return None
    return array


def _keep(array: np.ndarray, entry: Path) -> None:
    """Write ``array`` to ``entry`` atomically (a temporary file in the same folder,
    renamed over it): a reader sees the whole entry or none. A cache that cannot be
    written (read-only, full) is left alone: the next read inflates again."""
    tmp: str | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{entry.stem[:16]}-", suffix=".tmp", dir=entry.parent)
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, entry)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _whole(y: np.ndarray, low: int, high: int) -> bool:
    """Whether every label is a whole number in ``low..high`` (NaN is not)."""
    return bool(np.isfinite(y).all() and (y % 1 == 0).all()) and (
        not y.size or low <= y.min() <= y.max() <= high
    )


def _find_idx_files(dirs: list[Path], what: str) -> list[Path]:
    """The four IDX files (each plain or ``.gz``) from the first directory holding all four."""
    for d in dirs:
        found = [_first_file(d / f, d / f"{f}.gz") for f in _IDX_FILES]
        if all(found):
            return [p for p in found if p is not None]
    raise ConfigError(
        "root",
        f"{what} not found: expected files {', '.join(_IDX_FILES)} (each may end in .gz) "
        f"under {' or '.join(str(d) for d in dirs)} (p2pfl never downloads without download: true)",
    )


def _first_file(*paths: Path) -> Path | None:
    return next((p for p in paths if p.is_file()), None)


@functools.cache
def _read_idx_dataset(dirs: tuple[Path, ...], what: str) -> Arrays:
    files = _find_idx_files(list(dirs), what)
    train_x, train_y, test_x, test_y = (read_idx(p) for p in files)
    for x, y, p in ((train_x, train_y, files[0]), (test_x, test_y, files[2])):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y) or x.dtype != np.uint8:
            raise ConfigError(
                "root",
                f"{p.parent}: {what} IDX files must hold uint8 images [n, H, W] and n labels, "
                f"got images {x.dtype} {list(x.shape)} and labels {list(y.shape)}",
            )
        if not _whole(y, 0, 9):
            raise ConfigError("root", f"{p.parent}: {what} labels must be whole numbers 0..9")
    return _frozen(
        train_x[:, None], train_y.astype(np.int64), test_x[:, None], test_y.astype(np.int64)
    )


@DATASETS.register("fashion_mnist")
def fashion_mnist(
    *, root: str | None = None, mean: float = 0.2860, std: float = 0.3530, download: bool = False
) -> Dataset:
    """Fashion-MNIST from IDX files: by default the Debian package ``dataset-fashion-mnist``
    (/usr/share/datasets/fashion-mnist); ``root`` may be a directory of the IDX files or a
    torchvision root (``root/FashionMNIST/raw``). Pixels in [0, 1] are normalised with
    ``mean`` and ``std`` (default: the dataset's own; FedFisher's code uses MNIST's 0.1307
    and 0.3081, which matters for its bias-free networks).

    Args:
        root: a directory of the IDX files or a torchvision root (null: the Debian package's files
            in /usr/share/datasets/fashion-mnist).
        mean: input normalisation: the mean subtracted from pixels in [0, 1] (FedFisher's
            experiments use MNIST's 0.1307).
        std: input normalisation: the standard deviation pixels are divided by (MNIST's: 0.3081).
        download: when the files are missing from ``root`` (which it needs), torchvision
            downloads them there (its URLs and md5 checksums); false: nothing is ever fetched.
    """
    if std <= 0:
        raise ConfigError("std", f"must be > 0, got {std}")
    if download and root is None:
        raise ConfigError("download", "needs root: the directory to download Fashion-MNIST into")
    if root is None:
        dirs: tuple[Path, ...] = (DEBIAN_FASHION_MNIST,)
        what = "Fashion-MNIST (install the Debian package dataset-fashion-mnist or set root)"
    else:
        base = _root(root)
        dirs, what = (base, base / "FashionMNIST" / "raw"), "Fashion-MNIST"
        needs(_idx_present(dirs), download, "fashion_mnist", base)
    return _to_dataset("fashion_mnist", _read_idx_dataset(dirs, what), 255.0, [mean], [std])


@DATASETS.register("mnist")
def mnist(*, root: str, download: bool = False) -> Dataset:
    """MNIST from a torchvision root (``root/MNIST/raw``) or a directory of its IDX files.

    Args:
        root: a torchvision root (``root/MNIST/raw/*-ubyte[.gz]``) or a directory of the IDX files.
        download: when the files are missing, torchvision downloads them into ``root`` (its
            URLs and md5 checksums); false: nothing is ever fetched.
    """
    base = _root(root)
    dirs = (base / "MNIST" / "raw", base)
    needs(_idx_present(dirs), download, "mnist", base)
    arrays = _read_idx_dataset(dirs, "MNIST")
    return _to_dataset("mnist", arrays, 255.0, [0.1307], [0.3081])


def _idx_present(dirs: tuple[Path, ...], names: Sequence[str] = _IDX_FILES) -> bool:
    """Whether one of ``dirs`` holds every file of ``names`` (each plain or ``.gz``)."""
    return any(all(_first_file(d / f, d / f"{f}.gz") for f in names) for d in dirs)


EMNIST_CLASSES = {
    "byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10,
}  # fmt: skip
"""Classes of each EMNIST split (Cohen et al. 2017, Table II)."""


@DATASETS.register("emnist")
def emnist(
    *,
    root: str,
    split: Literal["byclass", "bymerge", "balanced", "letters", "digits", "mnist"] = "balanced",
    download: bool = False,
) -> Dataset:
    """EMNIST (Cohen et al. 2017) from torchvision's layout: the IDX files
    ``emnist-SPLIT-{train,test}-{images-idx3,labels-idx1}-ubyte[.gz]`` in ``root/EMNIST/raw``
    (or ``root``). Images are turned upright (the files hold them transposed); ``letters``'
    labels 1..26 become 0..25. Normalised with the train set's own mean and std.

    Args:
        root: a torchvision root (``root/EMNIST/raw``) or a directory of the split's IDX files.
        split: ``byclass`` (62 classes), ``bymerge`` (47), ``balanced`` (47), ``letters``
            (26), ``digits`` (10) or ``mnist`` (10).
        download: when the split's files are missing, torchvision downloads the EMNIST archive
            (all splits, 535 MB) into ``root`` and extracts it (its URL and md5 checksum);
            false: nothing is ever fetched.
    """
    if split not in EMNIST_CLASSES:
        raise ConfigError("split", f"must be one of {', '.join(EMNIST_CLASSES)}, got {split!r}")
    base = _root(root)
    dirs = (base / "EMNIST" / "raw", base)
    names = _emnist_files(split)
    needs(_idx_present(dirs, names), download, "emnist", base, split=split)
    arrays = _read_emnist(dirs, split)
    pixels = arrays[0][: 1 << 14] / 255.0  # a fixed sample: the statistics of 16k images
    return _to_dataset(
        "emnist", arrays, 255.0, [float(pixels.mean())], [float(pixels.std())],
        num_classes=EMNIST_CLASSES[split],
    )  # fmt: skip


def _emnist_files(split: str) -> tuple[str, ...]:
    """The four IDX files of an EMNIST split, as torchvision names them."""
    return tuple(
        f"emnist-{split}-{part}-{kind}-ubyte"
        for part in ("train", "test")
        for kind in ("images-idx3", "labels-idx1")
    )


@functools.cache
def _read_emnist(dirs: tuple[Path, ...], split: str) -> Arrays:
    names = _emnist_files(split)
    found = next((d for d in dirs if _idx_present((d,), names)), None)
    if found is None:
        raise ConfigError(
            "root",
            f"EMNIST {split} not found: expected files {', '.join(names)} (each may end in "
            f".gz) under {' or '.join(str(d) for d in dirs)} (p2pfl never downloads "
            "without download: true)",
        )
    paths = [_first_file(found / f, found / f"{f}.gz") for f in names]
    train_x, train_y, test_x, test_y = (read_idx(p) for p in paths if p is not None)
    low = 1 if split == "letters" else 0
    for x, y in ((train_x, train_y), (test_x, test_y)):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y) or x.dtype != np.uint8:
            raise ConfigError("root", f"{found}: EMNIST files must hold uint8 images and labels")
        if not _whole(y, low, low + EMNIST_CLASSES[split] - 1):
            raise ConfigError("root", f"{found}: EMNIST {split} labels out of range")
    return _frozen(
        np.ascontiguousarray(train_x.transpose(0, 2, 1))[:, None],
        train_y.astype(np.int64) - low,
        np.ascontiguousarray(test_x.transpose(0, 2, 1))[:, None],
        test_y.astype(np.int64) - low,
    )


# --- CIFAR-10 ---------------------------------------------------------------------------

_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))


@DATASETS.register("cifar10")
def cifar10(*, root: str, download: bool = False) -> Dataset:
    """CIFAR-10 from torchvision's layout: the python pickle batches in
    ``root/cifar-10-batches-py`` (or in ``root`` itself).

    Args:
        root: the directory holding ``cifar-10-batches-py/`` (torchvision's layout) or the batches
            themselves.
        download: when the files are missing, torchvision downloads and extracts the archive
            into ``root`` (its URL and md5 checksum); false: nothing is ever fetched.
    """
    base = _root(root)
    dirs = (base / "cifar-10-batches-py", base)
    present = any(all((d / n).is_file() for n in (*_CIFAR_TRAIN, "test_batch")) for d in dirs)
    needs(present, download, "cifar10", base)
    arrays = _read_cifar10(dirs)
    return _to_dataset("cifar10", arrays, 255.0, [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616])


@functools.cache
def _read_cifar10(dirs: tuple[Path, ...]) -> Arrays:
    names = (*_CIFAR_TRAIN, "test_batch")
    found = next((d for d in dirs if all((d / n).is_file() for n in names)), None)
    if found is None:
        raise ConfigError(
            "root",
            f"CIFAR-10 not found: expected files {', '.join(names)} under "
            f"{' or '.join(str(d) for d in dirs)} (p2pfl never downloads without download: true)",
        )
    train = [_read_cifar_batch(found / n) for n in _CIFAR_TRAIN]
    test_x, test_y = _read_cifar_batch(found / "test_batch")
    train_x = np.concatenate([x for x, _ in train])
    train_y = np.concatenate([y for _, y in train])
    return _frozen(train_x, train_y, test_x, test_y)


def _read_cifar_batch(
    path: Path, key: str = "labels", classes: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR pickle batch (trusted input, as in torchvision): ``data`` uint8
    ``[n, 3072]`` and the labels under ``key`` (CIFAR-100: ``fine_labels``, ``coarse_labels``),
    each below ``classes``."""
    what = "CIFAR-10 batch" if classes == 10 else "CIFAR-100 file"
    try:
        with path.open("rb") as f:
            entry = pickle.load(f, encoding="latin1")
        x = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        y = np.asarray(entry[key], dtype=np.int64)
    except Exception as e:  # a bad pickle can raise almost anything
        raise ConfigError("root", f"{path} is not a {what}: {e!r}") from None
    if len(x) != len(y) or (y.size and not 0 <= y.min() <= y.max() < classes):
        raise ConfigError("root", f"{path}: {what} has bad labels")
    return x, y


# --- CIFAR-100 --------------------------------------------------------------------------


@DATASETS.register("cifar100")
def cifar100(
    *, root: str, labels: Literal["fine", "coarse"] = "fine", download: bool = False
) -> Dataset:
    """CIFAR-100 from torchvision's layout: the python pickles ``train`` and ``test`` in
    ``root/cifar-100-python`` (or in ``root`` itself).

    Args:
        root: the directory holding ``cifar-100-python/`` (torchvision's layout) or the
            pickles themselves.
        labels: ``fine`` (100 classes) or ``coarse`` (the 20 superclasses).
        download: when the files are missing, torchvision downloads and extracts the archive
            into ``root`` (its URL and md5 checksum); false: nothing is ever fetched.
    """
    if labels not in ("fine", "coarse"):
        raise ConfigError("labels", f"must be fine or coarse, got {labels!r}")
    base = _root(root)
    dirs = (base / "cifar-100-python", base)
    present = any(all((d / n).is_file() for n in ("train", "test")) for d in dirs)
    needs(present, download, "cifar100", base)
    arrays = _read_cifar100(dirs, labels)
    mean, std = [0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762]
    return _to_dataset("cifar100", arrays, 255.0, mean, std, 100 if labels == "fine" else 20)


@functools.cache
def _read_cifar100(dirs: tuple[Path, ...], labels: str) -> Arrays:
    found = next((d for d in dirs if all((d / n).is_file() for n in ("train", "test"))), None)
    if found is None:
        raise ConfigError(
            "root",
            f"CIFAR-100 not found: expected files train, test under "
            f"{' or '.join(str(d) for d in dirs)} (p2pfl never downloads without download: true)",
        )
    classes = 100 if labels == "fine" else 20
    (train_x, train_y), (test_x, test_y) = (
        _read_cifar_batch(found / n, f"{labels}_labels", classes) for n in ("train", "test")
    )
    return _frozen(train_x, train_y, test_x, test_y)


# --- SVHN -------------------------------------------------------------------------------


@DATASETS.register("svhn")
def svhn(*, root: str, download: bool = False) -> Dataset:
    """SVHN cropped digits: ``train_32x32.mat`` and ``test_32x32.mat`` in ``root`` (as
    torchvision's SVHN keeps them); label 10 (digit 0) becomes 0.

    Args:
        root: the directory holding ``train_32x32.mat`` and ``test_32x32.mat``.
        download: when the files are missing, torchvision downloads them into ``root`` (its
            URLs and md5 checksums); false: nothing is ever fetched.
    """
    base = _root(root)
    present = all((base / f"{s}_32x32.mat").is_file() for s in ("train", "test"))
    needs(present, download, "svhn", base)
    arrays = _read_svhn(base)
    return _to_dataset("svhn", arrays, 255.0, [0.4377, 0.4438, 0.4728], [0.1980, 0.2010, 0.1970])


@functools.cache
def _read_svhn(root: Path) -> Arrays:
    paths = [root / "train_32x32.mat", root / "test_32x32.mat"]
    if not all(p.is_file() for p in paths):
        raise ConfigError(
            "root",
            f"SVHN not found: expected files train_32x32.mat, test_32x32.mat under {root} "
            "(p2pfl never downloads without download: true)",
        )
    (train_x, train_y), (test_x, test_y) = (_read_svhn_mat(p) for p in paths)
    return _frozen(train_x, train_y, test_x, test_y)


def _read_svhn_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``X`` is uint8 ``[H, W, C, n]``, ``y`` holds labels 1..10 with 10 meaning digit 0."""
    import scipy.io

    try:
        mat = scipy.io.loadmat(path)
        x = np.asarray(mat["X"], dtype=np.uint8)
        y = np.asarray(mat["y"], dtype=np.float64).reshape(-1)
    except Exception as e:  # scipy raises many types for a bad file
        raise ConfigError("root", f"{path} is not an SVHN .mat file: {e!r}") from None
    if x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise ConfigError("root", f"{path}: SVHN X must be [32, 32, 3, n], got {list(x.shape)}")
    x = np.ascontiguousarray(x.transpose(3, 2, 0, 1))
    if len(x) != len(y) or not _whole(y, 1, 10):
        raise ConfigError("root", f"{path}: SVHN labels must be whole numbers 1..10, one per image")
    return x, y.astype(np.int64) % 10
