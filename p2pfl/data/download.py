"""Downloads, only where an experiment says ``download: true``: torchvision's own downloader.

The image loaders of :mod:`p2pfl.data.datasets` read the raw files of torchvision's layouts
themselves. When those files are missing and the ``dataset:`` section sets ``download:
true``, :func:`fetch` has torchvision download them (its URLs, mirrors and md5 checksums,
its extraction) into a fresh folder inside ``root``, then moves what it wrote into ``root``:
a download that fails leaves ``root`` as it was (a ``root`` it had to create is removed) and
is one :class:`ConfigError` naming the URL and the root. torchvision is imported here only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from p2pfl.core.errors import ConfigError


def urls(name: str, split: str = "balanced") -> list[str]:
    """The URLs torchvision downloads ``name`` from (its class attributes: what a test
    points at a local server is what is named here)."""
    import torchvision.datasets as tv

    if name == "mnist":
        return [f"{tv.MNIST.mirrors[0]}{f}" for f, _ in tv.MNIST.resources]
    if name == "fashion_mnist":
        return [f"{tv.FashionMNIST.mirrors[0]}{f}" for f, _ in tv.FashionMNIST.resources]
    if name == "emnist":
        return [tv.EMNIST.url]
    if name == "cifar10":
        return [tv.CIFAR10.url]
    if name == "cifar100":
        return [tv.CIFAR100.url]
    if name == "svhn":
        return [tv.SVHN.split_list[s][0] for s in ("train", "test")]
    raise ValueError(f"no download for {name}")


def _download(name: str, folder: Path, split: str) -> None:
    """Have torchvision download ``name`` into ``folder`` (its layout)."""
    import torchvision.datasets as tv

    where = str(folder)
    if name == "mnist":
        tv.MNIST(where, train=True, download=True)
    elif name == "fashion_mnist":
        tv.FashionMNIST(where, train=True, download=True)
    elif name == "emnist":
        tv.EMNIST(where, split=split, train=True, download=True)
    elif name == "cifar10":
        tv.CIFAR10(where, train=True, download=True)
    elif name == "cifar100":
        tv.CIFAR100(where, train=True, download=True)
    elif name == "svhn":
        for part in ("train", "test"):
            tv.SVHN(where, split=part, download=True)


def fetch(name: str, root: Path, *, split: str = "balanced") -> None:
    """Download dataset ``name`` (``mnist``, ``fashion_mnist``, ``emnist`` with its
    ``split``, ``cifar10``, ``cifar100``, ``svhn``) into ``root`` with torchvision, which
    checks each file's md5.

    Nothing is left behind on failure: torchvision writes into a temporary folder inside
    ``root``, whose contents are moved into ``root`` only once every file arrived.
    """
    created = _missing_parents(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".p2pfl-download-", dir=root))
    except OSError as e:
        _remove(created)
        raise ConfigError("root", f"cannot create a download folder in {root}: {e}") from None
    try:
        _download(name, staging, split)
        _merge(staging, root)
    except Exception as e:  # torchvision raises RuntimeError, URLError, OSError, ...
        reason = " ".join(str(e).split()) or type(e).__name__
        url = " or ".join(urls(name, split)[:1])
        raise ConfigError(
            "download", f"could not download {url} into {root}: {reason[:300]}"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not any(root.iterdir()):
            _remove(created)


def _missing_parents(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    missing: list[Path] = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def _remove(dirs: list[Path]) -> None:
    """Remove the empty folders ``dirs`` (deepest first) that a failed download created."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def _merge(src: Path, dst: Path) -> None:
    """Move every file under ``src`` to the same place under ``dst`` (folders merged; a file
    already there is replaced: torchvision just checked the new one)."""
    for dirpath, _, files in os.walk(src):
        target = dst / Path(dirpath).relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for f in files:
            os.replace(Path(dirpath, f), target / f)


def needs(present: bool, download: bool, name: str, root: Path, **kwargs: Any) -> None:
    """Fetch ``name`` into ``root`` when its files are not ``present`` and ``download`` is
    set; otherwise do nothing (the loader then reports missing files as before)."""
    if download and not present:
        fetch(name, root, **kwargs)
