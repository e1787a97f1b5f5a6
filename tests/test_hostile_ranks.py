"""Hardening (issue 36): values that were accepted and should not be — ``--workers`` beyond
the host, torchrun variables that name a rank that cannot exist or never joins, plug-ins
that exit or never end at import, YAML tags in ``--set``, and grids too big to check.

Each case runs the real command line in a fresh process, as a user meets it, on the digits
data: refused with exit code 2 and one ``error:`` line before anything is written in
``--out``, or ended within its documented bound (kept to seconds here by its knob) with one
line that names the cause.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import BASE, ROOT
from p2pfl.app.cli import MAX_WORKERS, RANK_MEMORY, RANKS_PER_CORE, main
from p2pfl.app.sweep import MAX_CELLS
from p2pfl.core.plugins import SLOW_IMPORT_S
from p2pfl.runtime import children
from p2pfl.runtime.children import JOIN_ENV, free_port, usable_cores

TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ENV = {k: v for k, v in os.environ.items() if k not in (*TORCHRUN, JOIN_ENV)}
ENV["OMP_NUM_THREADS"] = "1"
STARTUP_S = 60.0
"""What a command may take besides the bound under test: importing torch, loading the digits
and building the run, on a busy machine (without the bounds, these cases wait 10 minutes)."""
JOIN_S = 2
"""The join bound the torchrun cases set (``P2PFL_JOIN_TIMEOUT_S``)."""


def exp_file(tmp_path: Path, name: str = "exp.yaml", **sections: Any) -> Path:
    """BASE (digits, a star of 4 peers, FedAvg) with ``sections`` replaced, as a file."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(copy.deepcopy(BASE) | sections))
    return path


