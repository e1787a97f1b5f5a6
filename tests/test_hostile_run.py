"""Hardening (issue 19): output directories, signals, keys and transport bounds.

Real processes and real signals: a run owns its ``--out`` (refused when in use or holding an
earlier run without ``--force``), SIGINT and SIGTERM end a simulation and a ZeroMQ run with a
strict-JSON ``summary.json`` that says ``interrupted`` and counts what ``comm.csv`` holds, and
no peer process outlives its launcher, whatever kills the launcher.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from conftest import BASE, ROOT, peer_pids
from p2pfl.app.cli import LOCK, main

QUICK = BASE | {"peers": {"count": 4}, "algorithm": {"name": "fedavg", "rounds": 2}}
LONG = BASE | {"peers": {"count": 4}, "algorithm": {"name": "fedavg", "rounds": 100_000}}


def write(tmp_path: Path, config: dict[str, Any], name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:"), err
    assert "Traceback" not in err
    return err


def strict_json(path: Path) -> dict[str, Any]:
    def refuse(name: str) -> None:
        raise AssertionError(f"{path} holds {name}: not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def comm_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --- output directories --------------------------------------------------------------------


def test_a_second_run_into_the_same_directory_is_refused_and_the_first_kept(tmp_path, capsys):
    path, out = write(tmp_path, QUICK), tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 2
    assert "--force" in one_error_line(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_force_replaces_an_earlier_run_and_its_stale_files(tmp_path):
    path, out = write(tmp_path, QUICK), tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 0
    (out / "peers" / "9").mkdir(parents=True)  # an older, larger run's leftovers
    assert main(["run", str(path), "--out", str(out), "--quiet", "--force"]) == 0
    assert not (out / "peers").exists() and (out / "summary.json").is_file()
    assert not (out / LOCK).exists()  # the lock goes with the run


@pytest.mark.parametrize("force", [False, True])
def test_a_directory_that_holds_no_run_is_never_emptied(tmp_path, capsys, force):
    path, out = write(tmp_path, QUICK), tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    args = ["run", str(path), "--out", str(out), "--quiet"] + ["--force"] * force
    assert main(args) == 2
    assert ("holds no p2pfl run" if force else "not empty") in one_error_line(capsys)
    assert (out / "thesis.tex").read_text() == "precious"
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]


@pytest.mark.parametrize("force", [False, True])
def test_a_directory_another_run_is_writing_to_is_refused(tmp_path, capsys, force):
    path, out = write(tmp_path, QUICK), tmp_path / "busy"
    out.mkdir()
    (out / "config.yaml").write_text("name: other\n")
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        args = ["run", str(path), "--out", str(out), "--quiet"] + ["--force"] * force
        assert main(args) == 2
        assert "in use by another p2pfl run" in one_error_line(capsys)
        assert (out / "config.yaml").read_text() == "name: other\n"
    finally:
        os.close(fd)


def test_a_stale_lock_of_a_killed_run_does_not_block(tmp_path):
    path, out = write(tmp_path, QUICK), tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text("")  # left by a run killed with SIGKILL: nobody holds it
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 0


@pytest.mark.parametrize("where", ["file", "below_file"])
def test_an_unusable_out_is_one_line_before_anything_is_loaded(tmp_path, capsys, where):
    path = write(tmp_path, QUICK)
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if where == "file" else blocker / "run"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 2
    assert "is a file" in one_error_line(capsys)


def test_a_sweep_resumes_in_its_directory_but_refuses_a_second_sweep_at_once(tmp_path, capsys):
    config = QUICK | {"sweep": {"seed": [0, 1]}}
    path, out = write(tmp_path, config), tmp_path / "sweep"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 0
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 0  # resume: all done
    with open(out / "cells.csv", newline="") as f:
        assert {r["status"] for r in csv.DictReader(f)} == {"done"}
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        capsys.readouterr()
        assert main(["run", str(path), "--out", str(out), "--quiet"]) == 2
        assert "in use" in one_error_line(capsys)
    finally:
        os.close(fd)


# --- signals -------------------------------------------------------------------------------


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_run_left_behind():
    """A test that fails half-way (a signal that did not stop its run) leaves no run behind:
    each one it started is killed (its peers die with it)."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start(path: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "p2pfl", "run", str(path), "--out", str(out), "--quiet", *extra]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    STARTED.append(proc)
    return proc


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


