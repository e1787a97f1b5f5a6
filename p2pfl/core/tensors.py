"""Copies of tensors that cost nothing until written (issue 38: 10⁴ peers each holding the
model they started from and the messages in their inboxes)."""

from __future__ import annotations

import torch

LAZY = getattr(torch, "_lazy_clone", None)
"""torch's copy-on-write clone (torch >= 2.3; else every copy is a ``clone``)."""

LAZY_BYTES = 4096
"""Smaller tensors are cloned: their copy costs less than the checks."""


def lazy_clone(t: torch.Tensor) -> torch.Tensor:
    """``t.clone()`` (``t`` a CPU tensor outside autograd), copy-on-write where ``t`` is a
    large contiguous tensor that spans its storage: the two share their bytes until either
    is written to, when the writer gets its own, so neither ever sees the other's changes.
    A view is cloned (a lazy clone would keep its whole storage alive), and so is memory
    torch did not allocate (numpy's, a decoded frame's)."""
    if (
        LAZY is not None
        and t.numel() * t.element_size() >= LAZY_BYTES
        and t._base is None
        and t.layout == torch.strided
        and t.storage_offset() == 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    ):
        try:
            return LAZY(t)
        except RuntimeError:  # memory torch did not allocate
            pass
    return t.clone()
