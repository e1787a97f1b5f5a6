"""Large populations (issue 38): what keeps memory near the peers' states changes no output.

- A raw message delivered in the simulation is a copy-on-write clone of the sender's
  tensors (``wire._private_copy``): no bytes are copied until one side writes, and neither
  side ever sees the other's writes.
- A cohort of deferred trainings in one divisible batched group is computed a chunk at a
  time (``TrainBatcher``), soonest end first, instead of all at once.

Both are checked against the old behaviour (plain clones; the whole cohort in one call):
``comm.csv``, ``metrics.csv`` and ``summary.json`` (minus wall times) byte for byte.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from conftest import DEVICE, run_cli, run_experiment, thousand_peers
from p2pfl.app.cli import ALLOCATOR, on_glibc
from p2pfl.core import tensors
from p2pfl.core.seeding import derive_seed
from p2pfl.learning.state import clone_state
from p2pfl.methods.adpsgd import is_active
from p2pfl.network import wire
from p2pfl.network.message import Message
from p2pfl.network.topology import Topology, build_topology
from p2pfl.runtime import train_batcher
from p2pfl.runtime.setup import EvalConfig
from p2pfl.runtime.train_batcher import TrainBatcher
from p2pfl.runtime.worker import Worker

WALL = {"wall_time_s", "compute_wall_s"}


def outputs(out: Path) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    return {
        "comm.csv": (out / "comm.csv").read_bytes(),
        "metrics.csv": (out / "metrics.csv").read_bytes(),
        "summary": {k: v for k, v in summary.items() if k not in WALL},
    }


def test_a_delivered_model_is_a_private_copy_that_costs_nothing_until_written():
    weight, bias = torch.randn(64, 32), torch.randn(64)
    msg = Message("model", 0, 1, 3, {"w": weight, "b": bias}, {"n": 1})
    received, size = wire.deliver(msg)
    assert size == len(wire.encode(msg))
    w = received.tensors["w"]
    assert torch._C._is_cow_tensor(w)  # 8 KiB, a whole storage: shared until written
    assert not torch._C._is_cow_tensor(received.tensors["b"])  # 256 bytes: cloned
    assert torch.equal(w, weight) and torch.equal(received.tensors["b"], bias)
    before = weight.clone()
    weight.add_(1.0)  # the sender writes: the receiver keeps what was sent
    assert torch.equal(w, before)
    w.mul_(0.0)  # the receiver writes: the sender keeps its own
    assert torch.equal(weight, before + 1.0) and not w.any()
    assert received.meta == {"n": 1} and received.meta is not msg.meta


def test_a_view_is_cloned_not_shared():
    """A lazy clone of a slice would keep its whole storage alive."""
    stack = torch.randn(8, 64, 32)
    received, _ = wire.deliver(Message("model", 0, 1, 1, {"w": stack[3]}))
    w = received.tensors["w"]
    assert not torch._C._is_cow_tensor(w) and w.untyped_storage().nbytes() == 64 * 32 * 4
    assert torch.equal(w, stack[3])


def test_memory_torch_did_not_allocate_is_cloned():
    """numpy's memory (a decoded frame's too) cannot be shared copy-on-write: cloned."""
    weight = torch.from_numpy(np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    received, _ = wire.deliver(Message("model", 0, 1, 1, {"w": weight}))
    w = received.tensors["w"]
    assert not torch._C._is_cow_tensor(w) and torch.equal(w, weight)
    weight.add_(1.0)
    assert w[0, 0] == 0.0
    (copy,) = clone_state({"w": weight}).values()
    assert not torch._C._is_cow_tensor(copy) and torch.equal(copy, weight)


def test_clone_state_is_copy_on_write_and_private():
    model = {"w": torch.randn(64, 32), "b": torch.randn(64)}
    copy = clone_state(model)
    assert torch._C._is_cow_tensor(copy["w"]) and not torch._C._is_cow_tensor(copy["b"])
    before = {k: v.clone() for k, v in model.items()}
    model["w"].add_(1.0)
    copy["b"].add_(1.0)
    assert torch.equal(copy["w"], before["w"]) and torch.equal(model["b"], before["b"])


def _old_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain clones for every message and state, every cohort in one call (before issue
    38)."""
    monkeypatch.setattr(tensors, "LAZY", None)
    monkeypatch.setattr(Worker, "divisible", lambda self, jobs: False)


