"""Message compression at the wire: how a floating tensor travels under a codec.

Codecs are registered by name in :data:`CODECS`, open to plug-ins like the methods. The
experiment's ``compression:`` section names one per message kind, ``compression.KIND:
{codec: NAME, ...the codec's own keys}``; a method may choose one for a single message
(``Send.codec``: FedFisher's ``compress: true`` sends its uploads under ``int16``). At
:func:`p2pfl.network.wire.encode` every floating tensor of the message is packed by the
codec, and its schema entry records how (``"codec"``, plus the codec's fields such as
top-k's ``"k"``); decoding rebuilds a tensor of the original dtype and shape. Integer and
bool tensors (BatchNorm counters, label masks, codes that are already quantized) always
travel raw, and so does a tensor the codec would not make smaller. Both choices depend on
dtype and shape only, so a message's size never depends on its values and the cost
analysis stays exact.

Codecs and their round-trip error for a tensor x of n entries (x̂ = decode(encode(x))):

- ``none``: raw bytes, exact.
- ``fp16``: IEEE half precision, values first clamped to ±65504 (the largest half).
  |x̂ᵢ − xᵢ| ≤ 2⁻¹¹·|xᵢ| where |xᵢ| ≥ 2⁻¹⁴, and ≤ 2⁻²⁵ below (half subnormals). 2n bytes.
- ``int8`` / ``int16``: symmetric per-tensor quantization (:func:`quantize`), s = max|x|
  (float32), codes round(L·x/s) with L = 127 / 32767. |x̂ᵢ − xᵢ| ≤ s/(2L) (half a step),
  plus float32 rounding. 4 + n / 4 + 2n bytes (the scale, then the codes). A tensor with
  inf or NaN is an error. ``int16`` is FedFisher's upload quantization (its App. C).
- ``topk``: the k = ⌈fraction·n⌉ entries of largest magnitude (ties: the lower index)
  with their flat indices (int32, int64 beyond 2³¹ entries); the rest become 0. Kept
  entries are exact, max |x̂ − x| ≤ the k-th largest |xᵢ|, and
  ‖x̂ − x‖² ≤ (1 − k/n)·‖x‖². k·(4 + itemsize) bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import Registry, bind, parameters
from p2pfl.network.message import KINDS

FP16_MAX = 65504.0
_INT32_LIMIT = 2**31 - 1

Entry = dict[str, Any]
"""A tensor's codec fields in the frame's schema: ``{"codec": NAME, ...}``."""


@dataclass(frozen=True)
class Codec:
    """A way a floating tensor travels, registered in :data:`CODECS` under its name.

    An instance holds the codec's options (its dataclass fields are its keys in
    ``compression.KIND``). The sender asks :meth:`fields` for a tensor's schema fields;
    everything after that (:meth:`packed_size`, :meth:`pack`, :meth:`unpack`) reads the
    schema entry only, so the receiver decodes with a default instance.
    """

    name: ClassVar[str]

    def fields(self, numel: int, dtype: torch.dtype) -> Entry:
        """Schema fields besides ``codec`` that packing this tensor needs."""
        return {}

    def check(self, entry: Entry, numel: int) -> None:
        """Raise ``ValueError`` if a received entry's fields are out of range."""

    def packed_size(self, entry: Entry, numel: int, dtype: torch.dtype) -> int:
        """Bytes the tensor takes in the frame."""
        raise NotImplementedError

    def pack(self, flat: Tensor, entry: Entry) -> Tensor:
        """The flat CPU tensor ``flat`` as uint8 bytes."""
        raise NotImplementedError

    def unpack(self, raw: Tensor, entry: Entry, numel: int, dtype: torch.dtype) -> Tensor:
        """The flat tensor of ``dtype`` rebuilt from ``raw`` (uint8)."""
        raise NotImplementedError


CODECS: Registry[type[Codec]] = Registry("codec")

Compression = dict[str, Codec]
"""Message kind -> codec; kinds not listed travel raw."""


