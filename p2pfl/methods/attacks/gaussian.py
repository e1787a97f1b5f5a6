"""Gaussian noise: the attacker adds N(0, std²) to every parameter of its honest model
(the "Gaussian" Byzantine vector of Blanchard et al., NeurIPS 2017, §5, around the honest
model), drawn from the message's own seeded stream."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2pfl.core.errors import ConfigError
from p2pfl.learning.state import State
from p2pfl.methods.attacks.base import ATTACKS, Attack, View


@ATTACKS.register("gaussian")
@dataclass(kw_only=True, frozen=True)
class Gaussian(Attack):
    """Send honest + N(0, std²).

    Args:
        std: the noise's standard deviation.
    """

    std: float = 1.0

    def __post_init__(self) -> None:
        if not self.std > 0:
            raise ConfigError("std", "must be > 0")

    def corrupt(self, honest: State, view: View) -> State:
        return {
            k: v + self.std * torch.randn(v.shape, generator=view.rng, dtype=v.dtype)
            for k, v in honest.items()
        }
