"""Position-aware neurons (Li, Xu, Song, Li, Li, Shao, Zhan, CVPR 2022, §3.2 and App. B).

A fixed, position-dependent value per hidden unit (per channel of a conv layer), added to or
multiplied into the unit's pre-activation: after the layer and its normalisation, before the
non-linearity, never on the output layer. The values tie each unit to its index, so the
units of peers trained on different data stay aligned for coordinate-wise averaging. They
change only the network: every method runs unchanged, and nothing extra is sent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from p2pfl.core.errors import ConfigError


@dataclass(frozen=True)
class Pans:
    """The ``model.pans`` key: position-aware neurons (Li et al., CVPR 2022, §3.2, Eqs. 2–5).

    Unit j of a hidden layer of width J gets e_j = A·sin(2πTj/J) added to (``add``) or
    1 + A·sin(2πTj/J) multiplied into (``mul``) its pre-activation. T counts sine cycles
    across the layer. The values are fixed and identical on every peer, so they tie each
    unit to its index without being trained or sent. ``off`` (or A = 0) is a plain network.

    Args:
        mode: ``off`` (a plain network), ``add`` (e_j added to the pre-activation) or ``mul`` (1 +
            e_j multiplied into it).
        T: T, the number of sine cycles across a layer's units.
        A: A, the encodings' amplitude (>= 0; < 1 with ``mul``; 0 is a plain network).
    """

    mode: Literal["off", "add", "mul"] = "off"
    T: float = 1.0
    A: float = 0.1

    def __post_init__(self) -> None:
        if self.A < 0:
            raise ConfigError("A", f"must be >= 0, got {self.A}")
        if self.mode == "mul" and self.A >= 1:
            raise ConfigError(
                "A", f"must be < 1 with mode mul (1 - A would flip units), got {self.A}"
            )

    def values(self, width: int) -> Tensor:
        """The encoding of a layer of ``width`` units (float32)."""
        j = torch.arange(width, dtype=torch.float64)
        wave = torch.sin(2 * math.pi * self.T * j / width)
        if self.A > 0 and wave.abs().max() < 1e-6:
            # T·j/J is an integer for every j: sin vanishes and PANs would silently be off.
            raise ConfigError("T", f"T = {self.T} gives sin(2πTj/J) = 0 for all {width} units")
        return (self.A * wave if self.mode == "add" else 1 + self.A * wave).float()


class PositionEncoding(nn.Module):
    """Adds (``add``) or multiplies (``mul``) a fixed value per unit along dim 1 of its input
    (features of ``[B, J]``, channels of ``[B, C, H, W]``).

    The values are a non-persistent buffer: they follow ``.to(device)`` but stay out of
    ``state_dict``, so they are never trained, sent, averaged or counted in the ledger.
    """

    def __init__(self, mode: Literal["add", "mul"], values: Tensor) -> None:
        super().__init__()
        self.mode = mode
        self.values: Tensor
        self.register_buffer("values", values, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        e = self.values.view(1, -1, *([1] * (x.dim() - 2)))
        return x + e if self.mode == "add" else x * e

    def extra_repr(self) -> str:
        return f"{self.mode}, units={self.values.numel()}"


def _encode_output(module: nn.Module, inputs: Any, output: Tensor) -> Tensor:
    pan = module.get_submodule("pan")
    return pan(output)


def encode(units: Iterable[tuple[nn.Module, int]], pans: Pans) -> None:
    """Put a :class:`PositionEncoding` on the output of each ``(module, width)`` of
    ``units``, a model's hidden pre-activation points (:func:`p2pfl.learning.models.hidden_units`).

    Each becomes a child ``pan`` of the module, applied by a forward hook: the builders'
    modules (torchvision's ResNet blocks included) and their state-dict keys stay exactly
    as without PANs, so PANs on and off send the same bytes.
    """
    if pans.mode == "off":
        return
    for module, width in units:
        module.pan = PositionEncoding(pans.mode, pans.values(width))
        module.register_forward_hook(_encode_output)
