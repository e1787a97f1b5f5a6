"""What a ``p2pfl run`` command costs besides its run: what it imports, the data it inflates
again, how it exits (benchmarks/startup.py and benchmarks/vs_flower.py time it; these tests
hold the behaviour those times rest on, not the times)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import BASE, ROOT
from p2pfl.app.cli import ALLOCATOR, on_glibc
from p2pfl.data.datasets import CACHE_VERSION, cache_dir, read_idx
from p2pfl.runtime.children import STANDBY, Standby, take_standby

HEAVY = ("matplotlib", "pandas", "sklearn", "scipy", "torchvision", "tensorboard", "PIL")
"""Libraries a run itself never uses: plots, tables, other datasets' formats."""


def imported_after(code: str, env: dict[str, str] | None = None) -> dict[str, bool]:
    """Run ``code`` in a fresh interpreter: which of :data:`HEAVY` (and torch, tqdm) it
    imported."""
    names = [*HEAVY, "torch", "tqdm"]
    probe = (
        f"{code}\nimport json, sys\nprint(json.dumps({{n: n in sys.modules for n in {names!r}}}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
        env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_command_line_imports_nothing_heavy_before_it_knows_the_command():
    """``p2pfl --help`` and every argument check run before torch and the plotting and
    table libraries are imported."""
    assert not any(imported_after("import p2pfl.app.cli").values())


@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_draws_its_partition_in_a_child_and_never_imports_matplotlib(tmp_path, workers):
    """``p2pfl run`` (alone, or rank 0 of ``--workers 2``) draws partition.png in a forked
    child while the run goes on: the command's own process imports no plotting, table or
    image library, and the figure is there when the command returns."""
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(BASE | {"algorithm": {"name": "fedavg", "rounds": 1}}))
    out = tmp_path / "out"
    args = ["run", str(exp), "--out", str(out), "--quiet", "--workers", str(workers)]
    code = f"from p2pfl.app.cli import main\nassert main({args!r}) == 0"
    imported = imported_after(code, os.environ | {"OMP_NUM_THREADS": "1"})
    assert imported["torch"]
    assert not any(imported[n] for n in HEAVY), imported
    assert (out / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"


def program(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``code``, then ``p2pfl --help`` through :func:`p2pfl.app.cli.program` (the console
    script's entry), in a fresh interpreter."""
    entry = "import sys\nfrom p2pfl.app.cli import program\nsys.argv = ['p2pfl', '--help']"
    probe = f"{code}\n{entry}\nprogram()"
    return subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60,
        env=env,
    )  # fmt: skip


@pytest.mark.skipif(not on_glibc(), reason="glibc only")
def test_the_program_starts_again_under_its_allocator_unless_the_user_set_one():
    """Once, with ``GLIBC_TUNABLES`` set to :data:`~p2pfl.app.cli.ALLOCATOR` (the code
    before the program runs twice, its exit handler once); a user's own setting, even
    empty, is kept and the program starts once."""
    code = (
        "import atexit, os\nprint('start', flush=True)\n"
        "atexit.register(lambda: print('tunables', repr(os.environ.get('GLIBC_TUNABLES'))))"
    )
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    own_setting = "glibc.malloc.mxfast=64"
    for own, starts, seen in [(None, 2, ALLOCATOR), ("", 1, ""), (own_setting, 1, own_setting)]:
        done = program(code, env if own is None else env | {"GLIBC_TUNABLES": own})
        out = done.stdout
        assert done.returncode == 0, done.stderr
        assert out.count("start\n") == starts and out.rstrip().endswith(f"tunables {seen!r}"), out


def test_the_program_runs_exit_handlers_and_flushes_before_it_leaves():
    """The program ends without the interpreter's teardown, but not without what a user's
    or a library's exit handlers write, nor its own buffered output."""
    done = program("import atexit\natexit.register(lambda: print('handler ran'))")
    assert done.returncode == 0, done.stderr
    assert "usage: p2pfl" in done.stdout and done.stdout.rstrip().endswith("handler ran")


def test_the_program_waits_for_a_thread_still_running():
    """A thread other than a daemon that is still running is waited for, as the
    interpreter's own exit does: what it writes at its end is not lost."""
    code = (
        "import threading, time\n"
        "def late():\n    time.sleep(0.5)\n    print('thread done', flush=True)\n"
        "threading.Thread(target=late).start()"
    )
    done = program(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("thread done")


def test_a_failed_command_keeps_its_exit_status(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "p2pfl", "run", str(tmp_path / "missing.yaml")],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error:")


# --- the cache of inflated IDX files --------------------------------------------------


def idx_gz(path: Path, array: np.ndarray) -> bytes:
    """Write ``array`` (uint8) as a gzipped IDX file at ``path``; its compressed bytes."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    packed = gzip.compress(header + array.tobytes(), mtime=0)
    path.write_bytes(packed)
    return packed


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty user cache (``XDG_CACHE_HOME``): the folder where IDX arrays are kept."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "p2pfl" / f"idx-v{CACHE_VERSION}"


def test_an_inflated_idx_file_is_kept_under_its_content_hash_and_read_back(tmp_path, cache):
    images = np.random.default_rng(0).integers(0, 256, (50, 28, 28), dtype=np.uint8)
    packed = idx_gz(tmp_path / "a.gz", images)
    first = read_idx(tmp_path / "a.gz")
    entry = cache / f"{hashlib.sha256(packed).hexdigest()}.npy"
    assert sorted(p.name for p in cache.iterdir()) == [entry.name]  # no temporary file left
    assert np.array_equal(np.load(entry), images)
    # the next read is the kept array: shown by a different one put in its place
    np.save(entry, images[::-1].copy())
    again = read_idx(tmp_path / "a.gz")
    assert np.array_equal(first, images) and np.array_equal(again, images[::-1])
    assert again.dtype == first.dtype == np.uint8 and again.shape == first.shape


def test_the_cache_follows_the_content_not_the_path(tmp_path, cache):
    """The same bytes under another name are one entry; new bytes under the same name are
    read afresh, never served from the old entry."""
    rng = np.random.default_rng(1)
    a, b = (rng.integers(0, 256, (20, 4, 4), dtype=np.uint8) for _ in range(2))
    idx_gz(tmp_path / "x.gz", a)
    idx_gz(tmp_path / "y.gz", a)
    assert np.array_equal(read_idx(tmp_path / "x.gz"), a)
    assert np.array_equal(read_idx(tmp_path / "y.gz"), a)
    assert len(list(cache.iterdir())) == 1
    idx_gz(tmp_path / "x.gz", b)
    assert np.array_equal(read_idx(tmp_path / "x.gz"), b)
    assert len(list(cache.iterdir())) == 2


def test_a_broken_cache_entry_is_made_again(tmp_path, cache):
    images = np.arange(2 * 3 * 5, dtype=np.uint8).reshape(2, 3, 5)
    packed = idx_gz(tmp_path / "a.gz", images)
    read_idx(tmp_path / "a.gz")
    entry = cache / f"{hashlib.sha256(packed).hexdigest()}.npy"
    good = entry.read_bytes()
    for broken in (good[: len(good) // 2], b"", b"not an npy file"):
        entry.write_bytes(broken)
        assert np.array_equal(read_idx(tmp_path / "a.gz"), images)
        assert entry.read_bytes() == good


def test_a_cache_that_cannot_be_written_costs_nothing_but_time(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    images = np.ones((3, 2, 2), dtype=np.uint8)
    idx_gz(tmp_path / "a.gz", images)
    assert np.array_equal(read_idx(tmp_path / "a.gz"), images)


def test_the_cache_is_the_users_own(tmp_path, monkeypatch):
    """``$XDG_CACHE_HOME/p2pfl`` when it is an absolute path (the XDG specification: a
    relative one is ignored), else ``~/.cache/p2pfl``: never the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "p2pfl"
    for ignored in ("relative/cache", ""):
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert cache_dir() == tmp_path / "home" / ".cache" / "p2pfl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "p2pfl"


# --- a child forked before its work is known ---------------------------------------------


def test_a_standby_does_the_job_it_is_given_and_fails_as_it_does(tmp_path):
    """The job reaches the child after it was forked (by name, with its arguments); the
    child's exit status is the job's outcome, as a forked figure's is."""
    prepared = tmp_path / "prepared"
    done = Standby(lambda: prepared.write_text("ready"), "p2pfl-test").give(
        Path.write_text,
        tmp_path / "job",
        "x" * 100_000,  # more than a pipe holds
    )
    assert done.wait(60) == 0
    assert prepared.read_text() == "ready" and (tmp_path / "job").read_text() == "x" * 100_000
    failed = Standby(lambda: None, "p2pfl-test").give(os.rmdir, str(tmp_path / "missing"))
    assert failed.wait(60) == 1


def test_a_standby_given_nothing_is_ended_and_reaped():
    ahead = Standby(lambda: time.sleep(60), "p2pfl-test")
    start = time.monotonic()
    ahead.dismiss()
    assert ahead.returncode is not None and time.monotonic() - start < 10
    with pytest.raises(ChildProcessError):
        os.waitpid(ahead.pid, os.WNOHANG)  # reaped: no zombie left


def test_a_standby_is_taken_once_and_only_by_its_owner(monkeypatch):
    ahead = Standby(lambda: None, "p2pfl-test")
    try:
        monkeypatch.setitem(STANDBY, "figure", ahead)
        monkeypatch.setattr(ahead, "owner", os.getpid() + 1)  # as in a process forked from it
        assert take_standby("figure") is None and STANDBY["figure"] is ahead
        monkeypatch.setattr(ahead, "owner", os.getpid())
        assert take_standby("figure") is ahead and take_standby("figure") is None
    finally:
        ahead.dismiss()
