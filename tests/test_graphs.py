"""Steps replayed from CUDA graphs are the eager steps, bit for bit.

On a CPU the replayed path runs its step as it is, so these tests check that it feeds the
step the same batches; ``pytest --device cuda`` checks the graphs themselves.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, experiment
from p2pfl.app.experiment import build
from p2pfl.core.seeding import torch_generator
from p2pfl.learning import graphs, training
from p2pfl.learning.training import TrainConfig, Trainer

CASES = [  # (model, training): a partial last batch, momentum, weight decay, BatchNorm
    ({"name": "mlp", "hidden": [16]}, TrainConfig(epochs=2, batch_size=16, momentum=0.9)),
    ({"name": "lenet"}, TrainConfig(batch_size=16, momentum=0.9, weight_decay=1e-3)),
    ({"name": "resnet18"}, TrainConfig(batch_size=32, lr=0.01, momentum=0.9)),
    ({"name": "lenet"}, TrainConfig(epochs=2, batch_size=16, select="best_val")),
]


@pytest.mark.parametrize(("model", "cfg"), CASES, ids=[m["name"] for m, _ in CASES])
def test_replayed_training_steps_are_the_eager_steps(monkeypatch, model, cfg):
    setup = build(
        experiment(
            peers={"count": 3},
            model=model,
            partition={"name": "iid", "val_fraction": 0.2},
            dataset={"name": "digits", "subset": 500 if model["name"] == "resnet18" else 1000},
        )
    )
    device, peers = torch.device(DEVICE["name"]), setup.data.peers
    assert all(p.num_train % cfg.batch_size for p in peers)  # a smaller last batch, eager
    init = setup.trainer.init_state(0)

    def train():
        return [
            setup.trainer.train(init, peers[p], cfg, torch_generator(0, "g", p), device)
            for p in range(len(peers))
        ]

    calls = []
    replayed = graphs.Replayed.__call__

    def spy(self):
        calls.append(self)
        replayed(self)

    monkeypatch.setattr(graphs.Replayed, "__call__", spy)
    if device.type == "cpu":  # the replayed path where CUDA would take it
        kept = {}

        def full_batch(self, model, params, x_all, cfg, regularizer, device):
            if not self.graphs:
                return None
            if cfg not in kept:
                shape, dtype = x_all.shape[1:], x_all.dtype
                kept[cfg] = training._FullBatch(model, params, shape, dtype, cfg, device)
            return kept[cfg]

        monkeypatch.setattr(Trainer, "_replayed", full_batch)
    with_graphs = train()
    full = [cfg.epochs * (p.num_train // cfg.batch_size) for p in peers]
    assert len(calls) == sum(full) and min(full) >= 3  # warm-up, capture, replays
    assert len(set(calls)) == 1  # one step for every training: captured once
    if device.type == "cuda":
        assert calls[-1].graph is not None
    setup.trainer.graphs = False
    eager = train()
    assert len(calls) == sum(full)
    for one, other in zip(with_graphs, eager, strict=True):
        assert one.val_accuracy == other.val_accuracy
        assert one.state.keys() == other.state.keys()
        for key, value in one.state.items():
            assert torch.equal(value, other.state[key]), key
        assert any(not torch.equal(one.state[k], init[k]) for k in init)  # it trained
