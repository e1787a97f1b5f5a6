"""Shakespeare by speaking role (p2pfl/data/text.py), the natural partition and the sequence
models (p2pfl/learning/sequence.py): the role parse, the windows, the split, both models
through training, the ledger against ``p2pfl cost``, ZeroMQ against the simulation, and the
bad keys that must stop a run before it writes anything."""

from __future__ import annotations

import csv
import json
import lzma
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli, sim_and_zmq
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError
from p2pfl.data.datasets import load_dataset
from p2pfl.data.federated import make_federated_data
from p2pfl.data.text import TEXT, VOCABULARY, parse_roles, shakespeare, shipped_roles
from p2pfl.learning import batched
from p2pfl.learning.batched import unbatchable
from p2pfl.learning.models import build_model, forward_flops
from p2pfl.learning.training import TrainConfig, Trainer

# A small run: the 6 largest roles, non-overlapping windows, a narrow LSTM, two rounds.
SMALL = {
    "name": "shakespeare-small",
    "seed": 0,
    "dataset": {"name": "shakespeare", "stride": 160, "min_lines": 100},
    "partition": {"name": "natural"},
    "model": {"name": "char_lstm", "hidden": 16, "layers": 1},
    "topology": {"kind": "star"},
    "peers": {"count": 6},
    "algorithm": {"name": "fedavg", "rounds": 2},
    "train": {"epochs": 1, "batch_size": 32, "optimizer": "sgd", "lr": 0.8},
    "eval": {"every": 1, "per_peer": False},
}


def test_the_shipped_text_is_tinyshakespeare():
    raw = lzma.decompress(TEXT.read_bytes())
    assert len(raw) == 1_115_394 and raw.count(b"\n") == 40_000
    assert raw.startswith(b"First Citizen:\nBefore we proceed any further, hear me speak.\n")
    assert len(VOCABULARY) == 80 and len(set(VOCABULARY)) == 80  # LEAF's vocabulary


def test_roles_are_parsed_from_the_speaker_headings():
    roles = shipped_roles()
    # counted independently with awk over the text: lines after a heading up to a blank line
    assert len(roles) == 309
    assert len(roles["GLOUCESTER"]) == 902
    assert len(roles["First Citizen"]) == 93
    assert roles["First Citizen"][:2] == [
        "Before we proceed any further, hear me speak.",
        "You are all resolved rather to die than to famish?",
    ]
    assert list(roles)[:3] == ["First Citizen", "All", "Second Citizen"]  # order of first line
    text = "A:\nhello\n\nB:\n\nA:\nagain: now\nthere\n\nC:\n"
    assert parse_roles(text) == {"A": ["hello", "again: now", "there"], "B": [], "C": []}


def test_windows_labels_and_the_train_test_cut():
    data = shakespeare(min_lines=100, seq_len=80, stride=40)
    assert data.tokens and data.input_shape == (80,) and data.num_classes == 80
    assert data.train_x.dtype == torch.int64 and data.train_y.dtype == torch.int64
    assert data.group_names[0] == "MENENIUS"  # First Citizen speaks 93 lines, under 100
    first = "".join(VOCABULARY[i] for i in data.train_x[0])
    assert (
        first == "What work's, my countrymen, in hand? where go you With bats and clubs? The matte"
    )
    assert VOCABULARY[int(data.train_y[0])] == "r"  # "The matter?"
    # the next window starts 40 characters on, and holds the label at its position 40
    assert torch.equal(data.train_x[1][:40], data.train_x[0][40:])
    assert int(data.train_x[1][40]) == int(data.train_y[0])
    names = data.group_names
    assert names is not None and len(names) == len(set(names))
    assert all(len(shipped_roles()[n]) >= 100 for n in names)
    train_roles = set(data.train_groups.tolist())
    assert train_roles == set(data.test_groups.tolist()) == set(range(len(names)))
    # per role: roughly 80 % of its windows train, and no test window repeats a train one
    g = names.index("GLOUCESTER")
    tr = data.train_x[data.train_groups == g]
    te = data.test_x[data.test_groups == g]
    assert 0.7 < len(tr) / (len(tr) + len(te)) < 0.85
    seen = {tuple(r.tolist()) for r in tr}
    assert not any(tuple(r.tolist()) in seen for r in te)


def test_min_lines_drops_small_roles():
    counts = {n: len(lines) for n, lines in shipped_roles().items()}
    for min_lines in (50, 100, 300):
        data = shakespeare(min_lines=min_lines, stride=80)
        assert set(data.group_names) == {n for n, c in counts.items() if c >= min_lines}
    assert len(shakespeare(min_lines=50, stride=80).group_names) == 101
    with pytest.raises(ConfigError, match="min_lines: must be >= 0"):
        shakespeare(min_lines=-1)
    with pytest.raises(ConfigError, match="no role has 5000 lines"):
        shakespeare(min_lines=5000)


