"""Scoring an output ensemble: several models of one architecture that vote by their logits.

An ensemble is not one state_dict, so it cannot be scored by loading a single state. One-shot
methods report it as an upper reference next to their single aggregated model (as in
MA-Echo's official code: the logits of all local models are averaged, optionally per class over
the models that own the class).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from p2pfl.learning.state import State


@torch.no_grad()
def ensemble_logits(
    module: nn.Module,
    states: list[State],
    x: torch.Tensor,
    device: torch.device,
    weights: torch.Tensor | None = None,
    batch: int = 2048,
) -> torch.Tensor:
    """Logits of the ensemble on ``x``: ``Σ_i weights[i, c] · logits_i[:, c]``, in float64.

    ``weights`` has shape [models, classes]; None means the plain mean (1/N everywhere).
    Each state is loaded into ``module`` once.
    """
    if not states:
        raise ValueError("an ensemble needs at least one model")
    if weights is not None and weights.shape[0] != len(states):
        raise ValueError(f"{weights.shape[0]} weight rows for {len(states)} models")
    module.eval()
    total: torch.Tensor | None = None
    for i, state in enumerate(states):
        module.load_state_dict(state)
        logits = torch.cat(
            [module(x[j : j + batch].to(device)).double().cpu() for j in range(0, len(x), batch)]
        )
        share = 1.0 / len(states) if weights is None else weights[i].to(torch.float64)
        total = logits * share if total is None else total + logits * share
    assert total is not None
    return total


def score_ensemble(
    module: nn.Module,
    states: list[State],
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    weights: torch.Tensor | None = None,
) -> tuple[float, float]:
    """Accuracy (fraction) and mean cross-entropy of the ensemble's logits on ``(x, y)``."""
    logits = ensemble_logits(module, states, x, device, weights)
    acc = (logits.argmax(1) == y).double().mean().item() if len(y) else 0.0
    loss = F.cross_entropy(logits, y).item() if len(y) else 0.0
    return acc, loss
