"""Model states (torch's ``state_dict`` contract: names to tensors) and their arithmetic."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import Tensor

from p2pfl.core.tensors import lazy_clone

State = dict[str, Tensor]
"""A model's (or any message's) named tensors, as ``nn.Module.state_dict()`` returns them."""


def tensor_sum(terms: Iterable[Tensor]) -> Tensor:
    """Python's ``sum`` of tensors, left to right (so the bits are those of ``sum``), typed:
    a non-empty sum of tensors is a tensor."""
    return cast(Tensor, sum(terms))


def state_bytes(state: State) -> int:
    """Raw size of a state dict: Σ numel · element_size (what a message carries)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def clone_state(state: State) -> State:
    """Detached CPU copies of every tensor, safe to keep while the model trains on
    (``clone`` where a tensor is already on the CPU and outside autograd: the same copy,
    at a third of the cost of the general ``to``).

    A CPU tensor that spans its storage is cloned copy-on-write (``torch._lazy_clone``):
    its bytes are copied only when the original or the copy is written to, so the initial
    model that every one of 10⁴ peers starts from is held once until each trains
    (issue 38). Either way neither side ever sees the other's writes."""
    return {
        k: lazy_clone(v) if v.is_cpu and not v.requires_grad else v.detach().to("cpu", copy=True)
        for k, v in state.items()
    }


def ghost(state: State) -> State:
    """``state``'s layout without its bytes (``meta`` tensors): a sharded run's model of a
    peer that another rank holds (:mod:`p2pfl.runtime.shards`). A ghost's own tensors are
    shared, not made again: they hold nothing to change (a new ``meta`` tensor from a
    ``meta`` one costs 0.4 ms, from a CPU one 1 µs)."""
    return {k: t if t.is_meta else torch.empty_like(t, device="meta") for k, t in state.items()}


def is_ghost(state: State | None) -> bool:
    """Whether ``state`` is a ghost (:func:`ghost`)."""
    return state is not None and any(t.is_meta for t in state.values())


def average_states(states: Sequence[State], weights: Sequence[float] | None = None) -> State:
    """Weighted mean of state dicts with identical keys, shapes and dtypes.

    Weights default to uniform and are normalised here. Floating tensors are accumulated in
    float64 and cast back to their dtype, so averaging identical states returns them bit for
    bit. Integer tensors (BatchNorm ``num_batches_tracked``) get the rounded weighted mean.
    """
    if not states:
        raise ValueError("average_states needs at least one state")
    if is_ghost(states[0]):  # layouts without bytes: nothing to add
        return ghost(states[0])
    if weights is None:
        weights = [1.0] * len(states)
    if len(weights) != len(states):
        raise ValueError(f"{len(weights)} weights for {len(states)} states")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
    total = float(sum(weights))
    shares = [w / total for w in weights]
    ref = states[0]
    for i, state in enumerate(states[1:], 1):
        if state.keys() != ref.keys():
            diff = sorted(set(state) ^ set(ref))
            raise ValueError(f"state {i} has different keys than state 0: {diff}")
        for k, v in state.items():
            if v.shape != ref[k].shape or v.dtype != ref[k].dtype:
                raise ValueError(
                    f"state {i} {k!r}: {v.dtype}{list(v.shape)}, "
                    f"state 0 has {ref[k].dtype}{list(ref[k].shape)}"
                )
    out: State = {}
    views = _scratch()
    for k, v in ref.items():
        acc, wide = views.get((v.shape, v.device)) or views.make(v.shape, v.device)
        acc.zero_()
        same = v.dtype == torch.float64
        for share, state in zip(shares, states, strict=True):
            # in float64, converting first (into a buffer: add_ would allocate the copy)
            acc.add_(state[k] if same else wide.copy_(state[k]), alpha=share)
        if not v.is_floating_point():
            acc = acc.round()
        out[k] = acc.to(v.dtype, copy=True)
    return out


class _Scratch(dict[tuple[torch.Size, torch.device], tuple[Tensor, Tensor]]):
    """One thread's float64 scratch for :func:`average_states`: per shape and device, a sum
    and a converted term, views into two buffers per device grown to the largest tensor.

    Fresh ones per tensor and call (``torch.zeros``, and the float64 copy that ``add_``
    makes of a float32 term) were four 400 kB blocks per peer and round when 10⁴ DFedAvgM
    peers mixed three 50,176-weight layers, which glibc then kept, among the states, as
    freed memory (issue 38)."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def make(self, shape: torch.Size, device: torch.device) -> tuple[Tensor, Tensor]:
        """The views for ``shape`` on ``device`` (the device's buffers regrown, and its
        views made anew, where ``shape`` is larger than any before)."""
        numel = shape.numel()
        held = self.buffers.get(device)
        if held is None or held[0].numel() < numel:
            for key in [key for key in self if key[1] == device]:
                del self[key]  # views of the old buffers
            held = self.buffers[device] = (
                torch.empty(numel, dtype=torch.float64, device=device),
                torch.empty(numel, dtype=torch.float64, device=device),
            )
        acc, wide = (b[:numel].view(shape) for b in held)
        self[shape, device] = (acc, wide)
        return acc, wide


_SCRATCH = threading.local()


def _scratch() -> _Scratch:
    """This thread's :class:`_Scratch`."""
    views = getattr(_SCRATCH, "views", None)
    if views is None:
        views = _SCRATCH.views = _Scratch()
    return views
