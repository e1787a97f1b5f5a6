"""Batched peer training equals the one-by-one loop, in isolation and inside whole runs."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, experiment, run_experiment
from p2pfl.app.experiment import build
from p2pfl.core.seeding import torch_generator
from p2pfl.learning import batched, models
from p2pfl.learning.training import Proximal, TrainConfig
from p2pfl.network import wire
from p2pfl.runtime.worker import Worker

CPU = torch.device("cpu")


def skewed_setup(hidden: list[int], bias: bool = True):
    """Eight digits peers with unequal data sizes (Dirichlet 0.5)."""
    return build(
        experiment(
            peers={"count": 8},
            model={"name": "mlp", "hidden": hidden, "bias": bias},
            partition={"name": "dirichlet", "alpha": 0.5, "min_size": 5},
        )
    )


@pytest.mark.parametrize(
    ("hidden", "bias", "cfg"),
    [
        ([32], True, TrainConfig(batch_size=16)),
        ([32, 16], True, TrainConfig(epochs=2, batch_size=16, momentum=0.9, weight_decay=1e-3)),
        ([24], False, TrainConfig(epochs=3, batch_size=50, lr=0.1, weight_decay=1e-2)),
        ([], True, TrainConfig(batch_size=7, momentum=0.5)),
    ],
)
def test_batched_training_equals_the_one_by_one_loop(hidden, bias, cfg):
    setup = skewed_setup(hidden, bias)
    peers = setup.data.peers
    assert len({p.num_train for p in peers}) > 1  # peers run different numbers of steps
    init = setup.trainer.init_state(0)
    loop = [
        setup.trainer.train(init, peers[p], cfg, torch_generator(0, "t", p), CPU)
        for p in range(len(peers))
    ]
    pool = batched.DataPool(peers)
    jobs = [batched.Job(init, p, torch_generator(0, "t", p)) for p in range(len(peers))]
    together = batched.train_batched(setup.trainer.module(CPU), pool, jobs, cfg, CPU)
    for one, other in zip(loop, together, strict=True):
        assert (one.train_samples, one.eval_samples) == (other.train_samples, other.eval_samples)
        for key, value in one.state.items():
            torch.testing.assert_close(other.state[key], value, rtol=1e-5, atol=1e-6)


def test_the_mlp_path_gives_the_same_bits_whatever_its_group_size(monkeypatch):
    """Peers are trained in groups of ``MLP_GROUP``; a peer's result does not depend on
    which peers share its group, nor on how many (so the group size is free to tune)."""
    setup = skewed_setup([16])
    cfg = TrainConfig(batch_size=16, momentum=0.9, weight_decay=1e-3)
    init, pool = setup.trainer.init_state(0), batched.DataPool(setup.data.peers)
    trained = {}
    for size in (1, 3, 8):
        monkeypatch.setattr(batched, "MLP_GROUP", size)
        jobs = [batched.Job(init, p, torch_generator(0, "t", p)) for p in range(len(pool.peers))]
        trained[size] = batched.train_batched(setup.trainer.module(CPU), pool, jobs, cfg, CPU)
    for size in (1, 3):
        for one, other in zip(trained[8], trained[size], strict=True):
            assert one.train_samples == other.train_samples
            assert all(torch.equal(one.state[k], other.state[k]) for k in one.state)


@pytest.mark.parametrize(
    ("hidden", "partition", "cfg"),
    [
        ([16], "iid", TrainConfig(batch_size=27, momentum=0.9, weight_decay=1e-3)),
        ([24, 8], "iid", TrainConfig(epochs=2, batch_size=23, lr=0.1)),
        ([], "iid", TrainConfig(batch_size=19, momentum=0.5)),
        ([16], "dirichlet", TrainConfig(batch_size=200, momentum=0.9)),
        ([16], "iid", TrainConfig(batch_size=31, momentum=0.9)),  # 2 left over
        ([24, 8], "iid", TrainConfig(batch_size=30)),  # 3 left over
    ],
)
def test_mlp_steps_cut_after_the_first_padding_slot_give_the_full_batchs_bits(
    monkeypatch, hidden, partition, cfg
):
    """The hand-written MLP path computes a step's batch up to its widest peer's real rows
    and one padding slot (Step.trims): the same bits as the full batch size, where every
    peer's last batch is short (33 samples each: 6, 10 and 14 left over, where torch's
    sum over a batch adds the rows in another order than over the whole) and where
    peers' sizes differ."""
    setup = build(
        experiment(
            peers={"count": 40},
            model={"name": "mlp", "hidden": hidden},
            partition={"name": partition, "alpha": 0.5, "min_size": 5}
            if partition == "dirichlet"
            else {"name": partition},
        )
    )
    init, pool = setup.trainer.init_state(0), batched.DataPool(setup.data.peers)
    jobs = [batched.Job(init, p, torch_generator(0, "t", p)) for p in range(len(pool.peers))]
    _, weight, _ = batched.batch_plan(pool, jobs, cfg.batch_size, cfg.epochs)
    assert ((weight > 0).sum(-1).amax(-1) < cfg.batch_size).any()  # some step is cut
    trained = {}
    for trims, group in ((False, 32), (True, 32), (True, 1), (True, 3)):
        monkeypatch.setattr(batched._MlpStep, "trims", trims)
        monkeypatch.setattr(batched, "MLP_GROUP", group)  # a peer's batch alone: 1-3 rows
        jobs = [batched.Job(init, p, torch_generator(0, "t", p)) for p in range(len(pool.peers))]
        trained[trims, group] = batched.train_batched(
            setup.trainer.module(CPU), pool, jobs, cfg, CPU
        )
    for key in ((True, 32), (True, 1), (True, 3)):
        for one, other in zip(trained[False, 32], trained[key], strict=True):
            assert all(torch.equal(one.state[k], other.state[k]) for k in one.state)