@CODECS.register("none")
class Raw(Codec):
    """The tensor's own bytes (never smaller, so a tensor under ``none`` travels raw)."""

    def packed_size(self, entry: Entry, numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize

    def pack(self, flat: Tensor, entry: Entry) -> Tensor:
        return _raw(flat)

    def unpack(self, raw: Tensor, entry: Entry, numel: int, dtype: torch.dtype) -> Tensor:
        return raw.view(dtype)


@CODECS.register("fp16")
class Half(Codec):
    """IEEE half precision, clamped to ±65504."""

    def packed_size(self, entry: Entry, numel: int, dtype: torch.dtype) -> int:
        return 2 * numel

    def pack(self, flat: Tensor, entry: Entry) -> Tensor:
        return _raw(flat.clamp(-FP16_MAX, FP16_MAX).to(torch.float16))

    def unpack(self, raw: Tensor, entry: Entry, numel: int, dtype: torch.dtype) -> Tensor:
        return raw.view(torch.float16).to(dtype)


def quantize(t: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Symmetric max-abs quantization to ``bits`` bits, sign included: int16 codes
    round((2^(bits−1) − 1)·t / max|t|) (``bits`` ≤ 16) and the float32 scale max|t|."""
    levels = 2 ** (bits - 1) - 1
    scale = t.abs().max().float() if t.numel() else torch.tensor(0.0)
    if scale == 0:
        return torch.zeros(t.shape, dtype=torch.int16), scale
    codes = torch.round(t.double() * (levels / scale.double()))
    return codes.to(torch.int16), scale


def dequantize(codes: Tensor, scale: Tensor, bits: int) -> Tensor:
    """float32 values scale·codes / (2^(bits−1) − 1): the inverse of :func:`quantize`."""
    levels = 2 ** (bits - 1) - 1
    return (codes.double() * (scale.double() / levels)).float()


class Symmetric(Codec):
    """Symmetric per-tensor quantization to ``bits`` bits: the float32 scale, then the codes."""

    bits: ClassVar[int]
    code_dtype: ClassVar[torch.dtype]

    def packed_size(self, entry: Entry, numel: int, dtype: torch.dtype) -> int:
        return 4 + numel * self.code_dtype.itemsize

    def pack(self, flat: Tensor, entry: Entry) -> Tensor:
        if not torch.isfinite(flat).all():
            raise ValueError(f"{self.name} codec: the tensor has inf or NaN values")
        codes, scale = quantize(flat, self.bits)
        return torch.cat([_raw(scale.reshape(1).float()), _raw(codes.to(self.code_dtype))])

    def unpack(self, raw: Tensor, entry: Entry, numel: int, dtype: torch.dtype) -> Tensor:
        scale = raw[:4].clone().view(torch.float32)[0]
        codes = raw[4:].clone().view(self.code_dtype)  # a copy: int16 needs an even offset
        return dequantize(codes, scale, self.bits).to(dtype)


@CODECS.register("int8")
class Int8(Symmetric):
    """8-bit codes: 4 + n bytes."""

    bits = 8
    code_dtype = torch.int8


@CODECS.register("int16")
class Int16(Symmetric):
    """16-bit codes: 4 + 2n bytes."""

    bits = 16
    code_dtype = torch.int16


def topk_count(numel: int, fraction: float) -> int:
    return min(numel, math.ceil(fraction * numel - 1e-9))


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= _INT32_LIMIT else torch.int64


@CODECS.register("topk")
@dataclass(frozen=True)
class TopK(Codec):
    """The ``k`` entries of largest magnitude and their flat indices (schema field ``k``).

    Args:
        fraction: the share of each tensor's entries sent (the largest in magnitude), in (0, 1].
    """

    fraction: float = 0.01  # share of entries kept

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ConfigError("fraction", f"must be in (0, 1], got {self.fraction}")

    def fields(self, numel: int, dtype: torch.dtype) -> Entry:
        return {"k": topk_count(numel, self.fraction)}

    def check(self, entry: Entry, numel: int) -> None:
        k = entry.get("k")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= numel:
            raise ValueError(f"topk count {k!r} out of range")

    def packed_size(self, entry: Entry, numel: int, dtype: torch.dtype) -> int:
        return entry["k"] * (_index_dtype(numel).itemsize + dtype.itemsize)

    def pack(self, flat: Tensor, entry: Entry) -> Tensor:
        order = torch.argsort(flat.abs(), descending=True, stable=True)[: entry["k"]]
        index = order.sort().values
        return torch.cat([_raw(index.to(_index_dtype(flat.numel()))), _raw(flat[index])])

    def unpack(self, raw: Tensor, entry: Entry, numel: int, dtype: torch.dtype) -> Tensor:
        index_dtype = _index_dtype(numel)
        split = entry["k"] * index_dtype.itemsize
        index = raw[:split].clone().view(index_dtype).long()
        if len(index) and (index[0] < 0 or index[-1] >= numel or (index.diff() <= 0).any()):
            raise ValueError("topk indices out of range or not increasing")
        out = torch.zeros(numel, dtype=dtype)
        out[index] = raw[split:].clone().view(dtype)
        return out


# --- the compression: section --------------------------------------------------------------


def _codec_keys(keys: dict[str, Any]) -> tuple[type[Codec], dict[str, Any]]:
    """The codec class a ``compression.KIND`` mapping names, and its own keys (checked)."""
    name = keys.get("codec", "none")
    if not isinstance(name, str) or name not in CODECS:
        choices = ", ".join(repr(n) for n in CODECS.names())
        raise ConfigError("codec", f"must be one of {choices}, got {name!r}")
    cls = CODECS.get(name)
    own = {k: v for k, v in keys.items() if k != "codec"}
    unknown = sorted(set(own) - set(parameters(cls)))
    if unknown:
        valid = ", ".join(["codec", *parameters(cls)])
        raise ConfigError(unknown[0], f"unknown key for codec {name!r}; valid keys are: {valid}")
    return cls, bind(cls, own)


def resolve_section(options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Check the ``compression:`` section; return it with every listed kind's defaults."""
    out = {}
    for kind, keys in options.items():
        if kind not in KINDS:
            raise ConfigError(kind, f"unknown message kind; choose from {', '.join(KINDS)}")
        if not isinstance(keys, dict):
            raise ConfigError(kind, "must be a mapping such as {codec: int8}")
        try:
            cls, own = _codec_keys(keys)
            out[kind] = {"codec": cls.name} | asdict(cls(**own))
        except ConfigError as e:
            raise e.within(kind) from None
    return out


def from_section(section: dict[str, dict[str, Any]]) -> Compression:
    """The codecs of a resolved ``compression:`` section."""
    out = {}
    for kind, keys in section.items():
        cls, own = _codec_keys(keys)
        out[kind] = cls(**own)
    return out


def choose(compression: Compression | None, kind: str, codec: Codec | None) -> Compression | None:
    """The compression of one message of ``kind``: its own ``codec`` (a method's choice for
    that message) in place of the section's, or the section's."""
    return compression if codec is None else {kind: codec}


# --- what the wire calls ---------------------------------------------------------------------


def schema_entry(shape: torch.Size, dtype: torch.dtype, codec: Codec | None) -> Entry:
    """The schema fields that say how a tensor travels: empty when raw."""
    if codec is None or not dtype.is_floating_point:
        return {}
    numel = math.prod(shape)
    entry = {"codec": codec.name} | codec.fields(numel, dtype)
    return entry if codec.packed_size(entry, numel, dtype) < numel * dtype.itemsize else {}


@functools.cache
def _decoder(name: str) -> Codec:
    """The default instance of a codec: what reads a received entry."""
    return CODECS.get(name)()


def packed_size(entry: Entry, numel: int, dtype: torch.dtype) -> int:
    """Bytes a tensor with this schema entry takes in the frame."""
    return _decoder(entry["codec"]).packed_size(entry, numel, dtype)


def pack(t: Tensor, entry: Entry) -> Tensor:
    """``t`` packed as ``entry`` says, as flat uint8 bytes."""
    return _decoder(entry["codec"]).pack(t.detach().to("cpu").reshape(-1), entry)


def unpack(raw: Tensor, entry: Entry, shape: list[int], dtype: torch.dtype) -> Tensor:
    """The tensor of ``shape`` and ``dtype`` rebuilt from ``raw`` (flat uint8)."""
    return _decoder(entry["codec"]).unpack(raw, entry, math.prod(shape), dtype).reshape(shape)


def check_entry(entry: Entry, numel: int, dtype: torch.dtype) -> int:
    """Validate a received schema entry's codec fields; return its packed size."""
    name = entry.get("codec")
    if not isinstance(name, str) or name not in CODECS or not dtype.is_floating_point:
        raise ValueError(f"codec {name!r} for a {dtype} tensor")
    _decoder(name).check(entry, numel)
    return packed_size(entry, numel, dtype)


def _raw(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
