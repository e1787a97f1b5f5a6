"""Message compression at the wire: how a floating tensor travels under a kind's codec.

The experiment's ``compression:`` section gives one :class:`Codec` per message kind. At
:func:`p2pfl.network.wire.encode` every floating tensor of a message of that kind is packed by the
codec, and its schema entry records how (``"codec"``, plus ``"k"`` for top-k); decoding
rebuilds a tensor of the original dtype and shape. Integer and bool tensors (BatchNorm
counters, label masks, codes that are already quantized) always travel raw, and so does a
tensor the codec would not make smaller. Both choices depend on dtype and shape only, so a
message's size never depends on its values and the cost analysis stays exact.

Codecs and their round-trip error for a tensor x (x̂ = decode(encode(x))):

- ``fp16``: IEEE half precision, values first clamped to ±65504 (the largest half).
  |x̂ᵢ − xᵢ| ≤ 2⁻¹¹·|xᵢ| where |xᵢ| ≥ 2⁻¹⁴, and ≤ 2⁻²⁵ below (half subnormals). 2 bytes each.
- ``int8``: symmetric per-tensor quantization, s = max|x| (float32), codes
  round(127·x/s) (:func:`p2pfl.network.quantize.quantize`). |x̂ᵢ − xᵢ| ≤ s/254 (half a step),
  plus float32 rounding. 4 + n bytes. A tensor with inf or NaN is an error.
- ``topk``: the k = ⌈fraction·n⌉ entries of largest magnitude (ties: the lower index)
  with their flat indices (int32, int64 beyond 2³¹ entries); the rest become 0. Kept
  entries are exact, max |x̂ − x| ≤ the k-th largest |xᵢ|, and
  ‖x̂ − x‖² ≤ (1 − k/n)·‖x‖². k·(4 + itemsize) bytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import bind
from p2pfl.network import quantize as cz
from p2pfl.network.message import KINDS

FP16_MAX = 65504.0
INT8_LEVELS = 127
_INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class Codec:
    """The keys of one ``compression.KIND`` section."""

    codec: Literal["none", "fp16", "int8", "topk"] = "none"
    fraction: float = 0.01  # topk: share of entries kept

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ConfigError("fraction", f"must be in (0, 1], got {self.fraction}")


Compression = dict[str, Codec]
"""Message kind -> codec; kinds not listed travel raw."""


def resolve_section(options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Check the ``compression:`` section; return it with every listed kind's defaults."""

    out = {}
    for kind, keys in options.items():
        if kind not in KINDS:
            raise ConfigError(kind, f"unknown message kind; choose from {', '.join(KINDS)}")
        if not isinstance(keys, dict):
            raise ConfigError(kind, "must be a mapping such as {codec: int8}")
        try:
            out[kind] = asdict(Codec(**bind(Codec, keys)))
        except ConfigError as e:
            raise e.within(kind) from None
    return out


def from_section(section: dict[str, dict[str, Any]]) -> Compression:
    """The codecs of a resolved ``compression:`` section."""
    return {kind: Codec(**keys) for kind, keys in section.items()}


def topk_count(numel: int, fraction: float) -> int:
    return min(numel, math.ceil(fraction * numel - 1e-9))


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= _INT32_LIMIT else torch.int64


def packed_size(entry: dict[str, Any], numel: int, dtype: torch.dtype) -> int:
    """Bytes a tensor with this schema entry takes in the frame."""
    name = entry["codec"]
    if name == "fp16":
        return 2 * numel
    if name == "int8":
        return 4 + numel
    if name == "topk":
        k = entry["k"]
        return k * (_index_dtype(numel).itemsize + dtype.itemsize)
    raise ValueError(f"unknown codec {name!r}")


def schema_entry(shape: torch.Size, dtype: torch.dtype, codec: Codec | None) -> dict[str, Any]:
    """The schema fields that say how a tensor travels: empty when raw."""
    if codec is None or codec.codec == "none" or not dtype.is_floating_point:
        return {}
    if codec.codec == "fp16" and dtype == torch.float16:
        return {}
    numel = math.prod(shape)
    entry: dict[str, Any] = {"codec": codec.codec}
    if codec.codec == "topk":
        entry["k"] = topk_count(numel, codec.fraction)
    return entry if packed_size(entry, numel, dtype) < numel * dtype.itemsize else {}


def pack(t: Tensor, entry: dict[str, Any]) -> Tensor:
    """``t`` packed as ``entry`` says, as flat uint8 bytes."""
    flat = t.detach().to("cpu").reshape(-1)
    name = entry["codec"]
    if name == "fp16":
        return _raw(flat.clamp(-FP16_MAX, FP16_MAX).to(torch.float16))
    if name == "int8":
        if not torch.isfinite(flat).all():
            raise ValueError("int8 codec: the tensor has inf or NaN values")
        codes, scale = cz.quantize(flat, 8)
        return torch.cat([_raw(scale.reshape(1).float()), _raw(codes.to(torch.int8))])
    k = entry["k"]
    order = torch.argsort(flat.abs(), descending=True, stable=True)[:k]
    index = order.sort().values
    return torch.cat([_raw(index.to(_index_dtype(flat.numel()))), _raw(flat[index])])


def unpack(raw: Tensor, entry: dict[str, Any], shape: list[int], dtype: torch.dtype) -> Tensor:
    """The tensor of ``shape`` and ``dtype`` rebuilt from ``raw`` (flat uint8)."""
    numel = math.prod(shape)
    name = entry["codec"]
    if name == "fp16":
        return raw.view(torch.float16).to(dtype).reshape(shape)
    if name == "int8":
        scale = raw[:4].clone().view(torch.float32)[0]
        return cz.dequantize(raw[4:].view(torch.int8), scale, 8).to(dtype).reshape(shape)
    index_dtype = _index_dtype(numel)
    split = entry["k"] * index_dtype.itemsize
    index = raw[:split].clone().view(index_dtype).long()
    if len(index) and (index[0] < 0 or index[-1] >= numel or (index.diff() <= 0).any()):
        raise ValueError("topk indices out of range or not increasing")
    out = torch.zeros(numel, dtype=dtype)
    out[index] = raw[split:].clone().view(dtype)
    return out.reshape(shape)


def check_entry(entry: dict[str, Any], numel: int, dtype: torch.dtype) -> int:
    """Validate a received schema entry's codec fields; return its packed size."""
    name = entry.get("codec")
    if name not in ("fp16", "int8", "topk") or not dtype.is_floating_point:
        raise ValueError(f"codec {name!r} for a {dtype} tensor")
    if name == "topk":
        k = entry.get("k")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= numel:
            raise ValueError(f"topk count {k!r} out of range")
    return packed_size(entry, numel, dtype)


def _raw(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
