"""What crosses the network: a message of named tensors plus a small header.

Frame layout (all integers little-endian)::

    fixed prefix: b"P2PF" | u8 version | u8 kind | u16 0 | i32 src | i32 dst | i32 round
                  | u32 CRC-32C of the tensor bytes | u32 schema length
    schema (UTF-8 JSON): {"meta": {...}, "tensors": [{name, dtype, shape[, codec, k]}, ...]}
    tensor bytes, back to back

A tensor entry names the tensor's own dtype and shape. With ``codec`` (a registered codec's
name, plus its fields, e.g. top-k's count ``k``) its bytes are the codec's packing
(:mod:`p2pfl.network.codecs`), chosen per message kind by ``encode``'s ``compression``;
decoding restores dtype and shape.

The fields that change from message to message (sender, receiver, round, checksum) have
fixed widths, so two messages with the same tensors and meta have exactly the same size:
the ledger's arithmetic (e.g. 2·K·M bytes per FedAvg round) holds to the byte.
Nothing is pickled: decoding only parses JSON and reinterprets raw bytes as tensors, after
checking every length, dtype and shape against hard limits.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import warnings
from collections.abc import Iterator, Sequence

import torch
from crc32c import crc32c

from p2pfl.core.tensors import lazy_clone
from p2pfl.network import codecs as codec
from p2pfl.network.codecs import Compression
from p2pfl.network.message import KINDS, Message

MAGIC = b"P2PF"
VERSION = 1
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
_MAX_DIM = 1 << 48  # a dimension torch can hold (one beside a 0 leaves the tensor empty)

Buffer = bytes | bytearray | memoryview


class WireError(ValueError):
    """A frame that is not a valid p2pfl message (the reason says why)."""


def _layout(msg: Message, compression: Compression | None) -> tuple[bytes, tuple[dict, ...]]:
    """The schema's bytes, and each tensor's codec fields (empty: it travels raw).

    The bytes are ``json.dumps({"meta": ..., "tensors": [...]}, sort_keys=True)`` in
    compact form; the tensors' part is cached per tensor signature, since a run sends the
    same shapes again and again."""
    meta, entries, packing, _ = _parts(msg, compression)
    return f'{{"meta":{meta},"tensors":{entries}}}'.encode(), packing


_HEAD_CHARS = len('{"meta":,"tensors":}')  # the schema around its meta and tensor list


def _parts(msg: Message, compression: Compression | None) -> tuple[str, str, tuple[dict, ...], int]:
    """The schema's meta and tensor list as compact JSON (ASCII: one byte per character),
    each tensor's codec fields, and the raw tensors' bytes (-1 when a codec packs one)."""
    if msg.kind not in KINDS:
        raise ValueError(f"unknown message kind {msg.kind!r}")
    chosen = (compression or {}).get(msg.kind)
    signature = tuple((name, t.dtype, t.shape) for name, t in msg.tensors.items())
    entries, packing, raw_bytes = _entries(signature, chosen)
    meta = json.dumps(msg.meta, separators=(",", ":"), sort_keys=True) if msg.meta else "{}"
    return meta, entries, packing, raw_bytes


@functools.lru_cache(maxsize=1024)
def _entries(
    signature: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...], chosen: codec.Codec | None
) -> tuple[str, tuple[dict, ...], int]:
    """The schema's tensor list as compact, key-sorted JSON, each tensor's codec fields
    (shared between calls: read them, never change them), and the tensors' bytes if all
    travel raw (else -1)."""
    entries, packing = [], []
    for name, dtype, shape in signature:
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {dtype}")
        how = codec.schema_entry(torch.Size(shape), dtype, chosen)
        entries.append({"name": name, "dtype": _NAMES[dtype], "shape": list(shape)} | how)
        packing.append(how)
    raw = -1 if any(packing) else sum(math.prod(shape) * d.itemsize for _, d, shape in signature)
    return json.dumps(entries, separators=(",", ":"), sort_keys=True), tuple(packing), raw


def frame_sizes(msg: Message, compression: Compression | None = None) -> tuple[int, int]:
    """(header bytes, tensor bytes) of ``msg``'s frame, without building it: only shapes
    and dtypes are read, so tensors on the ``meta`` device will do."""
    head, packing = _layout(msg, compression)
    tensor_bytes = sum(
        codec.packed_size(how, t.numel(), t.dtype) if how else t.numel() * t.element_size()
        for t, how in zip(msg.tensors.values(), packing, strict=True)
    )
    return _PREFIX.size + len(head), tensor_bytes


def _spec(e: object, i: int) -> tuple[str, torch.dtype, list[int], int, dict]:
    """Check one schema entry: (name, dtype, shape, bytes on the wire, entry)."""
    if not isinstance(e, dict) or not isinstance(e.get("name"), str):
        raise WireError(f"tensor entry {i} without a name")
    name, raw, shape = e["name"], e.get("dtype"), e.get("shape")
    dtype = DTYPES.get(raw) if isinstance(raw, str) else None
    if dtype is None:
        raise WireError(f"tensor {name!r}: unsupported dtype {raw!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > 8
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _MAX_DIM for d in shape
        )
    ):
        raise WireError(f"tensor {name!r}: bad shape {shape!r}")
    nbytes = math.prod(shape) * dtype.itemsize
    if "codec" in e:
        try:
            nbytes = codec.check_entry(e, math.prod(shape), dtype)
        except ValueError as err:
            raise WireError(f"tensor {name!r}: {err}") from None
    return name, dtype, shape, nbytes, e


def _slices(buf: memoryview, specs: list) -> Iterator[memoryview]:
    """Consecutive slices of ``buf``, one per tensor with bytes."""
    offset = 0
    for *_, nbytes, _ in specs:
        if nbytes:
            yield buf[offset : offset + nbytes]
            offset += nbytes


def _bytes_tensor(buf: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``buf`` without a copy. A read-only buffer here is a received
    socket frame that this message alone owns, so writing to it is safe. (Only such a
    buffer needs the warning silenced: ``catch_warnings`` costs more than the view.)"""
    if not buf.readonly:
        return torch.frombuffer(buf, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8)