@pytest.mark.parametrize("laid_out", [True, False])
def test_pool_holds_the_data_once_and_leaves_it_unchanged(laid_out):
    """The partition lays the peers' training data end to end, and the pool takes that
    tensor as it is (no copy: same address); peers whose data lie apart are joined."""
    setup = skewed_setup([8])
    peers = setup.data.peers
    if not laid_out:
        for p in peers:
            p.train_x, p.train_y = p.train_x.clone(), p.train_y.clone()
    before = [(p.train_x.clone(), p.train_y.clone()) for p in peers]
    first = peers[0].train_x.data_ptr()
    pool = batched.DataPool(peers)
    x, y = pool.on(CPU)
    assert (x.data_ptr() == first) == laid_out
    assert x.shape == (sum(p.num_train for p in peers), 64)
    for p, (bx, by), start in zip(peers, before, pool.offsets, strict=True):
        assert torch.equal(p.train_x, bx) and torch.equal(p.train_y, by)
        assert p.train_x.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert torch.equal(y[start : start + len(by)], by)
        assert torch.equal(x[start : start + len(bx)], bx.flatten(1))


def test_what_runs_batched():
    mlp = skewed_setup([8]).trainer.module(CPU)
    assert batched.supports(mlp, TrainConfig(momentum=0.9), None)
    assert batched.can_batch(mlp, TrainConfig(optimizer="adam"), None)  # torch.func can ...
    assert not batched.supports(mlp, TrainConfig(optimizer="adam"), None)  # ... on CUDA
    assert not batched.supports(mlp, TrainConfig(optimizer="sam"), None)  # torch.func: CUDA
    assert batched.can_batch(mlp, TrainConfig(optimizer="sam"), None)
    assert batched.supports(mlp, TrainConfig(select="best_val"), None)  # the MLP path scores
    assert not batched.can_batch(mlp, TrainConfig(), lambda model, ce: ce * 0)  # opaque
    assert batched.can_batch(mlp, TrainConfig(), Proximal({}, 0.1))  # torch.func ...
    assert not batched.supports(mlp, TrainConfig(), Proximal({}, 0.1))  # ... on CUDA
    lenet = build(experiment(model={"name": "lenet"})).trainer.module(CPU)
    assert models.mlp_layers(lenet) is None
    assert batched.can_batch(lenet, TrainConfig(), None)  # torch.func can ...
    assert not batched.supports(lenet, TrainConfig(), None)  # ... but on a CPU it is slower
    if torch.cuda.is_available():
        assert batched.supports(lenet.to("cuda"), TrainConfig(optimizer="adam"), None)
    pans = {"name": "mlp", "hidden": [8], "pans": {"mode": "mul", "A": 0.5}}
    pan_mlp = build(experiment(model=pans)).trainer.module(CPU)
    assert models.mlp_layers(pan_mlp) is None  # the encoding hook changes the function
    assert not batched.can_batch(pan_mlp, TrainConfig(), None)
    bn = build(experiment(model={"name": "cnn_s"})).trainer.module(CPU)
    assert not batched.can_batch(bn, TrainConfig(), None)  # running statistics are buffers
    dropout = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(), torch.nn.Linear(4, 2))
    assert not batched.can_batch(dropout, TrainConfig(), None)


