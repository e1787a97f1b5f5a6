"""A simulation spread over torch.distributed ranks (``--workers``, ``torchrun``) writes the
same bytes as one process: the trainings are split, their results gathered in rank order."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import BASE, ROOT, experiment, on_device
from p2pfl.app.cli import main
from p2pfl.app.experiment import build
from p2pfl.core.errors import RankFailed, RunError
from p2pfl.runtime.children import DEATH_SEEN_S, free_port
from p2pfl.runtime.ranks import Ranks
from p2pfl.runtime.worker import Worker

RING = {
    "topology": {"kind": "ring"},
    "peers": {"count": 6},
    "algorithm": {"name": "dfedavgm", "rounds": 2},
    "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
    "eval": {"every": 1, "per_peer": True},  # scores deferred, split and written in order
}
PROX = {  # a regulariser: trainings that never batch are spread too
    "topology": {"kind": "star"},
    "peers": {"count": 5},
    "algorithm": {"name": "fedprox", "rounds": 2, "mu": 0.1},
    "train": {"epochs": 2, "batch_size": 32, "lr": 0.05, "select": "best_val"},
    "partition": {"name": "iid", "val_fraction": 0.2},
}


def exp_file(tmp_path: Path, **sections: Any) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(on_device(copy.deepcopy(BASE) | sections)))
    return path


def outputs(out: Path) -> dict[str, Any]:
    """What must not depend on the number of ranks: all but wall-clock times."""
    summary = json.loads((out / "summary.json").read_text())
    for key in ("wall_time_s", "compute_wall_s"):
        summary.pop(key)
    files = {name: (out / name).read_bytes() for name in ("comm.csv", "metrics.csv")}
    return files | {"summary": summary}


def spread(exp: Path, out: Path, workers: int, *options: str) -> int:
    """``p2pfl run EXP --workers N [options]`` in this process, or on a host with a GPU in a
    fresh one: autograd, once this process has run it there, refuses to run in the ranks it
    forks."""
    argv = ["run", str(exp), "--out", str(out), "--quiet", "--workers", str(workers), *options]
    if not torch.cuda.device_count():
        return main(argv)
    return subprocess.run([sys.executable, "-m", "p2pfl", *argv], cwd=ROOT, timeout=300).returncode


def same_sharded(exp: Path, tmp_path: Path, flag: str, world: int = 3) -> dict[str, Any]:
    """The outputs of ``exp`` in one process (``tmp_path/one``), checked equal on ``world``
    ranks sharded by ``flag`` (``tmp_path/sharded``)."""
    assert spread(exp, tmp_path / "one", 1) == 0
    assert spread(exp, tmp_path / "sharded", world, flag) == 0
    one = outputs(tmp_path / "one")
    assert outputs(tmp_path / "sharded") == one
    return one


def same_on_1_2_and_4(exp: Path, tmp_path: Path, code: int = 0) -> dict[str, Any]:
    """The outputs of ``exp`` on 1 rank, checked equal on 2 and 4 (each exiting ``code``)."""
    runs = []
    for n in (1, 2, 4):
        out = tmp_path / f"w{n}"
        assert spread(exp, out, n) == code
        runs.append(outputs(out))
    assert runs[1] == runs[0] and runs[2] == runs[0]
    return runs[0]


def test_owners_are_longest_first_to_the_least_loaded_rank():
    assert Ranks(0, 2).owners([5.0, 1.0, 4.0, 2.0]) == [0, 0, 1, 1]
    assert Ranks(1, 3).owners([1.0, 1.0, 1.0, 1.0]) == [0, 1, 2, 0]  # ties: lower rank, job
    assert Ranks(0, 1).owners([3.0, 2.0]) == [0, 0]


ELMY = {  # a regulariser that keeps figures its method logs (pool{j}_ce, _d1, _d2, ...),
    # in peers that train at the same time (on other ranks, they were lost from metrics.csv)
    "topology": {"kind": "mesh"},
    "peers": {"count": 4},
    "algorithm": {"name": "fedelmy", "variant": "parallel", "pool_size": 2, "alpha": 0.5,
                  "beta": 0.5, "warmup_epochs": 1},
}  # fmt: skip


@pytest.mark.parametrize(
    ("devices", "local_rank", "picked"),
    [
        ({"cpu"}, 5, []),  # CUDA untouched
        ({"cuda:1"}, 5, []),  # a peer on cuda:N stays there
        ({"cuda"}, 5, [1]),  # the local rank (5) mod the GPUs (4)
        ({"cpu", "cuda"}, 2, [2]),
    ],
)
def test_each_rank_takes_its_own_gpu(monkeypatch, devices, local_rank, picked):
    """The rule alone (one GPU here at most): a rank's ``cuda`` is GPU (local rank) mod
    (GPUs), and a rank whose peers do not train on plain ``cuda`` leaves CUDA alone. The
    local rank is torchrun's ``LOCAL_RANK``, else the rank (``--workers``: one host)."""
    taken: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", taken.append)
    Ranks(5, 8, local_rank=local_rank).take_gpu({torch.device(d) for d in devices})
    assert taken == picked
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    Ranks(5, 8, local_rank=local_rank).take_gpu({torch.device("cuda")})  # one GPU: no choice
    assert taken == picked


