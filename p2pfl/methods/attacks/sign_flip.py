"""Sign flipping (the classic baseline of Karimireddy et al., ICML 2021, and He et al. 2022):
the attacker sends its honest update reversed, start − scale·Δ. With a fraction f of
attackers, plain averaging moves by (1 − f − f·scale)·Δ̄: it stalls once f·(1 + scale) ≥ 1."""

from __future__ import annotations

from dataclasses import dataclass

from p2pfl.core.errors import ConfigError
from p2pfl.learning.state import State
from p2pfl.methods.attacks.base import ATTACKS, Attack, View, applied, update


@ATTACKS.register("sign_flip")
@dataclass(kw_only=True, frozen=True)
class SignFlip(Attack):
    """Send start − scale·Δ.

    Args:
        scale: the factor of the reversed update: it sends start − scale·Δ.
    """

    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ConfigError("scale", "must be > 0")

    def corrupt(self, honest: State, view: View) -> State:
        delta = update(honest, view.start)
        return applied(view.start, {k: -self.scale * d for k, d in delta.items()}, honest)