FUNC_CASES = [  # (model, training, take the torch.func path for a plain MLP too)
    ({"name": "mlp", "hidden": [16]}, TrainConfig(batch_size=16, momentum=0.9, weight_decay=1e-3)),
    ({"name": "mlp", "hidden": [16]}, TrainConfig(batch_size=16, optimizer="adam", lr=0.01)),
    ({"name": "lenet"}, TrainConfig(epochs=2, batch_size=16, momentum=0.9, weight_decay=1e-3)),
    ({"name": "lenet"}, TrainConfig(batch_size=16, optimizer="adam", lr=0.005, weight_decay=1e-3)),
    ({"name": "cnn3"}, TrainConfig(batch_size=16, momentum=0.9)),
    ({"name": "resnet18", "norm": "group"}, TrainConfig(batch_size=32, lr=0.01)),
    ({"name": "resnet18", "norm": "none"}, TrainConfig(batch_size=32, lr=0.01, momentum=0.9)),
]


@pytest.mark.parametrize(
    ("model", "cfg"),
    FUNC_CASES,
    ids=[f"{m['name']}-{m.get('norm', '')}-{c.optimizer}" for m, c in FUNC_CASES],
)
def test_torch_func_training_equals_the_one_by_one_loop_for_any_model(model, cfg):
    setup = build(
        experiment(
            peers={"count": 5},
            model=model,
            partition={"name": "dirichlet", "alpha": 0.5, "min_size": 5},
            dataset={"name": "digits", "subset": 400 if model["name"] == "resnet18" else 1000},
        )
    )
    peers = setup.data.peers
    assert len({p.num_train for p in peers}) > 1  # peers run different numbers of steps
    init = setup.trainer.init_state(0)
    loop = [
        setup.trainer.train(init, peers[p], cfg, torch_generator(0, "t", p), CPU).state
        for p in range(len(peers))
    ]
    pool = batched.DataPool(peers)
    jobs = [batched.Job(init, p, torch_generator(0, "t", p)) for p in range(len(peers))]
    module = setup.trainer.module(CPU)
    together = batched.train_batched(module, pool, jobs, cfg, CPU, generic=True)
    for one, other in zip(loop, together, strict=True):
        assert other.state.keys() == one.keys()
        for key, value in one.items():
            torch.testing.assert_close(other.state[key], value, rtol=1e-4, atol=5e-5)
        assert any(not torch.equal(one[k], init[k]) for k in one)  # it trained


def validated_setup(model: dict, peers: int, val_fraction: float):
    """``peers`` digits peers of unequal sizes (Dirichlet 0.5), each with a validation split."""
    partition = {"name": "dirichlet", "alpha": 0.5, "min_size": 8, "val_fraction": val_fraction}
    return build(
        experiment(
            peers={"count": peers},
            model=model,
            partition=partition,
            dataset={"name": "digits", "subset": 1000},
        )
    )


MORE_CASES = [  # (model, training, FedProx's mu or None): SAM, the proximal term, best_val
    (
        {"name": "mlp", "hidden": [16]},
        TrainConfig(batch_size=16, optimizer="sam", momentum=0.9),
        None,
    ),
    ({"name": "lenet"}, TrainConfig(batch_size=16, optimizer="sam", weight_decay=1e-3), None),
    ({"name": "mlp", "hidden": [16]}, TrainConfig(batch_size=16, momentum=0.9), 0.5),
    ({"name": "lenet"}, TrainConfig(batch_size=16, optimizer="adam", lr=0.005), 0.1),
    (
        {"name": "mlp", "hidden": [16]},
        TrainConfig(epochs=4, batch_size=16, select="best_val"),
        None,
    ),
    (
        {"name": "lenet"},
        TrainConfig(epochs=3, batch_size=16, optimizer="sam", select="best_val"),
        0.1,
    ),
]