def encode_parts(msg: Message, compression: Compression | None = None) -> list[memoryview]:
    """``msg``'s frame as buffers: the prefix and schema, then each tensor's bytes.

    The tensor buffers are views of the tensors (no copy), so a socket can send them as
    one multipart message with zero copies. ``compression`` maps message kinds to codecs;
    the floating tensors of a listed kind are packed by its codec (see :mod:`p2pfl.network.codecs`).
    """
    head, packing = _layout(msg, compression)
    arrays = [
        (codec.pack(t, how) if how else t.detach().to("cpu").contiguous().reshape(-1))
        .view(torch.uint8)
        .numpy()
        .data  # a memoryview of the tensor's bytes
        for t, how in zip(msg.tensors.values(), packing, strict=True)
    ]
    crc = 0
    for a in arrays:
        crc = crc32c(a, crc)
    kind = KINDS.index(msg.kind)
    prefix = _PREFIX.pack(MAGIC, VERSION, kind, 0, msg.src, msg.dst, msg.round, crc, len(head))
    return [memoryview(prefix + head), *(a for a in arrays if a.nbytes)]


def join(parts: list[memoryview]) -> bytearray:
    """The parts of a frame copied into one buffer (one pass, no zero-fill)."""
    return bytearray().join(parts)


def encode(msg: Message, compression: Compression | None = None) -> bytearray:
    """Serialize ``msg`` to one frame; each tensor's bytes are copied once, into the frame."""
    return join(encode_parts(msg, compression))


