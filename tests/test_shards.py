"""A population sharded across ranks (``--shard``): each rank holds only its own peers' models,
and the outputs are the bytes of one process (:mod:`p2pfl.runtime.shards`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_ranks import RING, exp_file, outputs, same_sharded, spread

import p2pfl.app.experiment as experiment
import p2pfl.runtime.children as children
import p2pfl.runtime.train_batcher as train_batcher
import p2pfl.runtime.worker as worker
from conftest import DEVICE
from p2pfl.app.cli import main
from p2pfl.learning.state import is_ghost, state_bytes
from p2pfl.runtime.shards import Shards

GOSSIP = {
    "topology": {"kind": "random_regular", "d": 3},
    "peers": {"count": 8, "batched": True},  # chunked cohorts, each rank its own members
    "algorithm": {"name": "gossip", "rounds": 4},
    "eval": {"every": 2},
}
STAR = {  # a server: rank 0's; every peer's model crosses to it
    "topology": {"kind": "star"},
    "peers": {"count": 6},
    "algorithm": {"name": "fedavg", "rounds": 2},
    "eval": {"every": 1},
}
ADPSGD = {  # passive peers answer in a handler, on arrival
    "topology": {"kind": "ring"},
    "peers": {"count": 6},
    "algorithm": {"name": "adpsgd", "rounds": 3},
}
CHURN = {  # the network's draws: messages lost, peers offline
    "topology": {"kind": "random_regular", "d": 4},
    "peers": {"count": 10},
    "algorithm": {"name": "dfedavgm", "rounds": 4, "wait_s": 0.5},
    "network": {
        "churn": {"online": {"dist": "exponential", "mean_s": 0.02}, "offline_fraction": 0.3},
        "links": {"loss": 0.1},
    },
}
STOPPED = RING | {"stop": {"time_s": 0.015}}  # a stop: each keeps the model it last scored


def test_a_sharded_run_writes_the_bytes_of_one_process_on_2_and_4_ranks(tmp_path):
    exp = exp_file(tmp_path, **RING)
    runs = [tmp_path / "w1", tmp_path / "w2", tmp_path / "w4"]
    assert spread(exp, runs[0], 1) == 0
    assert spread(exp, runs[1], 2, "--shard") == 0
    assert spread(exp, runs[2], 4, "--shard") == 0
    one = outputs(runs[0])
    assert outputs(runs[1]) == one and outputs(runs[2]) == one
    assert all(p["accuracy"] is not None for p in one["summary"]["per_peer"])  # owners scored


@pytest.mark.parametrize(
    "sections",
    [GOSSIP, STAR, ADPSGD, CHURN, STOPPED],
    ids=["gossip-batched", "fedavg-star", "adpsgd-handler", "dfedavgm-churn-loss", "stop"],
)
def test_sharded_methods_write_the_bytes_of_one_process(tmp_path, sections):
    if sections["peers"].get("batched") and DEVICE["name"] != "cpu":
        pytest.skip("batched groups are divided among ranks on a CPU only (refused: below)")
    same_sharded(exp_file(tmp_path, **sections), tmp_path, "--shard")


def test_each_rank_holds_only_its_own_peers_models(tmp_path, monkeypatch):
    """Rank 0 of 3 (this process; the others are forked) holds the models of peers 0 and 1
    and ghosts of the other four (layouts, no bytes): a third of one process's; messages
    from the others' peers reached its own with their bytes, and the run's model, the mean
    of every peer's, is real on it."""
    if torch.cuda.device_count():
        pytest.skip("on a GPU host the ranks run in fresh processes")
    seen: list[tuple[dict[int, Any], Any]] = []
    final_state = experiment.final_state

    def spy(finals, topology, start=None, shards=None):
        output = final_state(finals, topology, start, shards)
        seen.append(({p: f.state for p, f in finals.items()}, output))
        return output

    shipped: list[int] = []
    ship = Shards.ship

    def count(self):
        shipped.append(1)
        return ship(self)

    monkeypatch.setattr(experiment, "final_state", spy)
    monkeypatch.setattr(Shards, "ship", count)
    exp = exp_file(tmp_path, **RING)
    assert spread(exp, tmp_path / "one", 1) == 0
    assert spread(exp, tmp_path / "three", 3, "--shard") == 0
    (alone, _), (held, output) = seen
    assert not any(is_ghost(s) for s in alone.values())
    assert sorted(p for p, s in held.items() if not is_ghost(s)) == [0, 1]
    real = sum(state_bytes(s) for s in held.values() if not is_ghost(s))
    assert real * 3 == sum(state_bytes(s) for s in alone.values())
    assert not is_ghost(output) and shipped  # messages crossed ranks, with their bytes


