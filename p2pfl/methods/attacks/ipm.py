"""Inner-product manipulation (Xie, Koyejo, Gupta, UAI 2020, §3): send −ε times the mean
honest update, so the aggregate's inner product with the true update turns negative when
the defence lets it through; small ε (0.1) hides it from medians and Krum.

Updates are taken from the attacker's start model; the honest models are those it knows —
its own and its honest neighbours' latest (:class:`~p2pfl.methods.attacks.base.View`); the
paper's adversary knows all of them. Sends start − ε·(mean(known) − start).
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pfl.core.errors import ConfigError
from p2pfl.learning.state import State
from p2pfl.methods.attacks.base import ATTACKS, Attack, View, applied, honest_mean, update


@ATTACKS.register("ipm")
@dataclass(kw_only=True, frozen=True)
class InnerProductManipulation(Attack):
    """Send start − ε·(mean of the known honest models − start).

    Args:
        epsilon: ε, how far against the honest update it sends.
    """

    epsilon: float = 0.1

    def __post_init__(self) -> None:
        if not self.epsilon > 0:
            raise ConfigError("epsilon", "must be > 0")

    def corrupt(self, honest: State, view: View) -> State:
        delta = update(honest_mean(view.known(honest)), view.start)
        return applied(view.start, {k: -self.epsilon * d for k, d in delta.items()}, honest)
