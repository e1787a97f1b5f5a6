"""What crosses the network: a message of named tensors plus a small header.

Frame layout (all integers little-endian)::

    fixed prefix: b"P2PF" | u8 version | u8 kind | u16 0 | i32 src | i32 dst | i32 round
                  | u32 CRC-32 of the tensor bytes | u32 schema length
    schema (UTF-8 JSON): {"meta": {...}, "tensors": [{name, dtype, shape}, ...]}
    tensor bytes, back to back

The fields that change from message to message (sender, receiver, round, checksum) have
fixed widths, so two messages with the same tensors and meta have exactly the same size:
the ledger's arithmetic (e.g. 2·K·M bytes per FedAvg round) holds to the byte.
Nothing is pickled: decoding only parses JSON and reinterprets raw bytes as tensors, after
checking every length, dtype and shape against hard limits.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

MAGIC = b"P2PF"
VERSION = 1
KINDS = ("model", "statistics", "control")
MAX_SCHEMA_BYTES = 1 << 20
MAX_FRAME_BYTES = 1 << 32
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_PREFIX = struct.Struct("<4sBBHiiiII")

Meta = dict[str, Any]


@dataclass
class Message:
    """One message: ``kind`` is model, statistics or control; ``tensors`` maps names to tensors."""

    kind: str
    src: int
    dst: int
    round: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: Meta = field(default_factory=dict)


class WireError(ValueError):
    """A frame that is not a valid p2pfl message (the reason says why)."""


def encode(msg: Message) -> bytearray:
    """Serialize ``msg`` to one frame; each tensor's bytes are copied once, into the frame."""
    if msg.kind not in KINDS:
        raise ValueError(f"unknown message kind {msg.kind!r}")
    entries, arrays = [], []
    for name, t in msg.tensors.items():
        if t.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        entries.append({"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape)})
        arrays.append(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    schema = {"meta": msg.meta, "tensors": entries}
    head = json.dumps(schema, separators=(",", ":"), sort_keys=True).encode()
    start = _PREFIX.size + len(head)
    frame = bytearray(start + sum(a.nbytes for a in arrays))
    frame[_PREFIX.size : start] = head
    out, crc, offset = memoryview(frame), 0, start
    for a in arrays:
        out[offset : offset + a.nbytes] = a
        crc = zlib.crc32(a, crc)
        offset += a.nbytes
    kind = KINDS.index(msg.kind)
    _PREFIX.pack_into(
        frame, 0, MAGIC, VERSION, kind, 0, msg.src, msg.dst, msg.round, crc, len(head)
    )
    return frame


def decode(frame: bytes | bytearray | memoryview, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Parse and check one frame; raise :class:`WireError` with the reason if it is bad.

    A ``bytearray`` frame is taken over: the tensors view into it without a copy. Any other
    buffer (``bytes``, a socket's read-only memoryview) is copied once.
    """
    view = memoryview(frame)
    if len(view) > max_bytes:
        raise WireError(f"frame of {len(view)} bytes exceeds the limit of {max_bytes}")
    if len(view) < _PREFIX.size:
        raise WireError("frame shorter than its fixed prefix")
    magic, version, kind, _, src, dst, rnd, crc, head_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError("bad magic bytes")
    if version != VERSION:
        raise WireError(f"unsupported version {version}")
    if kind >= len(KINDS):
        raise WireError(f"unknown kind code {kind}")
    if head_len > MAX_SCHEMA_BYTES or _PREFIX.size + head_len > len(view):
        raise WireError("schema length out of range")
    try:
        schema = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + head_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise WireError("schema is not a JSON object")
    meta = schema.get("meta")
    entries = schema.get("tensors")
    if not isinstance(meta, dict) or not isinstance(entries, list):
        raise WireError("schema fields 'meta' and 'tensors' must be an object and a list")
    payload = view[_PREFIX.size + head_len :]
    if zlib.crc32(payload) != crc:
        raise WireError("checksum mismatch")
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    buf = payload if isinstance(frame, bytearray) else memoryview(bytearray(payload))
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise WireError("tensor entry without a name")
        name, dtype, shape = e["name"], DTYPES.get(e.get("dtype")), e.get("shape")
        if dtype is None:
            raise WireError(f"tensor {name!r}: unsupported dtype {e.get('dtype')!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > 8
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise WireError(f"tensor {name!r}: bad shape {shape!r}")
        if name in tensors:
            raise WireError(f"tensor {name!r} appears twice")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > len(buf):
            raise WireError(f"tensor {name!r} runs past the end of the frame")
        flat = (
            torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        tensors[name] = flat.view(dtype).reshape(shape)
        offset += nbytes
    if offset != len(buf):
        raise WireError(f"{len(buf) - offset} trailing bytes after the last tensor")
    return Message(KINDS[kind], src, dst, rnd, tensors, meta)
