"""What crosses the network: a message of named tensors plus a small header.

A message's ``kind`` says what it carries (a model, local statistics, or control values);
its size on the wire, checks and serialization belong to :mod:`p2pfl.network.wire`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("model", "statistics", "control")
Meta = dict[str, Any]
Tensors = dict[str, torch.Tensor]


@dataclass
class Message:
    """One message: ``kind`` is model, statistics or control; ``tensors`` maps names to tensors."""

    kind: str
    src: int
    dst: int
    round: int
    tensors: Tensors = field(default_factory=dict)
    meta: Meta = field(default_factory=dict)
