"""Scaled updates ("model replacement", Bhagoji et al., ICML 2019): the attacker boosts its
honest update Δ = honest − start and sends start + factor·Δ."""

from __future__ import annotations

from dataclasses import dataclass

from p2pfl.learning.state import State
from p2pfl.methods.attacks.base import ATTACKS, Attack, View, applied, update


@ATTACKS.register("scale")
@dataclass(kw_only=True, frozen=True)
class Scale(Attack):
    """Send start + factor·Δ.

    Args:
        factor: the factor its own update Δ is multiplied by.
    """

    factor: float = 10.0

    def corrupt(self, honest: State, view: View) -> State:
        delta = update(honest, view.start)
        return applied(view.start, {k: self.factor * d for k, d in delta.items()}, honest)