def test_natural_partition_takes_the_largest_roles_deterministically():
    data = load_dataset({"name": "shakespeare", "stride": 80, "min_lines": 50}, seed=0)
    options = {"name": "natural", "val_fraction": 0.1}
    fed = make_federated_data(data, options, 20, seed=3)
    sizes = np.bincount(data.train_groups.numpy())
    largest = np.argsort(-sizes, kind="stable")[:20]
    got = [p.num_train + len(p.val_y) for p in fed.peers]
    assert got == sizes[largest].tolist() and got == sorted(got, reverse=True)
    # peer 0 is the largest role, GLOUCESTER; its windows are exactly that role's
    assert data.group_names[largest[0]] == "GLOUCESTER"
    role = data.train_x[data.train_groups == largest[0]]
    peer = torch.cat([fed.peers[0].train_x, fed.peers[0].val_x])
    assert sorted(map(tuple, peer.tolist())) == sorted(map(tuple, role.tolist()))
    # the test set is the 20 roles' test windows only
    keep = np.isin(data.test_groups.numpy(), largest)
    assert torch.equal(fed.test_y, data.test_y[torch.from_numpy(keep)])
    again = make_federated_data(data, options, 20, seed=3)
    assert all(
        torch.equal(a.train_x, b.train_x) for a, b in zip(fed.peers, again.peers, strict=True)
    )
    other = make_federated_data(data, options, 20, seed=4)  # another seed: another val draw
    assert [len(p.val_y) for p in other.peers] == [len(p.val_y) for p in fed.peers]
    assert any(
        not torch.equal(a.val_x, b.val_x) for a, b in zip(fed.peers, other.peers, strict=True)
    )
    sub = load_dataset({"name": "shakespeare", "stride": 80, "min_lines": 50, "subset": 500}, 0)
    assert len(sub.train_groups) == 500 and sub.group_names == data.group_names
    rows_of = {
        tuple(x.tolist()): int(g) for x, g in zip(data.train_x, data.train_groups, strict=True)
    }
    assert all(
        rows_of[tuple(x.tolist())] == g
        for x, g in zip(sub.train_x, sub.train_groups.tolist(), strict=True)
    )
    with pytest.raises(ConfigError, match="102 peers but the dataset has 101 natural groups"):
        make_federated_data(data, options, 102, seed=0)
    digits = load_dataset({"name": "digits"}, seed=0)
    with pytest.raises(ConfigError, match="digits has none"):
        make_federated_data(digits, options, 4, seed=0)


@pytest.mark.parametrize(
    "model",
    [
        {"name": "char_lstm", "hidden": 32},
        {"name": "char_transformer", "d_model": 32, "layers": 1, "heads": 2},
    ],
)
def test_both_models_learn_on_a_few_roles(model):
    data = load_dataset({"name": "shakespeare", "stride": 80, "min_lines": 50}, seed=0)
    fed = make_federated_data(data, {"name": "natural"}, 3, seed=0)
    trainer = Trainer(model, data.input_shape, data.num_classes, data.train_x.dtype)
    state = trainer.init_state(0)
    cpu = torch.device("cpu")
    before = trainer.evaluate(state, fed.test_x, fed.test_y, cpu)
    cfg = TrainConfig(epochs=2, batch_size=16, optimizer="adam", lr=0.01)
    for p in fed.peers:
        state = trainer.train(state, p, cfg, torch.Generator().manual_seed(0), cpu).state
    after = trainer.evaluate(state, fed.test_x, fed.test_y, cpu)
    assert after[1] < before[1] - 0.5  # cross-entropy from about ln 80 = 4.38
    assert after[0] > 0.15  # past always guessing one character


def test_model_sizes_flops_and_kinds():
    lstm = build_model({"name": "char_lstm"}, (80,), 80, torch.long)
    # LEAF's stacked LSTM: 640 + (4*256*(8+256) + 8*256) + (4*256*512 + 8*256) + 256*80 + 80
    assert sum(p.numel() for p in lstm.parameters()) == 819_920
    tiny = build_model({"name": "char_transformer"}, (80,), 80, torch.long)
    assert sum(p.numel() for p in tiny.parameters()) == 115_536
    gates = 2 * 4 * 256 * (8 + 256) + 2 * 4 * 256 * (256 + 256)
    assert forward_flops(lstm, (80,)) == 80 * gates + 2 * 256 * 80
    small = build_model(
        {"name": "char_transformer", "d_model": 16, "layers": 1, "heads": 2}, (8,), 80
    )
    linear = 2 * 8 * (16 * 48 + 16 * 16 + 16 * 64 + 64 * 16) + 2 * 16 * 80
    assert forward_flops(small, (8,)) == linear + 4 * 8 * 8 * 16
    assert unbatchable(lstm) is not None and unbatchable(small) is None
    with pytest.raises(ConfigError, match="mlp takes float inputs but the dataset gives token"):
        build_model({"name": "mlp"}, (80,), 80, torch.long)
    with pytest.raises(ConfigError, match="char_lstm takes token windows .* float samples"):
        build_model({"name": "char_lstm"}, (1, 8, 8), 10, torch.float32)
    with pytest.raises(ConfigError, match="heads: must divide d_model 64, got 3"):
        build_model({"name": "char_transformer", "heads": 3}, (80,), 80)