@pytest.mark.parametrize(
    ("model", "cfg", "mu"),
    MORE_CASES,
    ids=[f"{m['name']}-{c.optimizer}-{c.select}-mu{u}" for m, c, u in MORE_CASES],
)
def test_sam_proximal_and_best_val_train_batched_as_in_the_loop(model, cfg, mu):
    setup = validated_setup(model, 5, 0.3)
    peers = setup.data.peers
    init = setup.trainer.init_state(0)
    anchors = [{k: v + 0.05 * (p + 1) for k, v in init.items()} for p in range(len(peers))]
    proximal = [Proximal(a, mu) if mu is not None else None for a in anchors]
    loop = [
        setup.trainer.train(init, peers[p], cfg, torch_generator(0, "t", p), CPU, proximal[p])
        for p in range(len(peers))
    ]
    pool = batched.DataPool(peers)
    jobs = [batched.Job(init, p, torch_generator(0, "t", p), proximal[p]) for p in range(5)]
    together = batched.train_batched(setup.trainer.module(CPU), pool, jobs, cfg, CPU)
    for one, other in zip(loop, together, strict=True):
        assert other.val_accuracy == one.val_accuracy
        for key, value in one.state.items():
            torch.testing.assert_close(other.state[key], value, rtol=1e-4, atol=5e-5)
    if cfg.select == "best_val":
        assert all(r.val_accuracy > 0 for r in together)
    else:
        assert all(r.val_accuracy == -1.0 for r in together)


def test_a_loss_that_is_not_finite_is_left_to_the_loop():
    setup = skewed_setup([8])
    init = setup.trainer.init_state(0)
    far = {k: v + 1e30 for k, v in init.items()}  # the proximal term overflows float32
    jobs = [batched.Job(init, p, torch_generator(0, "t", p), Proximal(far, 1.0)) for p in range(8)]
    with pytest.raises(batched.NonFinite):
        batched.train_batched(
            setup.trainer.module(CPU), batched.DataPool(setup.data.peers), jobs, TrainConfig(), CPU
        )
    mixed = [*jobs[:4], batched.Job(init, 4, torch_generator(0, "t", 4))]
    with pytest.raises(ValueError, match="proximal"):
        batched.train_batched(
            setup.trainer.module(CPU), batched.DataPool(setup.data.peers), mixed, TrainConfig(), CPU
        )


