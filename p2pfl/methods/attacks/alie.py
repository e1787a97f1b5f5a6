""" "A little is enough" (Baruch, Baruch, Goldberg, NeurIPS 2019, Alg. 3): send μ − z·σ, the
coordinate-wise mean of the honest models minus z standard deviations — inside the spread of
honest models, so medians and Krum let it through, yet always pushing one way.

The paper's adversary knows every honest model; here the attacker knows its own honest model
and its honest neighbours' latest ones (:class:`~p2pfl.methods.attacks.base.View`), as in
He et al. 2022's decentralized version (whose attacker sees its target's neighbours). On a
star it knows only its own model, so σ = 0 and it sends its honest model. ``z`` null: the
paper's z_max = Φ⁻¹((n − m − s)/(n − m)) with s = ⌊n/2 + 1⌋ − m, for n peers, m attackers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from p2pfl.learning.state import State
from p2pfl.methods.attacks.base import ATTACKS, Attack, View


def z_max(n: int, m: int) -> float:
    """Baruch et al.'s z for n workers of which m are attackers (§3, Alg. 3, line 1)."""
    s = math.floor(n / 2 + 1) - m
    p = (n - m - s) / (n - m)
    return NormalDist().inv_cdf(min(max(p, 1e-9), 1 - 1e-9))


@ATTACKS.register("alie")
@dataclass(kw_only=True, frozen=True)
class ALittleIsEnough(Attack):
    """Send μ − z·σ of the honest models it knows.

    Args:
        z: how many standard deviations below the mean (null: the paper's z_max for the numbers of
            peers and attackers).
    """

    z: float | None = None

    def corrupt(self, honest: State, view: View) -> State:
        z = z_max(view.num_peers, view.num_attackers) if self.z is None else self.z
        models = view.known(honest)
        out: State = {}
        for k, v in honest.items():
            stack = torch.stack([s[k].to(torch.float64) for s in models])
            std = stack.std(0) if len(models) > 1 else torch.zeros_like(stack[0])
            out[k] = (stack.mean(0) - z * std).to(v.dtype)
        return out