def p2pfl(
    *args: str | Path, env: dict[str, str] | None = None, timeout: float = 120
) -> tuple[int, str, float]:
    """``python -m p2pfl ARGS`` with ``env`` added: exit code, stderr and wall seconds."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "p2pfl", *map(str, args)],
        cwd=ROOT, env=ENV | (env or {}), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return done.returncode, done.stderr, time.monotonic() - start


def one_line(err: str) -> str:
    """The only line of ``err``: an ``error:`` line, no traceback, no C++ stack."""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.rstrip("\n")


def refused(tmp_path: Path, exp: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """``p2pfl run EXP`` into ``tmp_path/out``: exit 2, one line, ``out`` never made."""
    out = tmp_path / "out"
    code, err, _ = p2pfl("run", exp, "--out", out, "--quiet", *args, env=env, timeout=60)
    assert code == 2, err
    assert not out.exists()
    return one_line(err)


# --- --workers: bounded by the cores, the peers and the memory ------------------------------


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_workers_beyond_the_cores_are_refused(tmp_path, sweep):
    """``--workers 1000`` took 15 GB in two minutes: more processes than 4 per usable core
    are refused, for a run's ranks and for a sweep's cells alike."""
    cores = usable_cores()
    workers = RANKS_PER_CORE * cores + 1
    if workers > MAX_WORKERS:
        pytest.skip(f"{cores} cores allow every --workers up to {MAX_WORKERS}")
    grid = {"sweep": {"seed": [0, 1]}} if sweep else {}
    exp = exp_file(tmp_path, peers={"count": 64}, **grid)
    line = refused(tmp_path, exp, "--workers", str(workers))
    assert line == (
        f"error: --workers: {workers} processes on {cores} usable core(s): at most "
        f"{workers - 1} ({RANKS_PER_CORE} per core; more only share the cores)"
    )


def test_more_ranks_than_peers_are_refused(tmp_path):
    exp = exp_file(tmp_path, peers={"count": 2})
    line = refused(tmp_path, exp, "--workers", "3")
    assert line == "error: --workers: 3 ranks for 2 peers: at most one rank per peer"


def test_workers_beyond_free_memory_are_refused(tmp_path, capsys, monkeypatch):
    """The memory a host has free (``MemAvailable``, or a container's limit) is made small
    here: at least 64 MiB a process, or the command is refused before it forks."""
    monkeypatch.setattr(children, "available_memory", lambda: 100 << 20)
    out = tmp_path / "out"
    assert main(["run", str(exp_file(tmp_path)), "--out", str(out), "--workers", "2"]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"error: --workers: 2 processes need at least {2 * RANK_MEMORY >> 20} MiB "
        f"({RANK_MEMORY >> 20} MiB each); 100 MiB are free: at most 1"
    )
    assert not out.exists()


# --- torchrun's variables -------------------------------------------------------------------

RENDEZVOUS = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}
BAD_ENV = {
    "rank-beyond-world": ({"RANK": "5"}, "RANK: must be in 0..1 (WORLD_SIZE=2), got 5"),
    "negative-rank": ({"RANK": "-1"}, "RANK: must be in 0..1 (WORLD_SIZE=2), got -1"),
    "huge-world": (
        {"WORLD_SIZE": "100000000000000000000"},
        f"WORLD_SIZE: must be in 1..{MAX_WORKERS}, got 100000000000000000000",
    ),
    "world-of-zero": ({"WORLD_SIZE": "0"}, f"WORLD_SIZE: must be in 1..{MAX_WORKERS}, got 0"),
    "rank-without-world": (
        {"WORLD_SIZE": None, "RANK": "1"},
        "RANK: must be in 0..0 (WORLD_SIZE=1), got 1",
    ),
    "no-master-addr": (
        {"MASTER_ADDR": None},
        "MASTER_ADDR: is not set: the address of rank 0's host (torchrun sets it)",
    ),
    "port-out-of-range": ({"MASTER_PORT": "70000"}, "MASTER_PORT: must be in 1..65535, got 70000"),
    "port-not-a-number": (
        {"MASTER_PORT": "http"},
        "MASTER_PORT: must be an integer in 1..65535, got 'http'",
    ),
    "local-rank-beyond-local-world": (
        {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
        "LOCAL_RANK: must be in 0..1, got 2",
    ),
    "local-world-beyond-world": (
        {"LOCAL_WORLD_SIZE": "3"},
        "LOCAL_WORLD_SIZE: must be in 1..2, got 3",
    ),
    "more-ranks-than-peers": (
        {"WORLD_SIZE": "5"},
        "WORLD_SIZE: 5 ranks for 4 peers: at most one rank per peer",
    ),
    **{
        f"join-timeout-{value}": (
            {JOIN_ENV: value},
            f"{JOIN_ENV}: must be seconds in (0, 86400], got {value!r}",
        )
        for value in ("nan", "0", "-5", "10 min")
    },
}


@pytest.mark.parametrize("case", list(BAD_ENV))
def test_torchrun_variables_that_name_no_rank_are_refused(tmp_path, case):
    """Rank 0 of a torchrun-style start whose variables cannot work: refused at once (it
    waited for the others for 10 minutes, or ended in a traceback, or a late exit 1)."""
    changes, message = BAD_ENV[case]
    env = RENDEZVOUS | {"MASTER_PORT": str(free_port())} | changes
    env = {k: v for k, v in env.items() if v is not None}  # None: left unset
    assert refused(tmp_path, exp_file(tmp_path), env=env) == f"error: {message}"


def joining(tmp_path: Path, rank: int, world: int, port: int) -> subprocess.Popen[str]:
    """Rank ``rank`` of ``world`` on loopback, started as torchrun starts it, with the join
    bound of :data:`JOIN_S` seconds."""
    env = ENV | {"WORLD_SIZE": str(world), "RANK": str(rank), "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(port), JOIN_ENV: str(JOIN_S)}
    cmd = [sys.executable, "-m", "p2pfl", "run", str(exp_file(tmp_path)), "--quiet"]
    cmd += ["--out", str(tmp_path / f"rank{rank}")]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def ended(proc: subprocess.Popen[str], start: float) -> tuple[str, float]:
    """A rank's one error line (exit 1) and its wall seconds, within the bound and start-up."""
    try:
        _, err = proc.communicate(timeout=JOIN_S + STARTUP_S)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    return one_line(err), time.monotonic() - start


def test_a_rank_whose_rank_0_never_starts_ends_within_the_bound(tmp_path):
    """``RANK=1`` with no rank 0: it waited forever (a C++ stack after 600 s)."""
    port = free_port()
    line, took = ended(joining(tmp_path, 1, 2, port), time.monotonic())
    assert line == (
        f"error: rank 1 of 2 could not join the others within {JOIN_S} s ({JOIN_ENV}): "
        f"no rank 0 answered at 127.0.0.1:{port}"
    )
    assert took < JOIN_S + STARTUP_S
    assert not (tmp_path / "rank1").exists()


def test_a_rank_0_whose_others_never_start_ends_within_the_bound_writing_nothing(tmp_path):
    line, took = ended(joining(tmp_path, 0, 2, free_port()), time.monotonic())
    assert line.startswith(
        f"error: rank 0 of 2 could not join the others within {JOIN_S} s ({JOIN_ENV}): "
    )
    assert "1/2" in line  # torch's reason: one of two joined
    assert took < JOIN_S + STARTUP_S
    assert not (tmp_path / "rank0").exists()  # it joins before it claims --out


def test_two_ranks_of_three_end_within_the_bound_each_with_one_line(tmp_path):
    """Ranks 0 and 1 of 3 start, rank 2 never does: each ends with its own line (rank 1
    printed c10d's C++ stack, then blamed GLOO_SOCKET_IFNAME)."""
    port = free_port()
    start = time.monotonic()
    procs = [joining(tmp_path, rank, 3, port) for rank in (0, 1)]
    for rank, proc in enumerate(procs):
        line, took = ended(proc, start)
        assert line.startswith(
            f"error: rank {rank} of 3 could not join the others within {JOIN_S} s ({JOIN_ENV}): "
        )
        assert took < JOIN_S + STARTUP_S
    assert not (tmp_path / "rank0").exists()


# --- plug-ins that end the program or never end at import -----------------------------------

EXITS = {
    "exit-0": ("import sys\nsys.exit(0)\n", "called sys.exit(0) while imported"),
    "exit-none": ("import sys\nsys.exit()\n", "called sys.exit(None) while imported"),
    "raise-systemexit": ("raise SystemExit('bye')\n", "called sys.exit('bye') while imported"),
}


@pytest.mark.parametrize("case", list(EXITS))
def test_a_plugin_that_exits_at_import_is_refused_naming_it(tmp_path, case):
    """It ended the run with exit 0 (or 1) and nothing written, with no word."""
    source, message = EXITS[case]
    (tmp_path / "quits.py").write_text(source)
    exp = exp_file(tmp_path, plugins=[str(tmp_path / "quits.py")])
    line = refused(tmp_path, exp)
    assert line == f"error: {exp}: plugins: {tmp_path / 'quits.py'}: {message}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_plugin_that_never_ends_is_named_and_a_signal_ends_it(tmp_path, sig):
    """A plug-in that loops at import hung with no word: after a few seconds stderr names
    it, and Ctrl-C (or SIGTERM) ends the command as interrupted, naming it."""
    (tmp_path / "spins.py").write_text("while True:\n    pass\n")
    exp = exp_file(tmp_path, plugins=["spins.py"])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "p2pfl", "run", str(exp), "--out", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.append(proc.stderr.readline()))
        reader.start()
        reader.join(SLOW_IMPORT_S + STARTUP_S)
        assert said == [
            f"p2pfl: still importing plug-in spins.py after {SLOW_IMPORT_S:g} s (Ctrl-C stops it)\n"
        ]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert one_line(err) == (
        f"error: interrupted ({signal.Signals(sig).name} while importing plug-in spins.py)"
    )
    assert not out.exists()