def check_interrupted(out: Path, sig: str) -> None:
    summary = strict_json(out / "summary.json")
    assert summary["status"] == "interrupted" and summary["signal"] == sig
    rows = comm_rows(out / "comm.csv")
    assert rows and summary["comm"]["messages"] == len(rows)
    assert summary["comm"]["total_bytes"] == sum(int(r["bytes"]) for r in rows)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_a_simulation_with_a_summary_that_counts_what_was_sent(tmp_path, sig):
    out = tmp_path / "out"
    proc = start(write(tmp_path, LONG), out)
    wait_for(lambda: (out / "comm.csv").is_file() and len(comm_rows(out / "comm.csv")) > 20)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == f"error: interrupted ({sig.name})"
    check_interrupted(out, sig.name)


def test_sigterm_to_the_launcher_stops_every_peer_and_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    config = LONG | {"transport": {"timeout_s": 30.0}}
    proc = start(write(tmp_path, config), out, "--transport", "zmq")
    wait_for(lambda: len(list(out.glob("peers/*/comm.csv"))) == 5 and (out / "peers").is_dir())
    wait_for(lambda: (out / "peers/0/comm.csv").stat().st_size > 200)
    peers = list(peer_pids(proc.pid).values())
    assert len(peers) == 5
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert not any(alive(p) for p in peers)
    check_interrupted(out, "SIGTERM")


def frames_until_interrupted(seconds: float) -> bool:
    """SIGTERM to this process, from a thread, while it makes and frees ZeroMQ frames
    (pyzmq checks for signals in ``Frame.__dealloc__``): whether the handler's
    ``KeyboardInterrupt`` got out within ``seconds``."""
    timer = threading.Timer(0.005, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            zmq.Frame(b"x")
    except KeyboardInterrupt:
        return True
    finally:
        timer.join()
    return False


def test_an_interrupt_raised_in_a_destructor_is_raised_again_not_lost(capfd):
    """Issue: SIGTERM to a ZeroMQ run's launcher sometimes printed a peer's traceback
    ("Exception ignored in: 'zmq.backend.cython._zmq.Frame.__dealloc__'"), and that peer
    missed the signal: Python ran the handler inside the frame's destructor, where its
    exception cannot go on. Every command and forked child now runs under
    ``interrupts_kept``: the interrupt is raised at the next call instead, and not reported."""
    from p2pfl.app.cli import _terminate
    from p2pfl.runtime.children import interrupts_kept

    previous, unraisable = signal.signal(signal.SIGTERM, _terminate), sys.unraisablehook
    try:
        sys.unraisablehook = lambda u: None  # pytest's own would warn of the lost ones
        assert not all(frames_until_interrupted(0.5) for _ in range(3))  # lost, unkept
        sys.unraisablehook = unraisable
        capfd.readouterr()
        with interrupts_kept():
            assert all(frames_until_interrupted(5.0) for _ in range(5))
        assert capfd.readouterr().err == ""
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = unraisable


def test_peers_die_with_a_launcher_killed_by_sigkill(tmp_path):
    out = tmp_path / "out"
    config = LONG | {"transport": {"timeout_s": 30.0}}
    proc = start(write(tmp_path, config), out, "--transport", "zmq")
    wait_for(lambda: len(list(out.glob("peers/*/comm.csv"))) == 5)
    peers = list(peer_pids(proc.pid).values())
    assert len(peers) == 5
    proc.kill()
    proc.wait(timeout=10)
    wait_for(lambda: not any(alive(p) for p in peers), timeout=5.0)


def test_summary_json_is_strict_json_when_the_loss_is_not_a_number(tmp_path):
    """lr 1e30 drives the loss to NaN: summary.json says null, never the literal NaN."""
    config = QUICK | {"train": {"epochs": 1, "batch_size": 32, "lr": 1e30}}
    out = tmp_path / "out"
    assert main(["run", str(write(tmp_path, config)), "--out", str(out), "--quiet"]) == 0
    summary = strict_json(out / "summary.json")
    assert summary["final"]["loss"] is None


# --- keys and transport bounds -------------------------------------------------------------


def test_keys_are_written_with_private_secrets(tmp_path):
    assert main(["keys", str(tmp_path / "keys"), "--peers", "2", "--server"]) == 0
    for name in ("0", "1", "server"):
        secret = stat.S_IMODE((tmp_path / "keys" / f"{name}.key_secret").stat().st_mode)
        public = stat.S_IMODE((tmp_path / "keys" / f"{name}.key").stat().st_mode)
        assert (secret, public) == (0o600, 0o644)


def test_keys_never_replace_keys_already_made(tmp_path, capsys):
    """A second ``p2pfl keys`` into the same directory would leave the copies on other hosts
    unmatched (and a secret already world-readable stayed so): one error line, nothing
    changed."""
    keys = tmp_path / "keys"
    assert main(["keys", str(keys), "--peers", "2"]) == 0
    before = {p.name: p.read_bytes() for p in keys.iterdir()}
    assert main(["keys", str(keys), "--peers", "3"]) == 2
    assert "already holds 0.key" in one_error_line(capsys)
    assert {p.name: p.read_bytes() for p in keys.iterdir()} == before


@pytest.mark.parametrize("spoil", ["garbage", "truncated", "missing"])
def test_a_broken_or_missing_public_key_is_one_line_before_any_peer_starts(tmp_path, capsys, spoil):
    """Node 2's public key is garbage, a truncated key, or missing: every node needs every
    other's public key (its inbox knows every sender), so the run is refused before a
    peer is forked (a traceback, a peer's 'Invalid argument' after the start, or an
    error after the start for a non-neighbour's key)."""
    keys = tmp_path / "keys"
    assert main(["keys", str(keys), "--peers", "4", "--server"]) == 0
    public = keys / "2.key"
    if spoil == "garbage":
        public.write_text("garbage\n")
    elif spoil == "truncated":
        text = public.read_text()
        start = text.index('public-key = "') + len('public-key = "')
        public.write_text(text[: start + 10] + text[start + 40 :])
    else:
        public.unlink()
    capsys.readouterr()
    config = QUICK | {"transport": {"curve_keys": str(keys)}}
    out = tmp_path / "out"
    args = ["run", str(write(tmp_path, config)), "--out", str(out), "--transport", "zmq"]
    assert main(args + ["--quiet"]) == 2
    assert "transport.curve_keys" in one_error_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("timeout_s", 1e7, "transport.timeout_s: must be <= 1e+06 s"),
        ("startup_timeout_s", 2e6, "transport.startup_timeout_s: must be <= 1e+06 s"),
        ("timeout_s", 0, "transport.timeout_s: must be > 0"),
        ("max_message_bytes", 1 << 50, "transport.max_message_bytes: must be <= 2**40"),
    ],
)
def test_transport_values_a_socket_cannot_take_are_refused(tmp_path, capsys, key, value, message):
    config = QUICK | {"transport": {key: value}}
    out = tmp_path / "out"
    args = ["run", str(write(tmp_path, config)), "--out", str(out), "--transport", "zmq"]
    assert main(args + ["--quiet"]) == 2
    assert message in one_error_line(capsys)
    assert not out.exists()