def decode(frame: Buffer | Sequence[Buffer], max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Parse and check one frame; raise :class:`WireError` with the reason if it is bad
    (``max_bytes`` bounds the frame and its tensors once decoded).

    ``frame`` is one buffer, or the parts of a multipart message as ``encode_parts`` makes
    them. Tensors are never copied twice: they view a ``bytearray`` frame (which decode
    takes over) or, when each received part is exactly one tensor's bytes, those parts;
    any other buffer or split is copied once into a fresh buffer.
    """
    if isinstance(frame, bytes | bytearray | memoryview):
        frame = [frame]
    parts = [memoryview(p).cast("B") for p in frame]
    size = sum(p.nbytes for p in parts)
    if size > max_bytes:
        raise WireError(f"frame of {size} bytes exceeds the limit of {max_bytes}")
    head = parts[0]
    if len(head) < _PREFIX.size:
        raise WireError("frame shorter than its fixed prefix")
    magic, version, kind, _, src, dst, rnd, crc, head_len = _PREFIX.unpack_from(head)
    if magic != MAGIC:
        raise WireError("bad magic bytes")
    if version != VERSION:
        raise WireError(f"unsupported version {version}")
    if kind >= len(KINDS):
        raise WireError(f"unknown kind code {kind}")
    if head_len > MAX_SCHEMA_BYTES or _PREFIX.size + head_len > len(head):
        raise WireError("schema length out of range")
    try:
        schema = json.loads(bytes(head[_PREFIX.size : _PREFIX.size + head_len]))
    except (
        ValueError,
        RecursionError,
    ) as e:  # bad UTF-8 or JSON, a 5,000-digit number, deep nesting
        raise WireError(f"schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise WireError("schema is not a JSON object")
    meta = schema.get("meta")
    entries = schema.get("tensors")
    if not isinstance(meta, dict) or not isinstance(entries, list):
        raise WireError("schema fields 'meta' and 'tensors' must be an object and a list")
    payload = [head[_PREFIX.size + head_len :], *parts[1:]]
    check = 0
    for p in payload:
        check = crc32c(p, check)
    if check != crc:
        raise WireError("checksum mismatch")
    specs = [_spec(e, i) for i, e in enumerate(entries)]
    if len({name for name, *_ in specs}) != len(specs):
        raise WireError("a tensor name appears twice")
    decoded = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape, _, _ in specs)
    if decoded > max_bytes:  # a codec's few bytes (top-k with k = 0) may stand for many
        raise WireError(f"tensors of {decoded} bytes once decoded exceed the limit of {max_bytes}")
    for name, dtype, shape, _, _ in specs:  # an empty tensor's other sides too: [0, 2**47]
        if math.prod(d or 1 for d in shape) * dtype.itemsize > max_bytes:
            raise WireError(f"tensor {name!r}: shape {shape} exceeds the limit of {max_bytes}")
    if sum(n for *_, n, _ in specs) != sum(p.nbytes for p in payload):
        raise WireError("tensor sizes do not add up to the frame's payload")
    received = [p for p in payload if p.nbytes]
    if len(parts) > 1 and [p.nbytes for p in received] == [n for *_, n, _ in specs if n]:
        buffers = iter(received)  # one part per tensor: view the parts themselves
    elif len(parts) == 1 and isinstance(frame, bytearray):
        buffers = _slices(payload[0], specs)  # the frame is ours: view it
    else:
        buffers = _slices(memoryview(join(payload)), specs)
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, nbytes, entry in specs:
        flat = _bytes_tensor(next(buffers)) if nbytes else torch.empty(0, dtype=torch.uint8)
        if "codec" in entry:
            try:
                tensors[name] = codec.unpack(flat, entry, shape, dtype)
            except ValueError as err:
                raise WireError(f"tensor {name!r}: {err}") from None
        else:
            tensors[name] = flat.view(dtype).reshape(shape)
    return Message(KINDS[kind], src, dst, rnd, tensors, meta)


def deliver(msg: Message, compression: Compression | None = None) -> tuple[Message, int]:
    """What the receiver of ``msg`` decodes, and the size of its frame, for a delivery
    within one process (the simulation).

    When every tensor travels raw, the receiver would decode exact, contiguous CPU copies
    of them and the meta as the frame's JSON gives it back: those are made directly,
    without building the frame, whose size comes from its layout, to the byte. A message
    that a codec packs goes through :func:`encode` and :func:`decode`, so the receiver
    sees the codec's loss.
    """
    meta, entries, _, raw_bytes = _parts(msg, compression)
    if raw_bytes < 0:
        frame = encode(msg, compression)
        return decode(frame), len(frame)
    tensors = {name: _private_copy(t) for name, t in msg.tensors.items()}
    size = _PREFIX.size + _HEAD_CHARS + len(meta) + len(entries) + raw_bytes
    received = json.loads(meta) if msg.meta else {}
    return Message(msg.kind, msg.src, msg.dst, msg.round, tensors, received), size


def _private_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` that shares nothing with it (``clone`` when ``t`` is
    already one, outside autograd: a third of the cost of the general ``to``).

    Where ``t`` is a whole CPU storage, the copy is copy-on-write (:func:`lazy_clone`), so
    a message that waits in an inbox costs no second model (issue 38: 10⁴ peers each
    holding messages). A ``meta`` tensor (a sharded run's ghost: no bytes to copy) is
    itself."""
    if t.is_meta:
        return t
    if t.is_cpu and not t.requires_grad and t.is_contiguous():
        return lazy_clone(t)
    return t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