@pytest.mark.parametrize(
    "sections", [RING, PROX, ELMY], ids=["dfedavgm", "fedprox-best_val", "fedelmy-pool"]
)
def test_world_sizes_1_2_and_4_write_the_same_bytes(tmp_path, sections):
    one = same_on_1_2_and_4(exp_file(tmp_path, **sections), tmp_path)
    rows = one["metrics.csv"].decode().splitlines()
    assert sum(",accuracy," in row for row in rows) > 2  # per-round scores were written
    assert "WORLD_SIZE" not in os.environ  # rank 0's process is given back as it was


def test_a_failed_spread_run_keeps_the_rows_of_one_process(tmp_path):
    """A run that deadlocks (messages lost, no wait) while scores are deferred to the next
    flush: rank 0 scores them alone and writes every row, as one process writes them (the
    rows held behind the pending scores were lost)."""
    exp = exp_file(tmp_path, **(RING | {"network": {"links": {"loss": 0.05}}}))
    one = same_on_1_2_and_4(exp, tmp_path, code=1)
    assert one["summary"]["status"] == "failed" and "deadlock" in one["summary"]["error"]
    assert b",accuracy," in one["metrics.csv"]


def test_workers_and_batching_compose_to_the_same_bytes(tmp_path):
    """The batched groups are formed before the trainings are split over the ranks, and go
    whole to one of them: the same bits on 1, 2 and 4 ranks (a rank that got a group's
    only member of its share trained it one by one, so the last digits moved)."""
    batched = RING | {"peers": {"count": 6, "batched": True}}
    same_on_1_2_and_4(exp_file(tmp_path, **batched), tmp_path)


def test_ranks_share_a_batched_mlp_group(tmp_path, monkeypatch):
    """On a CPU a peer's bits on the hand-written MLP path do not depend on its group, so the
    ranks share each flush's group (rank 0 batches part of every one, in one call) instead
    of one rank training it whole while the other waits; the bytes are one process's."""
    if torch.cuda.device_count():
        pytest.skip("on a GPU host the ranks run in fresh processes, and groups stay whole")
    sizes: list[int] = []
    train_group = Worker._train_group

    def spy(self, jobs, key, members):  # rank 0's, in this process (the others are forked)
        sizes.append(len(members))
        return train_group(self, jobs, key, members)

    monkeypatch.setattr(Worker, "_train_group", spy)
    exp = exp_file(tmp_path, **(RING | {"peers": {"count": 6, "batched": True}}))
    assert spread(exp, tmp_path / "w1", 1) == 0
    whole, sizes[:] = list(sizes), []  # one process: each flush's group whole
    assert spread(exp, tmp_path / "w2", 2) == 0
    assert len(sizes) == len(whole) and all(0 < a < b for a, b in zip(sizes, whole, strict=True))
    assert outputs(tmp_path / "w2") == outputs(tmp_path / "w1")


@pytest.mark.parametrize("options", [[], ["--shard"]], ids=["spread", "sharded"])
def test_torchrun_starts_the_same_run_on_loopback(tmp_path, options):
    exp = exp_file(tmp_path, **RING)
    assert main(["run", str(exp), "--out", str(tmp_path / "one"), "--quiet"]) == 0
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += ["-m", "p2pfl", "run", str(exp), "--out", str(tmp_path / "two"), "--quiet", *options]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TMPDIR": str(scratch(tmp_path))}  # torchrun's
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert outputs(tmp_path / "two") == outputs(tmp_path / "one")


