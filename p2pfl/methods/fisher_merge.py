"""Fisher merging (Matena & Raffel, 2022) as a one-shot FL baseline (FedFisher, §5.1, App. D.3).

Each peer uploads its model and its diagonal true Fisher F_i; the merge is elementwise

    θ = Σ_i p_i F_i ⊙ w_i / Σ_i p_i F_i,

with coordinates where Σ_i p_i F_i < ``floor`` (1e-6) falling back to one-shot FedAvg.
There is one candidate, so no validation. ``compress: true`` sends both the model and the
Fisher as 16-bit codes (as FedFisher(Diag)). Keys as in :class:`OneShot`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2pfl.learning.state import tensor_sum
from p2pfl.methods.base import METHODS
from p2pfl.methods.effects import State
from p2pfl.methods.oneshot import OneShot, Upload, fedavg, shares

FLOOR = 1e-6


def fisher_merge(uploads: list[Upload], floor: float = FLOOR) -> State:
    """The Fisher-weighted average of the uploads' models (see the module docstring)."""
    out = fedavg(uploads)
    p = shares(uploads)
    for name in uploads[0].stats["diag"]:
        f = [u.stats["diag"][name].double() for u in uploads]
        total = tensor_sum(pi * fi for pi, fi in zip(p, f, strict=True))
        weighted = tensor_sum(
            pi * fi * u.state[name].double() for pi, fi, u in zip(p, f, uploads, strict=True)
        )
        merged = torch.where(total >= floor, weighted / total.clamp_min(floor), out[name].double())
        out[name] = merged.to(out[name].dtype)
    return out


@METHODS.register("fisher_merge")
@dataclass(kw_only=True, eq=False)
class FisherMerge(OneShot):
    """Diagonal-Fisher weighted average of the local models, in one shot."""

    needs = ("diag",)

    def candidates(self, uploads: list[Upload]) -> list[State]:
        return [fisher_merge(uploads)]
