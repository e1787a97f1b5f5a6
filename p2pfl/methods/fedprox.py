"""FedProx (Li et al., 2020): FedAvg whose local loss adds (mu/2)·‖w − w_global‖².

With ``relaxed_init`` the anchor is the relaxed start, the model the training begins from
(specs/fedinit.md §2.1)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from p2pfl.core.errors import ConfigError
from p2pfl.methods.base import METHODS
from p2pfl.methods.effects import Regularizer, State, Train
from p2pfl.methods.fedavg import FedAvg


def proximal(anchor: State, mu: float) -> Regularizer:
    """(mu/2)·‖θ − anchor‖² over the trainable parameters."""

    def term(module: nn.Module, ce: torch.Tensor) -> torch.Tensor:
        total = ce.new_zeros(())
        for name, p in module.named_parameters():
            total = total + (p - anchor[name].to(p.device)).pow(2).sum()
        return 0.5 * mu * total

    return term


@METHODS.register("fedprox")
class FedProx(FedAvg):
    def __init__(
        self,
        *,
        rounds: int = 20,
        participation: float = 1.0,
        weighting: Literal["samples", "uniform"] = "samples",
        mu: float = 0.01,
        relaxed_init: dict | None = None,
    ) -> None:
        super().__init__(
            rounds=rounds,
            participation=participation,
            weighting=weighting,
            relaxed_init=relaxed_init,
        )
        if mu < 0:
            raise ConfigError("mu", "must be >= 0")
        self.mu = mu

    def local_train(self, state: State, round: int) -> Train:
        return Train(state, round, regularizer=proximal(state, self.mu) if self.mu else None)