# --- YAML tags in --set, as in a file -------------------------------------------------------

TAGS = {
    "python-apply": (
        "name=!!python/object/apply:os.system ['touch {marker}']",
        "could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/object/apply:os.system'",
    ),
    "python-name": (
        "name=!!python/name:os.system",
        "could not determine a constructor for the tag 'tag:yaml.org,2002:python/name:os.system'",
    ),
    "local-tag": (
        "train.lr=!custom 0.1",
        "could not determine a constructor for the tag '!custom'",
    ),
    "key-twice": ("model={name: mlp, name: cnn3}", "duplicate key 'name'"),
}


@pytest.mark.parametrize("case", list(TAGS))
def test_a_tag_in_set_is_refused_as_in_a_file(tmp_path, case):
    """``--set`` read the value as a plain string where a file refused it: now both are
    refused with the same reason (and nothing runs)."""
    text, reason = TAGS[case]
    marker = tmp_path / "ran"
    assignment = text.replace("{marker}", str(marker))
    key, _, value = assignment.partition("=")
    exp = exp_file(tmp_path)
    line = refused(tmp_path, exp, "--set", assignment)
    assert line.startswith(f"error: {exp}: --set: ") and assignment[:40] in line
    assert line.endswith(f": not valid YAML at line 1: {reason}")
    in_file = tmp_path / "in_file.yaml"
    in_file.write_text(f"{key}: {value}\n")
    assert refused(tmp_path, in_file) == f"error: {in_file}: not valid YAML at line 1: {reason}"
    assert not marker.exists()


