"""A population whose events are sharded across ranks (``--shard-events``): each rank runs
only its own peers, the ranks advance in windows of the smallest link latency, and the
outputs are the bytes of one process (:mod:`p2pfl.runtime.windows`)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import simpy
from test_ranks import RING, exp_file, same_sharded, spread
from test_shards import ADPSGD, CHURN, GOSSIP, STAR

import p2pfl.runtime.sim as sim
from conftest import DEVICE
from p2pfl.app.cli import main
from p2pfl.runtime.windows import KeyedEnvironment, key_of, order

FAULTS = {  # a crash, churn, lost and late messages: each decided where a rank can
    "topology": {"kind": "random_regular", "d": 4},
    "peers": {"count": 10},
    "algorithm": {"name": "dfedavgm", "rounds": 4, "wait_s": 0.5},
    "network": {
        "churn": {"online": {"dist": "weibull", "mean_s": 0.05, "shape": 0.6},
                  "offline_fraction": 0.3},
        "crashes": {"at": {3: 0.04, 7: 0.08}},
        "links": {"loss": 0.2, "jitter": {"dist": "exponential", "mean_s": 0.01}},
    },
}  # fmt: skip
EPIDEMIC = {  # a graph redrawn every round (Epidemic Learning): any two peers may be linked
    "topology": {"kind": "mesh"},
    "peers": {"count": 9},
    "algorithm": {"name": "dfedavgm", "rounds": 3, "mixing": "uniform"},
    "network": {"graph": {"every": "round", "kind": "s_out", "s": 2}},
}
FEDBUFF = {  # an asynchronous server and a straggler: arrivals, not rounds, drive it
    "topology": {"kind": "star"},
    "peers": {"count": 6, "flops_per_s": 3.0e8, "slow_fraction": 0.2, "slow_factor": 0.1},
    "algorithm": {"name": "fedbuff", "rounds": 6, "buffer_size": 3},
}


def _order(env: simpy.Environment, seed: int) -> list[tuple[int, int]]:
    """What a mix of SimPy processes does, in order: ties at one instant (timeouts of 0,
    events succeeded by another process, urgent interrupts, conditions) are most of it."""
    rng = random.Random(seed)
    done: list[tuple[int, int]] = []
    signals = [env.event() for _ in range(4)]

    def proc(i: int):
        for step in range(6):
            done.append((i, step))
            pick = rng.random()
            if pick < 0.3:
                yield env.timeout(rng.choice([0, 0, 1, 2]))
            elif pick < 0.5 and not signals[i % 4].triggered:
                signals[i % 4].succeed()
                yield env.timeout(0)
            elif pick < 0.7:
                yield env.timeout(1) | env.timeout(rng.choice([0, 1]))
            else:
                yield env.timeout(rng.choice([0, 1]))

    for i in range(12):
        env.process(proc(i))
    env.run()
    return done


@pytest.mark.parametrize("seed", range(5))
def test_the_keyed_environment_processes_events_in_simpys_order(seed):
    assert _order(KeyedEnvironment(), seed) == _order(simpy.Environment(), seed)


@pytest.mark.parametrize("seed", range(3))
def test_a_keys_numbers_sort_as_the_key(seed):
    """Rank 0 sorts other ranks' rows by :func:`order`, flat numbers: the order of the keys
    themselves, on events that mostly share their instant."""
    env = KeyedEnvironment()
    keys: list[Any] = []
    step = env.step

    def record():
        step()
        keys.append(env.active)

    env.step = record  # type: ignore[method-assign]
    _order(env, seed)
    random.Random(seed).shuffle(keys)
    assert len(keys) > 50 and sorted(keys, key=order) == sorted(keys)


def test_a_key_survives_its_numbers():
    env = KeyedEnvironment()
    seen: list[Any] = []

    def proc():
        for _ in range(3):
            yield env.timeout(0.5)
            seen.append(env.active)

    env.process(proc())
    env.run()
    assert all(key_of(order(k)) == k for k in seen) and len(order(seen[-1])) == 3 * 4 + 1


@pytest.mark.parametrize("world", [2, 4])
def test_events_sharded_write_the_bytes_of_one_process(tmp_path, world):
    one = same_sharded(exp_file(tmp_path, **RING), tmp_path, "--shard-events", world)
    assert all(p["accuracy"] is not None for p in one["summary"]["per_peer"])


@pytest.mark.parametrize(
    "sections",
    [GOSSIP, STAR, ADPSGD, FEDBUFF, CHURN, FAULTS, EPIDEMIC],
    ids=[
        "gossip-batched", "fedavg-star", "adpsgd-handler", "fedbuff-async",
        "dfedavgm-churn-loss", "crashes-jitter", "epidemic-redrawn",
    ],
)  # fmt: skip
def test_methods_with_events_sharded_write_the_bytes_of_one_process(tmp_path, sections):
    if sections["peers"].get("batched") and DEVICE["name"] != "cpu":
        pytest.skip("batched groups are divided among ranks on a CPU only")
    same_sharded(exp_file(tmp_path, **sections), tmp_path, "--shard-events")


@pytest.mark.parametrize(
    "sections,by",
    [
        (RING | {"stop": {"time_s": 0.015}}, "time_s"),
        (ADPSGD | {"stop": {"time_s": 0.05}}, "time_s"),
        (FEDBUFF | {"stop": {"time_s": 0.2}}, "time_s"),
        (FAULTS | {"stop": {"time_s": 0.06}}, "time_s"),  # a crash before it, one after
        (RING | {"stop": {"time_s": 100.0}}, "rounds"),  # the rounds end first
    ],
    ids=["dfedavgm", "adpsgd", "fedbuff", "crashes-churn", "after-the-end"],
)
def test_a_stop_in_time_ends_every_rank_where_one_process_ends(tmp_path, sections, by):
    """``stop.time_s``: every rank holds the stop's timer; the first to take it ends the
    run, and each rank takes its own events up to it and keeps what its peers last scored."""
    one = same_sharded(exp_file(tmp_path, **sections), tmp_path, "--shard-events")
    assert one["summary"]["stop"]["by"] == by and one["summary"]["stop"]["samples"] > 0


CRASH_4 = {"network": {"crashes": {"at": {4: 0.0003}}}}  # during its first training


@pytest.mark.parametrize(
    "sections",
    [
        RING | {"stop": {"samples": 150}},
        ADPSGD | {"stop": {"samples": 150}, "eval": {"every": 1, "every_s": 0.0002}},
        FEDBUFF | {"stop": {"samples": 200}},
        FAULTS | {"stop": {"samples": 2000}},  # in round 2, after a crash and churn
        FAULTS | {"stop": {"samples": 2000, "time_s": 0.03}},  # the time first
        RING | CRASH_4 | {"stop": {"samples": 20}},
    ],
    ids=["dfedavgm", "adpsgd-probed", "fedbuff", "crashes-churn", "time-first", "crash"],
)
def test_a_stop_in_samples_ends_every_rank_where_one_process_ends(tmp_path, sections):
    """``stop.samples``: the ranks' windows last at most a training, so each training that
    ends in one was announced to every rank before it; the ranks take their events up to
    the training where every rank's count may reach the budget, and end there if it does.
    Peer 4 crashes during the first training to end, which would have reached the budget:
    the run ends at the next one, as in one process."""
    one = same_sharded(exp_file(tmp_path, **sections), tmp_path, "--shard-events")
    stop = one["summary"]["stop"]
    budget = sections["stop"]["samples"]
    assert stop["by"] == ("time_s" if "time_s" in sections["stop"] else "samples")
    assert stop["samples"] >= budget or stop["by"] == "time_s"
    if "network" in sections and sections["network"] == CRASH_4["network"]:
        spread(exp_file(tmp_path, **(RING | {"stop": {"samples": 20}})), tmp_path / "no", 1)
        first = json.loads((tmp_path / "no" / "summary.json").read_text())["stop"]["samples"]
        assert 20 <= first < stop["samples"]  # without the crash, an earlier training


@pytest.mark.parametrize(
    "sections",
    [
        ADPSGD | {"eval": {"every": 1, "every_s": 0.01, "targets": [0.5, 0.9]}},
        FEDBUFF | {"eval": {"every": 1, "every_s": 0.05}},  # the server's model
        FAULTS | {"eval": {"every": 1, "every_s": 0.02}, "stop": {"time_s": 0.1}},
        RING | {"eval": {"every": 1, "every_s": 0.004}, "stop": {"accuracy": 0.24}},
    ],
    ids=["adpsgd-targets", "fedbuff-server", "crashes-stop-at-a-probe", "stop-accuracy"],
)
def test_the_run_model_is_probed_where_one_process_probes_it(tmp_path, sections):
    """``eval.every_s``: every rank takes each probe together (the mean of every rank's
    peers' latest models, summed from rank to rank; rank 0 scores it) at the probe's place
    in one process's order, and not after the run's end."""
    one = same_sharded(exp_file(tmp_path, **sections), tmp_path, "--shard-events")
    probes = [r for r in _rows(one) if r[2] == "run"]
    assert len(probes) >= 4, probes
    if "accuracy" in sections.get("stop", {}):
        assert one["summary"]["stop"]["by"] == "accuracy"


QUIET = '''
import math
from dataclasses import dataclass

from p2pfl.api import METHODS, Evaluate, Finish, Log, Method, Now, Recv, Wait


@METHODS.register("quiet_rank")
@dataclass(kw_only=True, eq=False)
class QuietRank(Method):
    """Peers 4 and 5 (rank 2's of 3) score their first model, then listen "until the end"
    for a message that never comes; the others log the time every millisecond for 10 ms."""

    serverless = True

    def total_rounds(self, num_peers):
        return 10

    def behaviour(self, ctx):
        state = ctx.init_state()
        if ctx.node >= 4:
            yield Evaluate(state, 0)
            yield Recv(kinds=("model",), count=1, deadline=math.inf)
        else:
            for r in range(10):
                yield Wait((r + 1) * 0.001)
                yield Log(r + 1, "at", (yield Now()))
        yield Finish(state)
'''


def test_a_quiet_rank_takes_its_timers_up_to_the_stop(tmp_path):
    """Rank 2's peers only listen, so it puts its timers off; when rank 0 takes the stop
    at 5.5 ms, rank 2 takes what one process took before it: peer 5's crash at 3.5 ms
    (peer 5 then has no model; peer 4 keeps the one it scored)."""
    exp = plugin_ring(
        tmp_path, "quiet_rank", QUIET,
        network={"crashes": {"at": {5: 0.0035}}}, stop={"time_s": 0.0055},
        eval={"every": 1, "per_peer": True},
    )  # fmt: skip
    one = same_sharded(exp, tmp_path, "--shard-events")
    assert one["summary"]["stop"]["by"] == "time_s"
    scored = [p["peer"] for p in one["summary"]["per_peer"] if p["accuracy"] is not None]
    assert scored == [4]
    assert max(float(r[4]) for r in _rows(one) if r[3] == "at") == pytest.approx(0.005)


def test_each_rank_runs_only_its_own_peers(tmp_path, monkeypatch):
    """Rank 0 of 3 (this process; the others are forked) runs peers 0 and 1 of six: their
    behaviours, and only the events they cause."""
    if DEVICE["name"] != "cpu":
        pytest.skip("on a GPU host the ranks run in fresh processes")
    ran: list[list[int]] = []
    steps = {"one": 0, "rank 0": 0}
    run, step, keyed = sim.SimRuntime.run, simpy.Environment.step, KeyedEnvironment.step

    def spy(self, behaviours):
        ran.append(sorted(behaviours))
        return run(self, behaviours)

    def counted(name, original):
        def count(env):
            steps[name] += 1
            original(env)

        return count

    monkeypatch.setattr(sim.SimRuntime, "run", spy)
    monkeypatch.setattr(simpy.Environment, "step", counted("one", step))
    monkeypatch.setattr(KeyedEnvironment, "step", counted("rank 0", keyed))
    same_sharded(exp_file(tmp_path, **RING), tmp_path, "--shard-events")
    assert ran == [[0, 1, 2, 3, 4, 5], [0, 1]]
    assert 0 < steps["rank 0"] < steps["one"] / 2  # its peers' events, and their arrivals


BAD = [
    (
        {"eval": {"every": 1, "matching": {}}},
        "--shard-events: eval.matching needs every peer's model in one process",
    ),
    (
        {"topology": {"kind": "ring", "link": {"latency_s": 0.0}}},
        "--shard-events: a link between two ranks' peers has no latency",
    ),
]


@pytest.mark.parametrize("sections,message", BAD, ids=["matching", "latency"])
def test_what_a_rank_cannot_decide_alone_is_one_error_line(tmp_path, capsys, sections, message):
    out = tmp_path / "out"
    exp = exp_file(tmp_path, **(RING | sections))
    code = main(["run", str(exp), "--out", str(out), "--workers", "2", "--shard-events"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert not out.exists()


def plugin_ring(tmp_path: Path, method: str, source: str, **sections: Any) -> Path:
    """An experiment running ``method``, registered by the plug-in ``source``, on a ring of
    six peers (two per rank on three ranks)."""
    plugin = tmp_path / f"{method}.py"
    plugin.write_text(source)
    return exp_file(
        tmp_path, plugins=[str(plugin)], topology={"kind": "ring"}, peers={"count": 6},
        algorithm={"name": method}, **sections,
    )  # fmt: skip


def _rows(run: dict[str, Any]) -> list[list[str]]:
    """A run's ``metrics.csv`` rows, split (time, round, peer, metric, value)."""
    return [line.split(",") for line in run["metrics.csv"].decode().splitlines()[1:]]


LISTENERS = '''
import math
from dataclasses import dataclass

import torch

from p2pfl.api import METHODS, Artifact, Finish, Log, Method, Now, Recv, Report, Send, Wait


@METHODS.register("late_listeners")
@dataclass(kw_only=True, eq=False)
class LateListeners(Method):
    """Each peer sends one message, then listens "until the end" for two, the later peers
    first; woken at the run's end, each logs the time: the rows' order is the wake order.
    Peers 4 and 5 (rank 2's of 3) also report a baseline and write a matrix."""

    serverless = True

    def total_rounds(self, num_peers):
        return 1

    def behaviour(self, ctx):
        state = ctx.init_state()
        yield Send(ctx.neighbours[0], "model", 1, state)  # 0 and 1 get two: woken then
        yield Wait([3, 0, 5, 1, 4, 2][ctx.node % 6] * 0.001)
        got = yield Recv(kinds=("model",), count=2, deadline=math.inf)
        yield Log(1, "woke", (yield Now()) + len(got))
        if ctx.node >= 4:
            yield Report(f"start{ctx.node}", state)
            yield Artifact(f"grid{ctx.node}", torch.arange(6.0).view(2, 3) / (ctx.node + 3))
        yield Finish(state)
'''


def test_listeners_of_every_rank_wake_in_the_order_they_began_to_wait(tmp_path):
    """At a run's end the nodes listening "until the end" are woken as one process wakes
    them, in the order they began to wait (not by node, nor rank by rank): the rows they
    write then come out in that order, and rank 0 writes another rank's baselines and
    matrices as one process does."""
    exp = plugin_ring(tmp_path, "late_listeners", LISTENERS)
    one = same_sharded(exp, tmp_path, "--shard-events")
    woke = [row[2] for row in _rows(one) if row[3] == "woke"]
    assert woke[2:] == ["3", "5", "4", "2"]  # as they began to wait: not by node, nor rank
    assert list(one["summary"]["baselines"]) == ["start5", "start4"]
    for name in ("grid4.csv", "grid4.png", "grid5.csv", "grid5.png"):
        assert (tmp_path / "sharded" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


LATE_CRASH = '''
import math
from dataclasses import dataclass

from p2pfl.api import METHODS, Finish, Log, Method, Recv, Wait


@METHODS.register("late_crash")
@dataclass(kw_only=True, eq=False)
class LateCrash(Method):
    """Peers 4 and 5 are busy until 0.5 s; the others listen "until the end" from the start,
    and log when woken at the run's end (a crashed one never is)."""

    serverless = True

    def total_rounds(self, num_peers):
        return 1

    def behaviour(self, ctx):
        state = ctx.init_state()
        if ctx.node >= 4:
            yield Wait(0.5)
        else:
            got = yield Recv(kinds=("model",), count=1, deadline=math.inf)
            yield Log(1, "woke", len(got))
        yield Finish(state)
'''


def test_a_listeners_crash_counts_only_while_another_rank_is_busy(tmp_path):
    """One process takes a crash time while any node is still busy, and never after: peer 1
    (rank 0 of 3, listening) crashes at 0.2 s, while rank 2's peers are busy until 0.5 s;
    peer 2 (rank 1) would crash at 0.505 s, after the run's last event but inside its last
    window, and does not. A rank whose nodes all listen puts its crash times off until it
    knows."""
    network = {"crashes": {"at": {1: 0.2, 2: 0.505}}}
    exp = plugin_ring(tmp_path, "late_crash", LATE_CRASH, network=network)
    one = same_sharded(exp, tmp_path, "--shard-events")
    assert sorted(row[2] for row in _rows(one) if row[3] == "woke") == ["0", "2", "3"]


STUCK = '''
from dataclasses import dataclass

from p2pfl.api import METHODS, Finish, Method, Recv


@METHODS.register("stuck")
@dataclass(kw_only=True, eq=False)
class Stuck(Method):
    """Peers 1 and 5 wait, without a deadline, for a message nobody sends."""

    serverless = True

    def total_rounds(self, num_peers):
        return 1

    def behaviour(self, ctx):
        state = ctx.init_state()
        if ctx.node in (1, 5):
            yield Recv(kinds=("model",), count=1)
        yield Finish(state)
'''


def _failed(exp: Path, tmp_path: Path, capfd: Any) -> list[tuple[str, str]]:
    """``exp``, which fails (exit 1), in one process and on three ranks of sharded events:
    each run's last line on stderr and its ``summary.json`` error."""
    told = []
    for out, world in (("one", 1), ("three", 3)):
        options = ("--shard-events",) if world > 1 else ()
        assert spread(exp, tmp_path / out, world, *options) == 1
        line = capfd.readouterr().err.strip().splitlines()[-1]
        told.append((line, json.loads((tmp_path / out / "summary.json").read_text())["error"]))
    return told


def test_a_deadlock_names_every_ranks_waiting_nodes(tmp_path, capfd):
    """Peers 1 and 5 (ranks 0 and 2 of 3) wait for ever: one error line names both, as one
    process names them (exit 1)."""
    lines = [line for line, _ in _failed(plugin_ring(tmp_path, "stuck", STUCK), tmp_path, capfd)]
    assert lines[0].startswith("error: run failed: at t=0.000s: deadlock: 1 waits for ")
    assert "; 5 waits for " in lines[0]
    assert lines[1] == lines[0]


BOOM = '''
from dataclasses import dataclass

from p2pfl.api import METHODS, Finish, Method, Wait


@METHODS.register("boom")
@dataclass(kw_only=True, eq=False)
class Boom(Method):
    """Peer 4 (rank 2's of 3) fails at 5 ms; the others would finish at 11-16 ms."""

    serverless = True

    def total_rounds(self, num_peers):
        return 1

    def behaviour(self, ctx):
        state = ctx.init_state()
        yield Wait(0.001 * (ctx.node + 1))
        if ctx.node == 4:
            raise ValueError("boom")
        yield Wait(0.01 + 0.001 * (ctx.node + 1))
        yield Finish(state)
'''


def test_a_peer_that_fails_on_another_rank_is_told_once(tmp_path, capfd):
    """Rank 2's peer fails at 5 ms: rank 0's one error line is the line one process writes,
    and summary.json tells it once, at the time it failed."""
    (line, error), (sharded_line, sharded_error) = _failed(
        plugin_ring(tmp_path, "boom", BOOM), tmp_path, capfd
    )
    assert line == sharded_line == "error: run failed: at t=0.005s: boom"
    assert error == "RunError: at t=0.005s: boom"
    assert sharded_error == "RankFailed: run failed: at t=0.005s: boom"


SHORT = '''
from dataclasses import dataclass

from p2pfl.api import METHODS, Finish, Method, Train


@METHODS.register("short_train")
@dataclass(kw_only=True, eq=False)
class ShortTrain(Method):
    """Each peer trains one epoch of the train: section's two, then another."""

    serverless = True

    def total_rounds(self, num_peers):
        return 2

    def behaviour(self, ctx):
        state = ctx.init_state()
        for r in range(2):
            state = (yield Train(state, r, overrides={"epochs": 1})).state
        yield Finish(state)
'''


def test_a_training_shorter_than_the_windows_under_a_samples_stop_fails_by_name(tmp_path, capfd):
    """Under ``stop.samples`` a window lasts at most a training of the ``train:`` section;
    a method that trains for less (its overrides) would end a training that the other
    ranks did not know of: the run fails, naming the peer, where one process runs."""
    exp = plugin_ring(
        tmp_path, "short_train", SHORT, stop={"samples": 10**6},
        train={"epochs": 2, "batch_size": 32, "lr": 0.05},
    )  # fmt: skip
    assert spread(exp, tmp_path / "one", 1) == 0
    assert spread(exp, tmp_path / "three", 3, "--shard-events") == 1
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert "stop.samples counts every rank's trainings where they end" in line, line
    assert "(its method's overrides): use --shard" in line and "trained for" in line


BUSY = '''
import time
from dataclasses import dataclass
from pathlib import Path

from p2pfl.api import METHODS, Compute, Finish, Method, Wait

MARK = Path(__file__).with_name("computing")


def nap(module, data, device):
    MARK.touch()
    end = time.monotonic() + 60
    while time.monotonic() < end:  # Python's own loop, which takes a signal between lines
        pass


@METHODS.register("busy")
@dataclass(kw_only=True, eq=False)
class Busy(Method):
    """Peer 0 (rank 0's) computes for a minute, outside every collective; the others wait."""

    serverless = True

    def total_rounds(self, num_peers):
        return 1

    def behaviour(self, ctx):
        state = ctx.init_state()
        if ctx.node == 0:
            yield Compute(state, nap)
        else:
            yield Wait(1.0)
        yield Finish(state)
'''


def test_a_rank_that_dies_while_rank_0_computes_is_told_as_a_failed_exchange_tells_it(
    tmp_path,
):
    """Rank 1 is killed while rank 0 is in a peer's computation, where no exchange can fail:
    rank 0 is interrupted, and its summary.json tells the death in the form a failed
    exchange gives it (``test_ranks``' dead rank), not wrapped in the time it came."""
    exp = plugin_ring(tmp_path, "busy", BUSY)
    cmd = [sys.executable, "-m", "p2pfl", "run", str(exp), "--out", str(tmp_path / "o")]
    proc = subprocess.Popen(
        [*cmd, "--quiet", "--workers", "2", "--shard-events"], stderr=subprocess.PIPE,
        text=True, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        for _ in range(600):  # a minute at most
            if (tmp_path / "computing").exists():
                break
            time.sleep(0.1)
        rank = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-x", "p2pfl rank 1"], capture_output=True, text=True
        )  # fmt: skip
        os.kill(int(rank.stdout.split()[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1 and err == "error: worker rank 1 exited with code -9\n", err
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["error"] == "RankFailed: worker rank 1 exited with code -9"