SGD = {"epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.9}
ADAM = {"epochs": 2, "batch_size": 16, "lr": 0.005, "optimizer": "adam"}


@pytest.mark.parametrize(
    ("algorithm", "topology", "peers", "train"),
    [
        ("dfedavgm", {"kind": "ring"}, {}, SGD),
        ("fedavg", {"kind": "star"}, {"link": {"bandwidth_bps": 1e10}}, SGD),
        ("dfedavgm", {"kind": "ring"}, {}, ADAM),  # the torch.func path
        ("fedprox", {"kind": "star"}, {"link": {"bandwidth_bps": 1e10}}, SGD),  # proximal term
    ],
)
def test_batched_runs_match_unbatched_runs(
    tmp_path, monkeypatch, algorithm, topology, peers, train
):
    """Same clock, same ledger, same accuracy (to float rounding), and peers really batched."""
    groups: list[int] = []
    train_many = Worker.train_many

    def spy(self, jobs):
        groups.append(len(jobs))
        return train_many(self, jobs)

    monkeypatch.setattr(Worker, "train_many", spy)
    monkeypatch.setattr(batched, "supports", batched.can_batch)  # torch.func on a CPU too
    sections = {
        "topology": topology,
        "algorithm": {"name": algorithm, "rounds": 3},
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
        "train": train,
    }
    runs = {}
    for flag in (False, True):
        out = tmp_path / str(flag)
        runs[flag] = run_experiment(out, peers={"count": 10, "batched": flag} | peers, **sections)
        runs[flag]["comm.csv"] = (out / "comm.csv").read_text()
    assert max(groups) >= 5
    one, other = runs[False], runs[True]
    assert other["comm.csv"] == one["comm.csv"]
    assert other["sim_time_s"] == one["sim_time_s"]
    assert other["final"]["accuracy"] == pytest.approx(one["final"]["accuracy"], abs=0.01)
    assert other["final"]["loss"] == pytest.approx(one["final"]["loss"], rel=1e-3)


def test_batched_runs_replay_bit_for_bit(tmp_path):
    sections = {"topology": {"kind": "ring"}, "algorithm": {"name": "dfedavgm", "rounds": 2}}
    first, second = (
        run_experiment(tmp_path / name, peers={"count": 6, "batched": True}, **sections)
        for name in ("a", "b")
    )
    assert first["final"] == second["final"] and first["per_peer"] == second["per_peer"]


FIXED_CASES = [  # (model, training): every step after the first over the whole group
    ({"name": "mlp", "hidden": [16]}, TrainConfig(epochs=2, batch_size=16, momentum=0.9), False),
    ({"name": "mlp", "hidden": [16]}, TrainConfig(batch_size=16, weight_decay=1e-3), True),
    (
        {"name": "lenet"},
        TrainConfig(epochs=2, batch_size=16, momentum=0.9, weight_decay=1e-3),
        True,
    ),
    ({"name": "lenet"}, TrainConfig(batch_size=16, optimizer="sam", momentum=0.9), True),
    (
        {"name": "mlp", "hidden": [16]},
        TrainConfig(epochs=3, batch_size=16, select="best_val"),
        True,
    ),
]


@pytest.mark.parametrize(
    ("model", "cfg", "generic"),
    FIXED_CASES,
    ids=[f"{m['name']}-{c.optimizer}-{c.select}-{g}" for m, c, g in FIXED_CASES],
)
def test_fixed_steps_train_as_the_loop(monkeypatch, model, cfg, generic):
    """Whole-group steps (the shape CUDA replays from a graph): finished peers keep
    stepping on empty batches, and must still come out with their last step's weights."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 on both sides
    setup = validated_setup(model, 6, 0.2)
    peers = setup.data.peers
    assert len({p.num_train for p in peers}) > 1  # peers finish at different steps
    init = setup.trainer.init_state(0)
    device = torch.device(DEVICE["name"])
    loop = [
        setup.trainer.train(init, peers[p], cfg, torch_generator(0, "t", p), device)
        for p in range(len(peers))
    ]
    pool = batched.DataPool(peers)
    module = setup.trainer.module(device)
    runs = []
    for fixed in (True, True, False):
        jobs = [batched.Job(init, p, torch_generator(0, "t", p)) for p in range(len(peers))]
        runs.append(batched.train_batched(module, pool, jobs, cfg, device, generic, fixed))
    for one, fixed, again, prefix in zip(loop, *runs, strict=True):
        assert fixed.val_accuracy == one.val_accuracy
        for key, value in one.state.items():
            torch.testing.assert_close(fixed.state[key], value, rtol=1e-4, atol=5e-5)
            torch.testing.assert_close(fixed.state[key], prefix.state[key], rtol=1e-5, atol=1e-6)
            assert torch.equal(fixed.state[key], again.state[key])  # replays bit for bit
    if device.type == "cuda":  # the fixed steps were captured and replayed
        replayed = batched._Fixed.__call__
        graphs = []

        def spy(self, index, weight):
            replayed(self, index, weight)
            graphs.append(self.step.graph)

        monkeypatch.setattr(batched._Fixed, "__call__", spy)
        jobs = [batched.Job(init, p, torch_generator(0, "t", p)) for p in range(len(peers))]
        batched.train_batched(module, pool, jobs, cfg, device, generic)
        assert len(graphs) > 2 and all(g is not None for g in graphs[1:])
    jobs = [batched.Job(init, 0, torch_generator(0, "t", 0))]
    with pytest.raises(ValueError, match="fixed steps need SGD or SAM"):
        batched.train_batched(module, pool, jobs, TrainConfig(optimizer="adam"), device, fixed=True)


@pytest.mark.parametrize("fixed", [True, False])
def test_a_peer_without_training_samples_is_scored_as_the_loop_scores_it(fixed):
    """``best_val``: a peer with no training sample takes no step, and the loop still
    scores its start model; so does a batched group (it used to report -1)."""
    setup = build(
        experiment(
            peers={"count": 4},
            partition={"name": "iid", "val_fraction": 0.2},
            dataset={"name": "digits", "subset": 600},
        )
    )
    peers = setup.data.peers
    for i, n in {3: 0, 2: 5}.items():  # no sample; fewer than a batch
        peers[i].train_x, peers[i].train_y = peers[i].train_x[:n], peers[i].train_y[:n]
    cfg = TrainConfig(epochs=2, batch_size=16, momentum=0.9, select="best_val")
    init, device = setup.trainer.init_state(0), torch.device(DEVICE["name"])
    loop = [
        setup.trainer.train(init, peers[p], cfg, torch_generator(0, "t", p), device)
        for p in range(4)
    ]
    jobs = [batched.Job(init, p, torch_generator(0, "t", p)) for p in range(4)]
    together = batched.train_batched(
        setup.trainer.module(device), batched.DataPool(peers), jobs, cfg, device, True, fixed
    )
    assert loop[3].val_accuracy >= 0  # scored (-1: never scored)
    for one, other in zip(loop, together, strict=True):
        assert other.val_accuracy == one.val_accuracy
        for key, value in one.state.items():
            torch.testing.assert_close(other.state[key], value, rtol=1e-4, atol=5e-5)
    assert all(torch.equal(together[3].state[k], init[k]) for k in init)


def module_scores(trainer, state, x, y):
    """What scoring was before the functional path: the state loaded into the template,
    its forward pass, torch's cross-entropy, 2,048 samples at a time."""
    model = trainer.module(CPU)
    model.load_state_dict(state)
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(y), 2048):
            out = model(x[i : i + 2048])
            loss += torch.nn.functional.cross_entropy(out, y[i : i + 2048], reduction="sum").item()
            correct += int((out.argmax(1) == y[i : i + 2048]).sum())
    return correct / len(y), loss / len(y)