# torch's CPU flash-attention kernel has no vmap batching rule: it runs peer by peer and
# warns so. Runs take this path on CUDA only (batched.supports), whose attention kernels
# (flash, efficient, cuDNN) have batching rules.
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_the_transformer_trains_batched_as_one_by_one():
    """torch.func's stacked training (the CUDA path of peers.batched) gives the loop's models
    up to float rounding; the LSTM is refused instead (test_model_sizes_flops_and_kinds)."""
    data = load_dataset({"name": "shakespeare", "stride": 320, "min_lines": 200}, seed=0)
    fed = make_federated_data(data, {"name": "natural"}, 4, seed=0)
    model = {"name": "char_transformer", "d_model": 16, "layers": 1, "heads": 2}
    trainer = Trainer(model, data.input_shape, data.num_classes, data.train_x.dtype)
    cpu, cfg = torch.device("cpu"), TrainConfig(batch_size=8, lr=0.5, momentum=0.9)
    start = trainer.init_state(0)
    loop = [
        trainer.train(start, p, cfg, torch.Generator().manual_seed(i), cpu).state
        for i, p in enumerate(fed.peers)
    ]
    module = trainer.module(cpu)
    assert batched.can_batch(module, cfg, None)
    pool = batched.DataPool(fed.peers)
    jobs = [batched.Job(start, i, torch.Generator().manual_seed(i), None) for i in range(4)]
    stacked = batched.train_batched(module, pool, jobs, cfg, cpu, generic=True)
    for result, state in zip(stacked, loop, strict=True):
        for key, value in state.items():
            assert torch.allclose(result.state[key], value, atol=1e-5), key
        assert not torch.equal(state["out.weight"], start["out.weight"])


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # 20 s: a run and p2pfl cost, each in its own process
def test_a_run_counts_the_bytes_cost_predicts(tmp_path):
    out = tmp_path / "run"
    run = run_cli(tmp_path / "exp.yaml", SMALL, out, "--quiet")
    assert run.returncode == 0, run.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_peers"] == 6 and summary["status"] == "ok"
    comm = rows(out / "comm.csv")
    assert sum(int(r["bytes"]) for r in comm) == summary["comm"]["total_bytes"]
    cost = subprocess.run(
        [sys.executable, "-m", "p2pfl", "cost", str(tmp_path / "exp.yaml"), "--topologies",
         "star", "--out", str(tmp_path / "cost")],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert cost.returncode == 0, cost.stderr
    (row,) = rows(tmp_path / "cost" / "cost.csv")
    assert int(row["total_bytes"]) == summary["comm"]["total_bytes"]
    assert int(row["messages"]) == len(comm)
    assert int(row["model_bytes"]) == sum(int(r["bytes"]) for r in comm if r["kind"] == "model")


@pytest.mark.slow  # 15 s: two runs
def test_int8_models_and_two_ranks_give_the_same_run(tmp_path):
    """The int8 codec on LSTM weights: p2pfl cost counts the bytes the run sends; --workers 2
    (torch.distributed ranks share the training) writes the same rows as one process."""
    config = SMALL | {
        "topology": {"kind": "ring"},
        "algorithm": {"name": "dfedavgm", "rounds": 2},
        "compression": {"model": {"codec": "int8"}},
    }
    one = run_cli(tmp_path / "exp.yaml", config, tmp_path / "one", "--quiet")
    two = run_cli(tmp_path / "exp.yaml", config, tmp_path / "two", "--quiet", "--workers", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    for name in ("metrics.csv", "comm.csv"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    cost = subprocess.run(
        [sys.executable, "-m", "p2pfl", "cost", str(tmp_path / "exp.yaml"), "--topologies",
         "ring", "--out", str(tmp_path / "cost")],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert cost.returncode == 0, cost.stderr
    (row,) = rows(tmp_path / "cost" / "cost.csv")
    assert int(row["total_bytes"]) == summary["comm"]["total_bytes"]
    # 8-bit codes: about a quarter of the float32 model per message (plus scales and header)
    model_rows = [r for r in rows(tmp_path / "one" / "comm.csv") if r["kind"] == "model"]
    params = 80 * 8 + 4 * 16 * (8 + 16) + 8 * 16 + 16 * 80 + 80
    assert all(params < int(r["bytes"]) < 2 * params for r in model_rows)


@pytest.mark.slow  # 10 s
def test_peer_count_left_out_is_every_role(tmp_path):
    config = SMALL | {"peers": {}, "algorithm": {"name": "fedavg", "rounds": 1}}
    config["dataset"] = SMALL["dataset"] | {"min_lines": 400}
    out = tmp_path / "run"
    run = run_cli(tmp_path / "exp.yaml", config, out, "--quiet")
    assert run.returncode == 0, run.stderr
    expected = sum(len(lines) >= 400 for lines in shipped_roles().values())
    assert json.loads((out / "summary.json").read_text())["num_peers"] == expected == 14
    assert "count: 14" in (out / "config.yaml").read_text()


BAD = [
    ({"dataset": {"name": "shakespeare", "min_lines": -1}}, "dataset.min_lines: must be >= 0"),
    ({"peers": {"count": 400}}, "peers.count: 400 peers but the dataset has 70 natural groups"),
    (
        {"dataset": {"name": "shakespeare", "min_lines": -1}, "peers": {}},
        "dataset.min_lines: must be >= 0",
    ),
    (
        {"dataset": {"name": "digits"}, "model": {"name": "mlp"}},
        "partition.name: natural makes each of the dataset's natural groups a peer",
    ),
    ({"dataset": {"name": "digits"}, "peers": {}}, "peers.count: left out, but dataset digits"),
    ({"model": {"name": "lenet"}}, "model.name: lenet takes float inputs"),
    (
        {"dataset": {"name": "digits"}, "partition": {"name": "iid"}},
        "model.name: char_lstm takes token windows",
    ),
    ({"peers": {"count": 6, "batched": True}}, "peers.batched: this model has a recurrent layer"),
    ({"algorithm": {"name": "maecho"}}, "model.name: maecho projects the inputs"),
    ({"partition": {"name": "domain"}, "peers": {"count": 4}}, "partition.angles: domain rotates"),
    ({"model": {"name": "char_lstm", "pans": {"mode": "add"}}}, "model.pans: char_lstm has no"),
    ({"algorithm": {"name": "regmean"}}, "layer 'embed' (Embedding) has parameters"),
]


@pytest.mark.parametrize(("change", "message"), BAD)
def test_bad_keys_are_refused_before_the_run(change, message):
    """In-process, fast: the checks that ``p2pfl run`` makes before it writes anything."""
    from p2pfl.app.config import resolve

    with pytest.raises(ConfigError) as e:
        build(resolve(SMALL | change, ROOT / "experiments" / "x.yaml"))
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("change", "message"),
    BAD[:2] + [pytest.param(*case, marks=pytest.mark.slow) for case in BAD[2:]],
)
def test_bad_keys_exit_2_and_write_nothing(tmp_path, change, message):
    out = tmp_path / "run"
    run = run_cli(tmp_path / "exp.yaml", SMALL | change, out)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and run.stderr.startswith("error: ")
    assert len(run.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.slow  # 20 s per model: two runs, one of them 4 processes
@pytest.mark.parametrize("model", ["char_lstm", "char_transformer"])
def test_zmq_run_gives_the_simulated_models(tmp_path, model):
    """As tests/test_transport.py does for images: over sockets the same bytes and models."""
    config = SMALL | {
        "model": {"name": model, "hidden": 16, "layers": 1}
        if model == "char_lstm"
        else {"name": model, "d_model": 16, "layers": 1, "heads": 2},
        "topology": {"kind": "ring"},
        "peers": {"count": 4},
        "algorithm": {"name": "dfedavgm", "rounds": 2},
        "transport": {"timeout_s": 120.0},
    }
    a, b = sim_and_zmq(tmp_path, config)
    assert a["final"] == b["final"] and a["comm"] == b["comm"]
    for name, clock in {"metrics.csv": ("time",), "comm.csv": ("time", "arrival")}.items():
        got = [
            sorted(
                tuple(v for k, v in r.items() if k not in clock) for r in rows(tmp_path / d / name)
            )
            for d in ("sim", "zmq")
        ]
        assert got[0] == got[1], name


def test_a_token_setup_builds_for_every_path():
    """build() on the resolved small config: the trainer takes int64 windows, the FLOP
    count includes the recurrent layer."""
    from p2pfl.app.config import resolve

    setup = build(resolve(SMALL, ROOT / "experiments" / "x.yaml"))
    assert setup.data.input_shape == (80,) and len(setup.data.peers) == 6
    assert setup.trainer.forward_flops == 80 * 2 * 4 * 16 * (8 + 16) + 2 * 16 * 80
