"""How a one-shot upload becomes messages, and back.

A peer's upload is its model (a ``model`` message with its sample count) and one
``statistics`` message per kind of statistic (``diag``, ``kfac``, ``gram``), whose meta names
the statistic and the layers it covers. A statistic's matrices (K-FAC factors, Grams) travel
whole, as their upper triangles (``triangle: true``, lossless: they are symmetric), or with
``compress: true`` in the 9-bit low-rank code of :mod:`p2pfl.methods.oneshot.lowrank`. With
``compress: true`` the model and the diagonal Fisher travel under the wire's ``int16`` codec
(:mod:`p2pfl.network.codecs`), chosen for those messages only. Several candidate models travel
in one message as ``"i/name"`` (:func:`stack`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from p2pfl.learning.curvature import LayerInfo
from p2pfl.methods.effects import State
from p2pfl.methods.oneshot import lowrank
from p2pfl.methods.oneshot.statistics import StatisticsByKind, factor_dims, factors
from p2pfl.network.codecs import Codec, Compression, Int16, choose
from p2pfl.network.message import Message, Meta
from p2pfl.network.wire import deliver

UPLOAD_CODEC = Int16()
"""How the model and the diagonal Fisher travel with ``compress: true`` (FedFisher, App. C)."""


@dataclass
class Upload:
    """One peer's upload as an aggregator sees it (decoded)."""

    src: int
    num_samples: int
    state: State
    stats: dict[str, dict[str, Tensor]]
    layers: dict[str, dict[str, LayerInfo]]  # per statistic kind: covered layers by name


class Part(NamedTuple):
    """One message of an upload, and the codec it travels under (``None``: the section's)."""

    kind: str
    tensors: State
    meta: Meta
    codec: Codec | None


def upload_parts(
    state: State,
    stats: StatisticsByKind,
    num_samples: int,
    kinds: tuple[str, ...],
    *,
    compress: bool,
    triangle: bool,
) -> list[Part]:
    """The upload's messages: the model, then one per statistic in ``kinds``."""
    codec = UPLOAD_CODEC if compress else None
    out = [Part("model", dict(state), {"num_samples": num_samples}, codec)]
    for kind in kinds:
        values, infos = stats[kind]
        meta: Meta = {"stat": kind, "layers": {n: info_meta(i) for n, i in infos.items()}}
        if kind == "diag":
            out.append(Part("statistics", dict(values), meta, codec))
            continue
        mats = {n + f: values[n + f] for n in infos for f in factors(kind)}
        if compress:
            dims = [n for i in infos.values() for n in factor_dims(kind, i)]
            meta["rank"] = lowrank.rank_for(model_size(state), dims)
            out.append(Part("statistics", lowrank.encode(mats, meta["rank"]), meta, None))
        elif triangle:
            out.append(Part("statistics", {k: upper(v) for k, v in mats.items()}, meta, None))
        else:
            out.append(Part("statistics", mats, meta, None))
    return out


def as_received(
    parts: list[Part], node: int, round: int, compression: Compression | None
) -> list[Message]:
    """A peer's own upload as the others decode it (through the same codecs: each part's,
    else the run's ``compression``), so that every mesh peer merges the same values."""
    messages = [(Message(p.kind, node, node, round, p.tensors, p.meta), p.codec) for p in parts]
    return [deliver(msg, choose(compression, msg.kind, codec))[0] for msg, codec in messages]


def read_uploads(msgs: list[Message], *, compress: bool, triangle: bool) -> list[Upload]:
    """The uploads in ``msgs``, in peer order, with their statistics' matrices rebuilt."""
    uploads: dict[int, Upload] = {}
    for msg in sorted(msgs, key=lambda m: (m.src, m.kind != "model")):
        if msg.kind == "model":
            uploads[msg.src] = Upload(msg.src, msg.meta["num_samples"], dict(msg.tensors), {}, {})
            continue
        kind = msg.meta["stat"]
        infos = {n: info_from_meta(n, m) for n, m in msg.meta["layers"].items()}
        up = uploads[msg.src]
        up.layers[kind] = infos
        if kind == "diag":
            up.stats[kind] = dict(msg.tensors)
        elif compress:
            sides = [
                (n + f, side)
                for n, i in infos.items()
                for f, side in zip(factors(kind), factor_dims(kind, i), strict=True)
            ]
            up.stats[kind] = lowrank.decode(msg.tensors, sides, msg.meta["rank"])
        elif triangle:
            up.stats[kind] = {k: symmetric(v) for k, v in msg.tensors.items()}
        else:
            up.stats[kind] = dict(msg.tensors)
    return [uploads[s] for s in sorted(uploads)]


def model_size(state: State) -> int:
    """d: the number of floating entries of a model state."""
    return sum(t.numel() for t in state.values() if t.is_floating_point())


def info_meta(info: LayerInfo) -> list[Any]:
    """A covered layer in a message's meta: [weight shape, bias]."""
    return [list(info.weight_shape), info.bias]


def info_from_meta(name: str, meta: list[Any]) -> LayerInfo:
    """The inverse of :func:`info_meta`."""
    return LayerInfo.of(name, tuple(meta[0]), bool(meta[1]))


@functools.cache
def _triangle(n: int) -> Tensor:
    """The (row, column) indices of an n x n matrix's upper triangle, made once per size (a
    third of a 1,000-peer RegMean run made them for each peer's Gram)."""
    return torch.triu_indices(n, n)


def upper(m: Tensor) -> Tensor:
    """The upper triangle (diagonal included) of a square matrix, row by row."""
    i, j = _triangle(m.shape[0])
    return m[i, j].contiguous()


def symmetric(tri: Tensor) -> Tensor:
    """The symmetric matrix whose upper triangle is ``tri`` (inverse of :func:`upper`)."""
    n = int((8 * tri.numel() + 1) ** 0.5 - 1) // 2
    i, j = _triangle(n)
    m = tri.new_zeros(n, n)
    m[i, j] = tri
    m[j, i] = tri
    return m


def stack(states: list[State]) -> State:
    """Several states in one message: ``"i/name"`` for candidate i."""
    return {f"{i}/{k}": v for i, s in enumerate(states) for k, v in s.items()}


def unstack(tensors: State, count: int) -> list[State]:
    """The inverse of :func:`stack`."""
    out: list[State] = [{} for _ in range(count)]
    for key, v in tensors.items():
        i, name = key.split("/", 1)
        out[int(i)][name] = v
    return out
