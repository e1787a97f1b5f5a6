"""FedProx (Li et al., 2020): FedAvg whose local loss adds (mu/2)·‖w − w_global‖².

With ``relaxed_init`` the anchor is the relaxed start, the model the training begins from
(FedInit's Table 2 plugs the relaxed start into FedProx; docs/pans-fedinit.md)."""

from __future__ import annotations

from dataclasses import dataclass

from p2pfl.core.errors import ConfigError
from p2pfl.learning.training import Proximal
from p2pfl.methods.base import METHODS
from p2pfl.methods.effects import State, Train
from p2pfl.methods.fedavg import FedAvg


@METHODS.register("fedprox")
@dataclass(kw_only=True, eq=False)
class FedProx(FedAvg):
    """FedAvg with a proximal term on the local loss.

    Args:
        mu: μ, the weight of the proximal term (μ/2)·‖w − w_global‖² on the local loss (0: FedAvg).
    """

    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mu < 0:
            raise ConfigError("mu", "must be >= 0")

    def local_train(self, state: State, round: int) -> Train:
        return Train(state, round, regularizer=Proximal(state, self.mu) if self.mu else None)