def test_a_tag_in_set_is_refused_by_cost_too(tmp_path):
    exp = exp_file(tmp_path)
    out = tmp_path / "out"
    code, err, _ = p2pfl("cost", exp, "--set", "name=!!python/name:os.system", "--out", out)
    assert code == 2, err
    assert one_line(err).startswith(f"error: {exp}: --set: 'name=!!python/name:os.system': ")
    assert not out.exists()


@pytest.mark.parametrize("case", list(TAGS))
def test_a_tag_in_cost_methods_is_refused_as_in_a_file(tmp_path, case):
    """``cost --methods NAME:KEY=VALUE`` read a tagged value as a plain string, as ``--set``
    did: refused alike, with the same reason, nothing written."""
    text, reason = TAGS[case]
    value = text.partition("=")[2].replace("{marker}", str(tmp_path / "ran"))
    out = tmp_path / "out"
    pair = f"rounds={value}"
    code, err, _ = p2pfl("cost", exp_file(tmp_path), "--methods", f"fedavg:{pair}", "--out", out)
    assert code == 2, err
    line = one_line(err)  # --methods splits items at ':', so a tag may be cut there
    assert line.startswith("error: --methods: 'rounds=") and reason.split(":")[0] in line, line
    assert not out.exists() and not (tmp_path / "ran").exists()


# --- sweeps: a documented size, and a check that shows its progress -------------------------

HUGE = {  # the grid, and its number of cells
    "90000": ({"seed": list(range(300)), "train.lr": [0.001 * i for i in range(1, 301)]}, 90_000),
    "10**12": (
        {
            "seed": list(range(100)),
            "train.lr": [0.001 * i for i in range(1, 101)],
            "train.momentum": [0.001 * i for i in range(100)],
            "train.weight_decay": [0.0001 * i for i in range(100)],
            "algorithm.rounds": list(range(1, 101)),
            "peers.count": list(range(2, 102)),
        },
        10**12,
    ),
}


@pytest.mark.parametrize("size", list(HUGE))
def test_a_grid_over_the_limit_is_refused_at_once(tmp_path, size):
    """90,000 cells were checked silently for 12 minutes (a larger grid for ever)."""
    grid, cells = HUGE[size]
    start = time.monotonic()
    exp = exp_file(tmp_path, sweep=grid)
    line = refused(tmp_path, exp)
    assert line == (
        f"error: {exp}: sweep: {cells:,} cells; the limit is {MAX_CELLS:,}: "
        "split the grid into sweeps"
    )
    assert time.monotonic() - start < STARTUP_S


SLOW_PARTITION = """
import time

import numpy as np

from p2pfl.api import PARTITIONERS, ConfigError


@PARTITIONERS.register("slow_iid")
def slow_iid(labels, num_peers, rng, *, fail: bool = False):
    time.sleep(0.15)
    if fail:
        raise ConfigError("fail", "this cell is bad")
    return np.array_split(rng.permutation(len(labels)), num_peers)
"""


@pytest.mark.parametrize("quiet", [False, True], ids=["bar", "quiet"])
def test_a_long_sweep_check_shows_its_progress_on_stderr(tmp_path, quiet):
    """A grid whose check lasts seconds (20 cells at 0.15 s, then a bad one) shows a bar on
    stderr while it is checked, unless ``--quiet``; the error is the last line either way."""
    (tmp_path / "slow.py").write_text(SLOW_PARTITION)
    grid = {"partition.fail": [False, True], "seed": list(range(20))}
    exp = exp_file(
        tmp_path, plugins=[str(tmp_path / "slow.py")], partition={"name": "slow_iid"}, sweep=grid
    )
    out = tmp_path / "out"
    code, err, _ = p2pfl("run", exp, "--out", out, *(["--quiet"] if quiet else []))
    assert code == 2 and not out.exists(), err
    *bar, line = err.splitlines()  # text mode reads tqdm's carriage returns as line ends
    cell = "partition.fail=True,seed=0"
    assert one_line(f"{line}\n") == (
        f"error: {exp}: partition.fail (sweep cell {cell}): this cell is bad"
    )
    if quiet:
        assert bar == []
    else:
        assert all(b.startswith("checking cells:") or not b.strip() for b in bar) and bar
        assert any("20/40" in b for b in bar)
