"""RegMean (Jin et al., 2023) as a one-shot FL baseline (FedFisher, §5.1, App. D.3).

Each peer uploads its model and, per ``nn.Linear`` layer, the Gram G_i = X_i^T X_i / n_i of
that layer's inputs over its training data. Per linear layer, with the off-diagonal of
p_i·G_i scaled by a (the diagonal kept),

    W = (Σ_i G̃_i)^+ Σ_i G̃_i W_i^T   (transposed back to out × in),

the least-squares merge of the layer's outputs. Conv weights, biases and every other tensor
take the *uniform* mean, as the reference code does. Each value in ``offdiag`` gives one
candidate; ``select: val`` keeps the best on the peers' validation splits, ``final`` the
last. ``compress: true`` sends the model as 16-bit codes and each Gram as a 9-bit low-rank
factorization, like K-FAC factors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2pfl.core.errors import ConfigError
from p2pfl.learning.state import average_states
from p2pfl.methods.base import METHODS
from p2pfl.methods.effects import State
from p2pfl.methods.oneshot import OneShot, Upload, shares


def regmean(uploads: list[Upload], offdiag: float) -> State:
    """The RegMean merge of the uploads with off-diagonal scale ``offdiag``."""
    out = average_states([u.state for u in uploads])
    p = shares(uploads)
    for name in uploads[0].layers["gram"]:
        key = f"{name}.weight"
        grams = targets = torch.zeros(())  # Σ_i G_i and Σ_i G_i W_iᵀ, summed as they come
        for pi, u in zip(p, uploads, strict=True):
            g = pi * u.stats["gram"][name].double()
            g = g * offdiag + torch.diag(torch.diagonal(g)) * (1 - offdiag)
            grams, targets = grams + g, targets + g @ u.state[key].double().T
        merged = torch.linalg.pinv(grams) @ targets
        out[key] = merged.T.to(out[key].dtype).contiguous()
    return out


@METHODS.register("regmean")
@dataclass(kw_only=True, eq=False)
class RegMean(OneShot):
    """Per-layer closed-form regression merge from the peers' input Grams, in one shot.

    Args:
        offdiag: the off-diagonal scales of the Gram matrices tried; the peers' validation picks one
            (with ``select: val``).
    """

    needs = ("gram",)

    offdiag: tuple[float, ...] = (0.1, 0.9)

    def __post_init__(self) -> None:
        if not self.offdiag or not all(0 <= a <= 1 for a in self.offdiag):
            raise ConfigError("offdiag", "must list values in [0, 1]")
        super().__post_init__()

    def count(self) -> int:
        return len(self.offdiag)

    def candidates(self, uploads: list[Upload]) -> list[State]:
        return [regmean(uploads, a) for a in self.offdiag]