def test_ranks_started_with_different_experiments_stop_at_once_saying_so(tmp_path):
    """Two ranks on loopback, as torchrun or a user starts them, the second with another
    learning rate: both end at once with one line saying so (rank 0 wrote outputs that mixed
    in rank 1's trainings, with exit 0; with another participation both waited 10 min)."""
    exp = exp_file(tmp_path, **RING)
    env = os.environ | {"OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    ranks = []
    for rank, sets in ((0, []), (1, ["--set", "train.lr=0.5"])):
        cmd = [sys.executable, "-m", "p2pfl", "run", str(exp), "--quiet", *sets]
        cmd += ["--out", str(tmp_path / f"rank{rank}")]
        ranks.append(
            subprocess.Popen(
                cmd, env=env | {"RANK": str(rank)}, cwd=ROOT, stderr=subprocess.PIPE, text=True
            )
        )
    for proc in ranks:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        assert err.splitlines()[-1].endswith(
            "rank(s) 1 run another experiment than rank 0 (config or data differ): "
            "start every rank with the same file, --set, --seed and dataset"
        ), err


def test_forked_ranks_compute_on_several_threads_each(tmp_path):
    """The ranks are forked from rank 0's built run; with two threads each they neither hang
    (GNU OpenMP's pool does not survive a fork: rank 0 computes on one thread until then)
    nor differ from one process on two threads."""
    exp = ROOT / "experiments" / "quickstart.yaml"  # its server's loss shows a thread count
    env = os.environ | {"OMP_NUM_THREADS": "2", "TMPDIR": str(scratch(tmp_path))}
    for n in (1, 2):
        cmd = [sys.executable, "-m", "p2pfl", "run", str(exp), "--out", str(tmp_path / f"w{n}")]
        done = subprocess.run(
            [*cmd, "--quiet", "--workers", str(n)], env=env, cwd=ROOT, timeout=300,
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert outputs(tmp_path / "w2") == outputs(tmp_path / "w1")
    assert_nothing_left(tmp_path)


def scratch(tmp_path: Path) -> Path:
    """A run's temporary directory (its ``TMPDIR``), made empty."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return tmp


def assert_nothing_left(tmp_path: Path) -> None:
    """The run in ``tmp_path`` left nothing in its temporary directory: what the ranks
    above 0 write and throw away goes, however they ended."""
    assert list((tmp_path / "tmp").iterdir()) == []


def long_spread_run(tmp_path: Path, *options: str, **popen: Any) -> subprocess.Popen[str]:
    """``p2pfl run --workers 2 [options]`` of a 100,000-round ring into ``tmp_path/o``,
    started, with its stderr piped: a run that lasts until it is killed or interrupted."""
    exp = exp_file(tmp_path, **(RING | {"algorithm": {"name": "dfedavgm", "rounds": 100_000}}))
    cmd = [sys.executable, "-m", "p2pfl", "run", str(exp), "--out", str(tmp_path / "o")]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TMPDIR": str(scratch(tmp_path))}
    return subprocess.Popen(
        [*cmd, "--quiet", "--workers", "2", *options], env=env, cwd=ROOT,
        stderr=subprocess.PIPE, text=True, **popen,
    )  # fmt: skip


def wait_under_way(out: Path) -> None:
    """Until the run in ``out`` has written its first rounds' scores (at most a minute)."""
    for _ in range(600):
        metrics = out / "metrics.csv"
        if metrics.is_file() and len(metrics.read_text().splitlines()) > 3:
            return
        time.sleep(0.1)
    raise AssertionError(f"{out}: no scores written in a minute")


@pytest.mark.parametrize("options", [[], ["--shard-events"]], ids=["workers", "shard-events"])
def test_a_dead_rank_ends_the_run_naming_it(tmp_path, options):
    """Rank 0 ends its run (summary.json says why) with one error line naming the rank."""
    proc = long_spread_run(tmp_path, *options)
    try:
        child = None
        for _ in range(300):  # the rank appears within seconds (forked, named; beside it
            # the partition figure's child, p2pfl-figure)
            found = subprocess.run(
                ["pgrep", "-P", str(proc.pid), "-x", "p2pfl rank 1"], capture_output=True, text=True
            )
            if found.stdout.strip():
                child = int(found.stdout.split()[0])
                break
            time.sleep(0.1)
        assert child is not None
        wait_under_way(tmp_path / "o")
        os.kill(child, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert err == "error: worker rank 1 exited with code -9\n"
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())  # written all the same
    assert summary["status"] == "failed"
    # one form, whether rank 0 saw the death or a failed exchange first
    assert summary["error"] == "RankFailed: worker rank 1 exited with code -9"
    assert_nothing_left(tmp_path)  # the killed rank could not remove what it wrote


def test_a_rank_that_cannot_join_is_one_error_line(tmp_path):
    """A forked rank that cannot join the others (gloo finds no such interface) is one
    line, its own reason, told to rank 0 (not its line and then rank 0's "exited with
    code 1" for one failure)."""
    exp = exp_file(tmp_path, **RING)
    env = os.environ | {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "no-such-interface"}
    cmd = [sys.executable, "-m", "p2pfl", "run", str(exp), "--out", str(tmp_path / "o")]
    done = subprocess.run(
        [*cmd, "--quiet", "--workers", "2"], env=env, cwd=ROOT, timeout=120,
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: rank ") and "could not reach the others" in done.stderr


@pytest.mark.parametrize("signum,group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c", "sigterm-to-rank-0"])  # fmt: skip
def test_an_interrupted_spread_run_ends_as_interrupted(tmp_path, signum, group):
    """Ctrl-C (SIGINT to the whole process group) or SIGTERM to rank 0: the run ends as
    interrupted (exit 130, summary.json says so), not as a rank's death: rank 0 stops the
    ranks, and the ranks leave Ctrl-C to it."""
    proc = long_spread_run(tmp_path, start_new_session=True)
    try:
        wait_under_way(tmp_path / "o")
        (os.killpg if group else os.kill)(proc.pid, signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err == f"error: interrupted ({signal.Signals(signum).name})\n"
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert_nothing_left(tmp_path)


BAD = [
    (["--workers", "0"], {}, "--workers: must be in 1..1024"),
    (["--workers", "2", "--transport", "zmq"], {}, "--workers: spreads a simulation"),
    (
        ["--workers", "2", "--transport", "zmq"],
        {"sweep": {"seed": [0, 1]}},
        "--workers: spreads a simulation",
    ),
    (
        ["--workers", "2"],
        {"peers": {"count": 4, "compute": "measured"}},
        "--workers: needs peers.compute: model",
    ),
]


@pytest.mark.parametrize("argv,sections,message", BAD, ids=[m.split(": ")[1] for *_, m in BAD])
def test_a_run_that_cannot_be_spread_is_one_error_line(tmp_path, capsys, argv, sections, message):
    out = tmp_path / "out"
    code = main(["run", str(exp_file(tmp_path, **sections)), "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_torchrun_on_a_sweep_is_one_error_line(tmp_path, capsys, monkeypatch):
    """torchrun spreads one experiment; a sweep's cells spread with --workers instead."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "out"
    code = main(["run", str(exp_file(tmp_path, sweep={"seed": [0, 1]})), "--out", str(out)])
    err = capsys.readouterr().err
    assert (
        code == 2 and err == "error: torchrun: spreads one experiment, not a sweep: use --workers\n"
    )
    assert not out.exists()


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "two", "RANK": "0"}, {"RANK": "1.5"}])
def test_a_malformed_torchrun_environment_is_one_error_line(tmp_path, capsys, monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    code = main(["run", str(exp_file(tmp_path, **RING)), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: WORLD_SIZE, RANK: must be integers"), err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_a_failed_collective_is_one_line_naming_its_cause():
    """gloo's many-line error becomes its first line; with a rank known dead (rank 0 of
    ``--workers``), the death is the error instead."""
    lost = RuntimeError("[../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:1\nmore\n")
    with pytest.raises(RunError) as alone, Ranks(1, 2).together():
        raise lost
    assert str(alone.value) == (
        "rank 1 lost the others ([../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:1)"
    )
    waited = []
    ranks = Ranks(0, 2, death=lambda within: waited.append(within) or "worker rank 1 exited")
    with pytest.raises(RankFailed, match="^worker rank 1 exited$"), ranks.together():
        raise lost
    assert waited == [DEATH_SEEN_S]


def test_only_a_run_on_cuda_needs_cuda_untouched_before_the_fork(monkeypatch):
    """CUDA does not survive a fork: a run that trains on it refuses to fork ranks or nodes
    from a process that has initialized it; a run on the CPU forks from any process."""
    setup = build(experiment(peers={"count": 3, "device": "cpu"}))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    setup.check_forkable("ranks")  # a CPU run: no error
    monkeypatch.setattr(type(setup), "devices", property(lambda _: {torch.device("cuda")}))
    with pytest.raises(RunError, match="^CUDA was initialized before the ranks were forked$"):
        setup.check_forkable("ranks")