def test_a_method_that_reads_another_ranks_model_fails_saying_so(tmp_path, capfd):
    """Krum picks a model by its distances: a ghost has none. One line, exit 1."""
    krum = {
        "topology": {"kind": "mesh"},
        "peers": {"count": 6},
        "algorithm": {"name": "dfedavgm", "rounds": 2, "aggregator": {"name": "krum", "f": 1}},
    }
    exp = exp_file(tmp_path, **krum)
    assert main(["run", str(exp), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert spread(exp, tmp_path / "sharded", 2, "--shard") == 1
    err = capfd.readouterr().err.strip().splitlines()[-1]  # ranks may be fresh processes
    assert "dfedavgm cannot run sharded (--shard): it reads another rank's model" in err, err


BAD = [
    ([], {}, "--shard: shards one experiment over ranks: add --workers N"),
    (
        ["--workers", "2"],
        {"eval": {"every": 1, "every_s": 0.01}},
        "--shard: eval.every_s needs every peer's model in one process",
    ),
    (
        ["--workers", "2"],
        {"sweep": {"seed": [0, 1]}},
        "--shard: shards one experiment over ranks: a sweep's --workers runs cells side by side",
    ),
    (
        ["--workers", "5"],
        {"peers": {"count": 4}},
        "--workers: 5 ranks for 4 peers: at most one rank per peer",
    ),
]


def test_batched_groups_that_ranks_cannot_divide_refuse_the_shard(tmp_path, capsys):
    """On CUDA a batched group's bits depend on the whole group (the torch.func path), so
    its peers cannot train on their own ranks: refused before anything is written."""
    if DEVICE["name"] == "cpu":
        pytest.skip("on a CPU the hand-written MLP path's groups divide (tests above)")
    out = tmp_path / "out"
    exp = exp_file(tmp_path, **GOSSIP)
    code = main(["run", str(exp), "--out", str(out), "--workers", "2", "--shard"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --shard: peers.batched on cuda: a batched group trains")
    assert not out.exists()


@pytest.mark.parametrize("argv,sections,message", BAD, ids=["alone", "every_s", "sweep", "peers"])
def test_a_run_that_cannot_be_sharded_is_one_error_line(tmp_path, capsys, argv, sections, message):
    out = tmp_path / "out"
    code = main(["run", str(exp_file(tmp_path, **sections)), "--out", str(out), "--shard", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--shard", "--shard-events"])
def test_a_share_that_does_not_fit_in_memory_is_one_error_line(tmp_path, capsys, monkeypatch, flag):
    """Four peers of a 68 MB model on 2 ranks: each holds 2 peers' models, up to 3 each at
    once (408 MB), with 300 MiB free. The error names the flag the user gave."""
    monkeypatch.setattr(children, "available_memory", lambda: 300 << 20)
    big = {"model": {"name": "mlp", "hidden": [4096, 4096]}}
    out = tmp_path / "out"
    code = main(["run", str(exp_file(tmp_path, **big)), "--out", str(out), "--workers", "2", flag])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {flag}: each of 2 rank(s) on this host holds up to 2 peers'")
    assert "0.29 GiB are free" in err
    assert not out.exists()


@pytest.mark.parametrize("argv", [[], ["--workers", "2"]], ids=["one process", "workers"])
def test_a_population_that_does_not_fit_in_memory_is_one_error_line(
    tmp_path, capsys, monkeypatch, argv
):
    """Unsharded, every simulating process holds all four peers' models, 3 × 4 × 68 MB
    (816 MB), with 300 MiB free: refused before anything is written, pointing at
    --shard-events."""
    monkeypatch.setattr(children, "available_memory", lambda: 300 << 20)
    big = {"model": {"name": "mlp", "hidden": [4096, 4096]}}
    out = tmp_path / "out"
    code = main(["run", str(exp_file(tmp_path, **big)), "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    each = "each of 2 processes" if argv else "this run"
    assert err.startswith(f"error: peers.count: {each} holds 4 peers' models, about 0.76 GiB")
    assert "0.29 GiB are free: shard them over ranks (--workers N --shard-events" in err
    assert not out.exists()


def test_scores_held_behind_a_bounded_number_of_evaluations_keep_the_rows_in_order(
    tmp_path, monkeypatch
):
    """Over ranks, deferred scores are settled every ``HELD_EVALS · world`` evaluations
    (sharded: ``HELD_SCORES``, the owners' scores; here each one: the ranks are forked with
    the patched bounds), not only at the next flush: the rows are still written in the
    order of one process."""
    if torch.cuda.device_count():
        pytest.skip("on a GPU host the ranks run in fresh processes, without the patch")
    monkeypatch.setattr(worker, "HELD_EVALS", 1)
    monkeypatch.setattr(worker, "HELD_SCORES", 1)
    exp = exp_file(tmp_path, **RING)
    assert spread(exp, tmp_path / "one", 1) == 0
    assert spread(exp, tmp_path / "two", 2) == 0
    assert spread(exp, tmp_path / "three", 3, "--shard") == 0
    one = outputs(tmp_path / "one")
    assert outputs(tmp_path / "two") == one and outputs(tmp_path / "three") == one


def test_each_rank_trains_its_next_chunk_of_a_cohort_at_once(tmp_path, monkeypatch):
    """Over sharded ranks a cohort is computed a chunk per rank at a time (each rank's
    next ``CHUNK`` trainings): the bytes are still one process's."""
    if torch.cuda.device_count():
        pytest.skip("on a GPU host the ranks run in fresh processes, without the patch")
    monkeypatch.setattr(train_batcher, "CHUNK", 2)
    same_sharded(exp_file(tmp_path, **GOSSIP), tmp_path, "--shard")


@pytest.mark.parametrize("command", ["run", "peer"])
def test_node_processes_that_do_not_fit_in_memory_are_one_error_line(
    tmp_path, capsys, monkeypatch, command
):
    """A real run forks a process per node on this host, 8 MiB and 3 models each: four
    peers and a server of a 68 MB model (5 × (8 MiB + 204 MB) = 1.03 GiB) with 300 MiB
    free are refused before any fork, nothing written (10,000 nodes once forked away)."""
    monkeypatch.setattr(children, "available_memory", lambda: 300 << 20)
    monkeypatch.setattr(experiment, "run", lambda *a, **k: pytest.fail("the run started"))
    big = {"model": {"name": "mlp", "hidden": [4096, 4096]}}
    out = tmp_path / "out"
    exp = str(exp_file(tmp_path, **big))
    if command == "run":
        code = main(["run", exp, "--out", str(out), "--transport", "zmq"])
        nodes = "5 node processes"
    else:
        addresses = tmp_path / "addresses.yaml"
        addresses.write_text("".join(f"{n}: tcp://127.0.0.1:{5600 + n}\n" for n in range(4)))
        addresses.write_text(addresses.read_text() + "server: tcp://127.0.0.1:5610\n")
        args = ["--peer", "0-3", "--addresses", str(addresses), "--out", str(out)]
        code = main(["peer", exp, *args])
        nodes = "4 node processes"
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: peers.count: {nodes} on this host need about"), err
    assert "0.29 GiB are free: spread the nodes over hosts" in err
    assert not out.exists()