def _spy_chunks(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """The size of every training call, and of every chunk of a cohort among them."""
    calls: list[int] = []
    chunks: list[int] = []
    run, chunk = TrainBatcher._run, TrainBatcher._chunk

    def run_spy(self: TrainBatcher, jobs: list) -> None:
        calls.append(len(jobs))
        run(self, jobs)

    def chunk_spy(self: TrainBatcher, job: Any) -> None:
        cohort = job.cohort
        before = len(cohort)
        chunk(self, job)
        chunks.append(before - len(cohort))

    monkeypatch.setattr(TrainBatcher, "_run", run_spy)
    monkeypatch.setattr(TrainBatcher, "_chunk", chunk_spy)
    return calls, chunks


CASES = {
    # label skew: unequal data, so unequal training times: chunks go by end, not by peer
    "dfedavgm-ring": {
        "topology": {"kind": "ring"},
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
        "algorithm": {"name": "dfedavgm", "rounds": 3},
        "train": {"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
    },
    "gossip-regular": {
        "topology": {"kind": "random_regular", "d": 4},
        "model": {"name": "logreg"},
        "algorithm": {"name": "gossip", "rounds": 4},
        "train": {"epochs": 1, "batch_size": 16, "lr": 0.05},
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_messages_and_chunked_cohorts_leave_outputs_byte_identical(
    tmp_path, monkeypatch, case
):
    if DEVICE["name"] != "cpu":
        pytest.skip("cohorts are computed chunk by chunk on the CPU's hand-written MLP path only")
    sections = CASES[case] | {"peers": {"count": 12, "batched": True}, "eval": {"every": 1}}
    monkeypatch.setattr(train_batcher, "CHUNK", 3)  # several chunks of 12 peers
    calls, chunks = _spy_chunks(monkeypatch)
    run_experiment(tmp_path / "new", **sections)
    new = outputs(tmp_path / "new")
    assert len(chunks) > 3 and max(chunks) <= 4  # a lone one, too, trains batched
    calls.clear()
    with monkeypatch.context() as m:
        _old_ways(m)
        run_experiment(tmp_path / "old", **sections)
    assert max(calls) >= 5  # the old way: whole cohorts
    old = outputs(tmp_path / "old")
    assert new == old
    assert new["summary"]["comm"]["messages"] > 0


def test_a_cohort_of_mixed_configs_still_trains_in_one_call(tmp_path, monkeypatch):
    """FedAvg's stragglers train fewer epochs (another config): not one divisible group,
    so the cohort trains at once, as before."""
    calls, chunks = _spy_chunks(monkeypatch)
    monkeypatch.setattr(train_batcher, "CHUNK", 2)
    run_experiment(
        tmp_path / "a",
        peers={"count": 8, "batched": True, "link": {"bandwidth_bps": 1e10}},
        algorithm={"name": "fedavg", "rounds": 2, "stragglers": {"fraction": 0.5, "epochs": 1}},
        train={"epochs": 2, "batch_size": 16, "lr": 0.05},
    )
    assert max(calls) >= 4 and not chunks


def test_more_workers_than_peers_is_one_error_and_writes_nothing(tmp_path):
    config = {
        "name": "few",
        "seed": 0,
        "dataset": {"name": "digits"},
        "partition": {"name": "iid"},
        "model": {"name": "mlp", "hidden": [8]},
        "topology": {"kind": "ring"},
        "peers": {"count": 2},
        "algorithm": {"name": "dfedavgm", "rounds": 1},
    }
    out = tmp_path / "out"
    done = run_cli(tmp_path / "few.yaml", config, out, "--workers", "3")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --workers: 3 ranks for 2 peers: at most one rank per peer"
    ]
    assert not out.exists()


FRAGMENTS = """
import ctypes, torch
fields = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in fields.split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
states = [torch.empty(50176) for _ in range(2000)]
small = [None] * len(states)
before = libc.mallinfo2().arena
for _ in range(3):
    for i in range(len(states)):
        new = torch.empty(50176)
        small[i] = torch.empty(16)
        states[i] = new
print(libc.mallinfo2().arena - before)
"""
"""Three rounds of 2,000 peers each replacing its 200,704-byte model, a small tensor made
after each new model (as a step's bookkeeping is): the heap's growth in bytes."""


def heap_growth(tunables: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", FRAGMENTS], capture_output=True, text=True, timeout=120,
        env=os.environ | {"GLIBC_TUNABLES": tunables, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not on_glibc(), reason="glibc only")
def test_under_the_commands_allocator_a_freed_model_is_reused_not_stranded():
    """A model freed by its peer makes room for the next one under the settings every
    ``p2pfl`` command runs with (:data:`~p2pfl.app.cli.ALLOCATOR`): the heap grows by less
    than a tenth of the models (by more than all of them with glibc 2.36's defaults; a
    misspelt tunable is ignored by glibc, and this fails)."""
    models = 2000 * 50176 * 4
    assert heap_growth(ALLOCATOR) < models / 10


@pytest.mark.parametrize("algorithm", ["gossip", "dfedavgm"])
def test_the_progress_bar_moves_every_round_when_only_the_last_is_scored(
    tmp_path, monkeypatch, algorithm
):
    """A run scored only at its end (``eval.every`` = its rounds, as the population
    experiments are) moves its progress bar at each round a peer reaches, not from 0 to the
    end at once: a 10⁵-peer gossip run would otherwise show 0/10 for its whole 7 minutes.
    Once full, it counts the nodes that have finished the last round."""
    from tqdm import tqdm

    from conftest import experiment
    from p2pfl.app.experiment import build, run
    from p2pfl.runtime import interpreter

    shown: list[int] = []
    finished: list[str] = []

    class Recording(tqdm):  # type: ignore[type-arg]
        def update(self, n: float | None = 1) -> bool | None:
            shown.append(int(self.n + (n or 0)))
            return super().update(n)

        def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            finished.append(s)
            super().set_postfix_str(s, refresh)

    monkeypatch.setattr(interpreter, "tqdm", Recording)
    config = experiment(
        topology={"kind": "ring"},
        algorithm={"name": algorithm, "rounds": 4},
        eval={"every": 4, "per_peer": False},
    )
    run(build(config), tmp_path / "run", True)
    assert shown == [1, 2, 3, 4]
    # then the count of finished nodes moves while the bar is full: the first and the last
    # are always drawn, those between at most every FINISHED_EVERY_S
    assert finished[0] == "1/4 nodes finished" and finished[-1] == "4/4 nodes finished"
    assert finished == sorted(set(finished))


def metric_rows(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


RING6 = {
    "topology": {"kind": "ring"},
    "peers": {"count": 6},
    "algorithm": {"name": "dfedavgm", "rounds": 3},
}


def test_eval_peers_scores_one_sample_every_round_and_changes_nothing_else(tmp_path):
    """``eval.peers`` scores the same sample of peers (drawn from the seed) at every scored
    round: its rows are the rows those peers have in the run that scores every peer, and
    nothing else changes (messages, the final model, the peers' final scores); a sample of
    every peer is the run without the key, byte for byte."""
    run_experiment(tmp_path / "all", **RING6)
    run_experiment(tmp_path / "six", **RING6, eval={"peers": 6})
    run_experiment(tmp_path / "two", **RING6, eval={"peers": 2})
    full, two = outputs(tmp_path / "all"), outputs(tmp_path / "two")
    assert outputs(tmp_path / "six") == full
    assert two["comm.csv"] == full["comm.csv"] and two["summary"] == full["summary"]
    sample = EvalConfig(peers=2).scored(0, 6)
    assert sample is not None and len(sample) == 2
    kept = [r for r in metric_rows(tmp_path / "all") if not r["peer"].isdigit()
            or int(r["peer"]) in sample]  # fmt: skip
    assert metric_rows(tmp_path / "two") == kept
    rounds = {(r["round"], int(r["peer"])) for r in kept if r["peer"].isdigit()}
    assert rounds == {(k, p) for k in "123" for p in sample}


def test_eval_peers_always_scores_a_server(tmp_path):
    """FedAvg scores its server's model each round; a sample of one peer leaves those rows."""
    run_experiment(tmp_path / "all")  # BASE: FedAvg on a star of 4 peers
    run_experiment(tmp_path / "one", eval={"peers": 1})
    rows = metric_rows(tmp_path / "one")
    assert rows == metric_rows(tmp_path / "all")
    assert [r["round"] for r in rows if r["peer"] == "server" and r["metric"] == "accuracy"] == [
        "1",
        "2",
    ]


def test_eval_peers_writes_the_bytes_of_one_process_over_ranks(tmp_path):
    """Over ranks a peer outside the sample defers nothing: 2 ranks, and 3 sharded ones,
    write what one process does."""
    from test_ranks import exp_file, spread
    from test_ranks import outputs as rank_outputs

    exp = exp_file(tmp_path, **RING6, eval={"every": 2, "peers": 3})
    assert spread(exp, tmp_path / "one", 1) == 0
    assert spread(exp, tmp_path / "two", 2) == 0
    assert spread(exp, tmp_path / "three", 3, "--shard") == 0
    one = rank_outputs(tmp_path / "one")
    assert rank_outputs(tmp_path / "two") == one and rank_outputs(tmp_path / "three") == one
    assert one["metrics.csv"].count(b",accuracy,") == 2 * 3 + 1  # rounds 2 and 3, and final


def test_a_dense_graph_too_large_for_memory_is_refused_before_it_is_drawn(monkeypatch):
    """A mesh's links grow as N² (5·10⁹ at 10⁵ peers): one that the free memory cannot
    hold is a ``ConfigError`` before networkx starts on it; G(n, p) by its expected links;
    a sparse graph of the same peers is built."""
    import networkx as nx

    from p2pfl.core.errors import ConfigError
    from p2pfl.network.topology import LINK_BYTES, build_topology

    monkeypatch.setattr(nx, "complete_graph", lambda n: pytest.fail("drawn"))
    free = 499_500 * LINK_BYTES - 1  # one byte short of a mesh of 1,000 peers
    with pytest.raises(ConfigError, match=r"1,000 peers on a mesh have 499,500 links"):
        build_topology({"kind": "mesh"}, 1000, 0, free=free)
    with pytest.raises(
        ConfigError, match=r"1,000 peers on an erdos_renyi have about 149,850 links"
    ):
        build_topology({"kind": "erdos_renyi"}, 1000, 0, free=free // 4)  # p = 0.3
    sparse = build_topology({"kind": "erdos_renyi", "p": 0.05}, 1000, 0, free=free // 4)
    assert sparse.graph.number_of_nodes() == 1000
    assert build_topology({"kind": "ring"}, 1000, 0, free=1).graph.number_of_edges() == 1000


def test_a_run_on_a_mesh_the_memory_cannot_hold_is_one_error_line(tmp_path, monkeypatch, capsys):
    from p2pfl.app.cli import main
    from p2pfl.runtime import children

    monkeypatch.setattr(children, "available_memory", lambda: 64 * 2**20)
    file = thousand_peers(tmp_path / "exp.yaml", "mesh")
    out = tmp_path / "out"
    assert main(["run", str(file), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: {file}: topology.kind: 1,000 peers on a mesh"
    )
    assert "0.1 GiB are free" in err[0] and not out.exists()


def test_adpsgd_passive_peers_wait_for_their_active_neighbours_without_scanning_all(
    tmp_path, monkeypatch
):
    """An AD-PSGD passive peer waits for one 'done' from each active neighbour: on an
    irregular graph every peer finishes, each passive one got that many, and the run asks
    the topology for neighbours O(N) times (scanning every peer's neighbours from each
    passive peer took 35.6 s of a 10⁴-peer run; 13.4 s without)."""
    calls = [0]
    neighbours = Topology.neighbours

    def counted(self: Topology, node: int) -> list[int]:
        calls[0] += 1
        return neighbours(self, node)

    monkeypatch.setattr(Topology, "neighbours", counted)
    summary = run_experiment(
        tmp_path, topology={"kind": "erdos_renyi", "p": 0.2}, peers={"count": 200},
        algorithm={"name": "adpsgd", "rounds": 2}, eval={"every": 2},
        partition={"name": "iid", "samples_per_peer": 3, "replace": True, "val_fraction": 0},
    )  # fmt: skip
    assert calls[0] <= 4 * 200  # 700; the scan asked 10,600 (100 passive x 100 active)
    assert all(p["accuracy"] is not None for p in summary["per_peer"])  # every peer finished
    with open(tmp_path / "comm.csv", newline="") as f:
        done = Counter(int(r["dst"]) for r in csv.DictReader(f) if r["kind"] == "control")
    graph = yaml.safe_load((tmp_path / "config.yaml").read_text())  # the seeded graph again
    topology = build_topology(graph["topology"], 200, derive_seed(0, "topology"))
    for p in topology.peers:
        if not is_active(p):
            assert done[p] == sum(is_active(i) for i in topology.graph.neighbors(p))