def test_a_hung_peer_ends_the_run_soon_after_the_timeout(tmp_path):
    """SIGSTOP one client: the server's receive times out after ``timeout_s``, the run fails
    naming a peer, and every process is gone within ``timeout_s`` + 4 s of the hang."""
    out = tmp_path / "out"
    timeout = 3.0
    config = LONG | {"transport": {"timeout_s": timeout}}
    proc = start(write(tmp_path, config), out, "--transport", "zmq")
    wait_for(lambda: (out / "peers/server/comm.csv").is_file())
    wait_for(lambda: (out / "peers/server/comm.csv").stat().st_size > 500)
    peers = list(peer_pids(proc.pid).values())
    hung = peers[1]
    os.kill(hung, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - stopped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGKILL)
    assert proc.returncode == 1 and "Traceback" not in err
    lines = err.strip().splitlines()  # each peer's one line, then the run's
    assert all(line.startswith("error:") for line in lines), err
    assert lines[-1].startswith("error: run failed: peer") and "waited 3 s" in lines[-1], err
    assert elapsed <= timeout + 4.0, elapsed  # 4.97 s for timeout 3 s when written
    wait_for(lambda: not any(alive(p) for p in peers), timeout=2.0)
    assert strict_json(out / "summary.json")["status"] == "failed"


def test_a_fork_that_fails_midway_stops_the_nodes_already_forked(tmp_path, monkeypatch):
    """The third of five forks fails (a process limit, say): the two nodes already forked
    are stopped and reaped, not left waiting for a handshake that never comes."""
    from p2pfl.app.config import resolve
    from p2pfl.app.experiment import build
    from p2pfl.runtime import launcher

    setup = build(resolve(LONG, tmp_path / "exp.yaml"))
    forked: list[launcher.Forked] = []
    real = launcher.Forked

    def fork(main, name):
        if len(forked) == 2:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        forked.append(real(main, name))
        return forked[-1]

    monkeypatch.setattr(launcher, "Forked", fork)
    with pytest.raises(BlockingIOError):
        launcher.fork_nodes(setup, list(setup.topology.graph.nodes), tmp_path / "out")
    assert len(forked) == 2
    assert all(child.returncode is not None for child in forked)
    assert not any(alive(child.pid) for child in forked)
