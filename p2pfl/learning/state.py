"""Model states (torch's ``state_dict`` contract: names to tensors) and their arithmetic."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import Tensor

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
        k: _clone(v) if v.is_cpu and not v.requires_grad else v.detach().to("cpu", copy=True)
        for k, v in state.items()
    }


_LAZY = getattr(torch, "_lazy_clone", None)
"""torch's copy-on-write clone (torch >= 2.3; else every copy is a ``clone``)."""

_LAZY_BYTES = 4096
"""Smaller tensors are cloned: their copy costs less than the checks."""


def _clone(t: Tensor) -> Tensor:
    """``t.clone()``, copy-on-write where ``t`` is a large strided tensor that is not a view
    and spans its storage (a lazy clone of a view would keep its whole storage alive)."""
    if (
        _LAZY is not None
        and t.numel() * t.element_size() >= _LAZY_BYTES
        and t._base is None
        and t.layout == torch.strided
        and t.storage_offset() == 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    ):
        try:
            return _LAZY(t)
        except RuntimeError:  # memory torch did not allocate (numpy's, a frame's)
            pass
    return t.clone()


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
    for k, v in ref.items():
        acc = _scratch(v, 0).zero_()
        wide = _scratch(v, 1) if v.dtype != torch.float64 else None
        for share, state in zip(shares, states, strict=True):
            # in float64, converting first (into a buffer: add_ would allocate the copy)
            acc.add_(state[k] if wide is None else wide.copy_(state[k]), alpha=share)
        if not v.is_floating_point():
            acc = acc.round()
        out[k] = acc.to(v.dtype, copy=True)
    return out


_SCRATCH = threading.local()
"""Each thread's float64 buffers, per device and use, grown to the largest tensor seen."""


def _scratch(like: Tensor, use: int) -> Tensor:
    """Float64 scratch tensor number ``use`` shaped as ``like``, reused from call to call
    (dirty: overwrite it). :func:`average_states` sums in one and converts each term in
    another: fresh ones per tensor and call, 10⁴ DFedAvgM peers each mixing three 50,176-weight
    layers a round made four 400 kB blocks per peer and round that glibc then kept, among
    the states, as freed memory (issue 38)."""
    buffers: dict[tuple[torch.device, int], Tensor] = _SCRATCH.__dict__.setdefault("buffers", {})
    buf = buffers.get((like.device, use))
    if buf is None or buf.numel() < like.numel():
        buf = torch.empty(like.numel(), dtype=torch.float64, device=like.device)
        buffers[like.device, use] = buf
    return buf[: like.numel()].view(like.shape)