@pytest.mark.parametrize(("hidden", "bias"), [([32], True), ([32, 16], False), ([], True)])
def test_a_plain_mlp_is_scored_to_the_bits_of_its_loaded_template(hidden, bias):
    """Trainer.evaluate scores a plain MLP as a function of the state (no load_state_dict)
    and the cross-entropy over the transposed logits: the same accuracy and loss bits."""
    setup = skewed_setup(hidden, bias)
    trainer, data = setup.trainer, setup.data
    assert trainer._plain(trainer.init_state(0), CPU) is not None  # the functional path
    gen = torch.Generator().manual_seed(1)
    # 2,100 samples of varied size: two batches, the second not a multiple of 32 rows
    x = torch.cat([data.test_x] * (2100 // len(data.test_y) + 1))[:2100]
    x = x * (1 + torch.rand(x.shape, generator=gen))
    y = torch.cat([data.test_y] * (2100 // len(data.test_y) + 1))[:2100]
    for scale in (0.1, 1.0, 30.0):
        state = {
            k: v + scale * torch.randn(v.shape, generator=gen)
            for k, v in trainer.init_state(0).items()
        }
        for n in (2100, 999, 1):
            assert trainer.evaluate(state, x[:n], y[:n], CPU) == module_scores(
                trainer, state, x[:n], y[:n]
            )


def test_a_state_the_template_would_not_take_unchanged_is_scored_through_it():
    """A state with another dtype, a missing key, a non-contiguous or a misaligned tensor
    goes through load_state_dict, as before (its cast, its copy, its error)."""
    setup = skewed_setup([16])
    trainer, data = setup.trainer, setup.data
    state = trainer.init_state(0)
    doubled = {k: v.double() for k, v in state.items()}
    assert trainer._plain(doubled, CPU) is None
    x, y = data.test_x, data.test_y
    assert trainer.evaluate(doubled, x, y, CPU) == module_scores(trainer, doubled, x, y)
    strided = dict(state, **{k: v.t().contiguous().t() for k, v in state.items() if v.dim() == 2})
    assert trainer._plain(strided, CPU) is None
    assert trainer.evaluate(strided, x, y, CPU) == module_scores(trainer, state, x, y)
    # a view 4 bytes into a buffer (as a decoded frame's tensors may be): not aligned
    shifted = {}
    for k, v in state.items():
        buffer = torch.empty(v.numel() + 1, dtype=v.dtype)
        buffer[1:] = v.reshape(-1)
        shifted[k] = buffer[1:].view(v.shape)
    assert trainer._plain(shifted, CPU) is None
    assert trainer.evaluate(shifted, x, y, CPU) == module_scores(trainer, state, x, y)
    with pytest.raises(RuntimeError, match="Missing key"):
        trainer.evaluate({k: v for k, v in list(state.items())[1:]}, x, y, CPU)


@pytest.mark.skipif(
    not (hasattr(torch, "_lazy_clone") and hasattr(torch.Tensor, "const_data_ptr")),
    reason="torch without copy-on-write or a read-only data_ptr",
)
def test_scoring_a_state_shared_copy_on_write_copies_nothing():
    """A state that a message shares copy-on-write (the wire's lazy clone of what a peer
    sends, then scored by the sender) is scored from the shared bytes: the alignment check
    must not copy them (``data_ptr`` would: a second model per peer at a gossip run's last
    period, 0.7 GiB at 30,000 peers), and the scores are the template's bits."""
    setup = skewed_setup([32])
    trainer, data = setup.trainer, setup.data
    state = {k: v.clone() for k, v in trainer.init_state(0).items()}
    sent = {k: wire._private_copy(v) for k, v in state.items()}  # what Send puts in a message
    shared = [k for k, v in state.items() if torch._C._is_cow_tensor(v)]
    assert shared and all(torch._C._is_cow_tensor(sent[k]) for k in shared)  # the weights
    where = {k: state[k].const_data_ptr() for k in shared}
    assert all(sent[k].const_data_ptr() == where[k] for k in shared)
    x, y = data.test_x, data.test_y
    assert trainer.evaluate(state, x, y, CPU) == module_scores(trainer, state, x, y)
    for k in shared:  # still shared: nothing copied
        assert torch._C._is_cow_tensor(state[k])
        assert state[k].const_data_ptr() == sent[k].const_data_ptr() == where[k]


@pytest.mark.parametrize("classes", [2, 3, 10, 15, 16, 40])
def test_the_cross_entropy_sum_has_torchs_bits(classes):
    """_cross_entropy_sum equals F.cross_entropy(reduction="sum") bit for bit, on the fast
    path (few classes, where _transposed_ok checked it) and off it."""
    from p2pfl.learning.training import _cross_entropy_sum

    gen = torch.Generator().manual_seed(classes)
    for rows in (1, 31, 32, 33, 500, 2048, 2071):
        for scale in (1e-2, 1.0, 50.0):
            out = torch.randn(rows, classes, generator=gen) * scale + scale
            y = torch.randint(classes, (rows,), generator=gen)
            want = torch.nn.functional.cross_entropy(out, y, reduction="sum").item()
            assert _cross_entropy_sum(out, y) == want


def per_peer_plan(pool, jobs, batch_size, epochs):
    """batch_plan as it was first written, one peer at a time: the reference."""
    import math

    per_peer = []
    for job in jobs:
        n = pool.peers[job.peer].num_train
        steps = math.ceil(n / batch_size)
        rows = torch.full((epochs, steps * batch_size), -1, dtype=torch.long)
        for e in range(epochs):
            rows[e, :n] = torch.randperm(n, generator=job.generator) + pool.offsets[job.peer]
        per_peer.append(rows.view(epochs * steps, batch_size))
    index = torch.full((len(per_peer[0]), len(jobs), batch_size), -1, dtype=torch.long)
    for p, rows in enumerate(per_peer):
        index[: len(rows), p] = rows
    real = index >= 0
    count = real.sum(-1, keepdim=True)
    active = (count.squeeze(-1) > 0).sum(-1).tolist()
    return index.clamp(min=0), real / count.clamp(min=1), active


@pytest.mark.parametrize(("batch_size", "epochs"), [(7, 1), (16, 3), (500, 2)])
def test_batch_plan_places_every_peers_permutations_as_one_peer_at_a_time(batch_size, epochs):
    """batch_plan scatters every peer's draws at once: the same index, weights and active
    counts as laying them out peer by peer, from the same generators."""
    setup = skewed_setup([8])
    pool = batched.DataPool(setup.data.peers)
    peers = sorted(range(len(pool.peers)), key=lambda p: -pool.peers[p].num_train)
    plans = [
        plan(
            pool,
            [batched.Job({}, p, torch_generator(0, "t", p)) for p in peers],
            batch_size,
            epochs,
        )
        for plan in (batched.batch_plan, per_peer_plan)
    ]
    (index, weight, active), (ref_index, ref_weight, ref_active) = plans
    assert active == ref_active and torch.equal(index, ref_index)
    assert torch.equal(weight, ref_weight) and weight.dtype == ref_weight.dtype
