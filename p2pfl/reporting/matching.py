"""Neuron matching: how well the hidden units of two models stay aligned by index.

The measure of the PANs paper (§5.2, Figs. 7, 18, 19): feed the same held-out samples to
both models, take every hidden unit's activations (after its layer, normalisation and
position encoding, before the non-linearity; a conv channel reduced to its spatial maximum),
match the units of one model to the other's with the Hungarian method on the Euclidean
distances between their activation vectors, and report the fraction matched to their own
index (1 = perfectly aligned; a random permutation gives about 1/J).

In a run (``eval.matching``), after the last round, the run's output model is trained
locally on ``peers`` seeded peers for ``epochs`` epochs each (the paper trains the global
model on one client for 20 epochs), and the ratio is reported per hidden layer for the
global model against each local one (``global``, the paper's measure) and for every pair
of local models (``peers``).
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import numpy_rng, torch_generator
from p2pfl.data.federated import FederatedData
from p2pfl.learning.models import hidden_units
from p2pfl.learning.state import State
from p2pfl.learning.training import TrainConfig, Trainer


@dataclass(frozen=True)
class MatchingConfig:
    """The ``eval.matching`` key: local trainings of the output model and held-out samples.

    Args:
        peers: how many seeded peers train the output model.
        epochs: how many epochs each of them trains it.
        samples: how many test images the hidden units are matched on.
    """

    peers: int = 2
    epochs: int = 20
    samples: int = 500

    def __post_init__(self) -> None:
        for key in ("peers", "epochs", "samples"):
            if getattr(self, key) < 1:
                raise ConfigError(key, "must be >= 1")


def check(cfg: MatchingConfig, model: nn.Module, num_peers: int) -> None:
    """Raise ``ConfigError`` if ``cfg`` cannot be measured on ``model`` with ``num_peers``."""
    if cfg.peers > num_peers:
        raise ConfigError("peers", f"{cfg.peers} local models but only {num_peers} peers")
    if not hidden_units(model):
        raise ConfigError("", "the model has no hidden units to match")


@torch.no_grad()
def unit_activations(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """Each hidden layer's activations on ``x`` as a [units, samples] matrix, by layer name
    (:func:`p2pfl.learning.models.hidden_units`); conv maps are reduced by their spatial maximum.
    The hooks are added after the model's position-encoding hooks, so they see encoded
    pre-activations."""
    out: dict[str, Tensor] = {}

    def keep(name: str):  # noqa: ANN202 - a forward hook
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            out[name] = output.flatten(2).amax(2).T if output.dim() > 2 else output.T

        return hook

    handles = [m.register_forward_hook(keep(n)) for n, (m, _) in hidden_units(model).items()]
    was_training = model.training
    model.eval()
    try:
        model(x)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return {name: a.detach().cpu().double() for name, a in out.items()}


def diagonal_ratio(a: Tensor, b: Tensor) -> float:
    """Fraction of units i whose Hungarian match in ``b`` is unit i, for activation
    matrices ``a``, ``b`` of shape [units, samples] (cost: unsquared Euclidean distance)."""
    from scipy.optimize import linear_sum_assignment  # here: scipy.optimize takes 0.5 s to import

    rows, cols = linear_sum_assignment(torch.cdist(a, b).numpy())
    return float(np.mean(rows == cols))


def _mean_by_layer(pairs: list[tuple[dict[str, Tensor], dict[str, Tensor]]]) -> dict[str, float]:
    """Per layer, the mean diagonal ratio over ``pairs``; plus ``mean`` over the layers."""
    ratios = {
        name: statistics.fmean(diagonal_ratio(a[name], b[name]) for a, b in pairs)
        for name in pairs[0][0]
    }
    return ratios | {"mean": statistics.fmean(ratios.values())}


def measure(
    trainer: Trainer,
    state: State,
    data: FederatedData,
    train: TrainConfig,
    cfg: MatchingConfig,
    seed: int,
    device: torch.device,
) -> dict[str, dict[str, float]]:
    """The matching ratios of ``state`` (the run's output model): ``global`` against each
    local model, and ``peers`` between local models (with two or more peers)."""
    chosen = numpy_rng(seed, "matching", "peers").choice(len(data.peers), cfg.peers, False)
    n_test = len(data.test_y)
    rows = numpy_rng(seed, "matching", "samples").choice(n_test, min(cfg.samples, n_test), False)
    x = data.test_x[torch.as_tensor(np.sort(rows))].to(device)
    model = trainer.module(device)

    def activations(s: State) -> dict[str, Tensor]:
        model.load_state_dict(s)
        return unit_activations(model, x)

    local_cfg = train.with_overrides({"epochs": cfg.epochs, "select": "last"})
    locals_ = []
    for p in sorted(int(p) for p in chosen):
        gen = torch_generator(seed, "matching", p)
        local = trainer.train(state, data.peers[p], local_cfg, gen, device).state
        locals_.append(activations(local))
    reference = activations(state)
    out = {"global": _mean_by_layer([(reference, a) for a in locals_])}
    if len(locals_) > 1:
        out["peers"] = _mean_by_layer(list(itertools.combinations(locals_, 2)))
    return out
