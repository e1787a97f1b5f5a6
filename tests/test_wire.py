"""The wire format: exact round trips, fixed overhead, and clear rejection of bad frames."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from crc32c import crc32c

from p2pfl.network.message import Message
from p2pfl.network.wire import DTYPES, WireError, decode, encode, encode_parts


def sample() -> Message:
    tensors = {name: (torch.arange(6) % 2).to(dt).reshape(2, 3) for name, dt in DTYPES.items()}
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros(0, 4)
    return Message("statistics", 3, 7, 12, tensors, {"num_samples": 140, "tag": "x"})


def test_round_trip_is_exact_for_every_dtype():
    msg = sample()
    got = decode(encode(msg))
    assert (got.kind, got.src, got.dst, got.round, got.meta) == ("statistics", 3, 7, 12, msg.meta)
    assert list(got.tensors) == list(msg.tensors)
    for name, t in msg.tensors.items():
        assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t)


def test_decoded_tensors_are_writable_copies():
    t = torch.ones(4)
    got = decode(encode(Message("model", 0, 1, 1, {"w": t})))
    got.tensors["w"].add_(1)
    assert torch.equal(t, torch.ones(4))


def test_frame_size_does_not_depend_on_sender_receiver_or_round():
    state = {"w": torch.randn(10, 10), "b": torch.zeros(10)}
    sizes = {
        len(encode(Message("model", s, d, r, state))) for s, d, r in [(0, 1, 1), (9, 10, 99999)]
    }
    assert len(sizes) == 1
    assert sizes.pop() == 400 + 40 + len(encode(Message("model", 0, 1, 1, {}))) + len(
        '{"dtype":"float32","name":"w","shape":[10,10]},{"dtype":"float32","name":"b","shape":[10]}'
    )


def corrupt(frame: bytes, at: int, value: bytes) -> bytes:
    return frame[:at] + value + frame[at + len(value) :]


def test_bad_frames_are_rejected_with_a_reason():
    frame = encode(sample())
    cases = {
        "shorter than": frame[:10],
        "bad magic": corrupt(frame, 0, b"XXXX"),
        "version": corrupt(frame, 4, b"\x09"),
        "kind code": corrupt(frame, 5, b"\x07"),
        "schema length": corrupt(frame, 24, struct.pack("<I", 1 << 30)),
        "checksum": frame[:-1] + bytes([frame[-1] ^ 1]),
        "exceeds the limit": frame,
    }
    for reason, bad in cases.items():
        with pytest.raises(WireError, match=reason):
            decode(bad, max_bytes=len(frame) - 1 if reason == "exceeds the limit" else 1 << 32)


def handmade(schema: bytes, payload: bytes = b"") -> bytes:
    prefix = struct.pack("<4sBBHiiiII", b"P2PF", 1, 0, 0, 0, 1, 1, crc32c(payload), len(schema))
    return prefix + schema + payload


@pytest.mark.parametrize(
    "schema,reason",
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"meta": [], "tensors": []}', "must be an object and a list"),
        (b'{"meta": {}, "tensors": [{"name": "w", "dtype": "object", "shape": [1]}]}', "dtype"),
        (b'{"meta": {}, "tensors": [{"name": "w", "dtype": "float32", "shape": [-1]}]}', "shape"),
        (
            b'{"meta": {}, "tensors": [{"name": "w", "dtype": "float32", "shape": [9]}]}',
            "do not add up",
        ),
        (b'{"meta": {}, "tensors": [{"dtype": "float32", "shape": [0]}]}', "without a name"),
        (
            b'{"meta": {}, "tensors": [{"name": "w", "dtype": "float32", "shape": [1]}]}',
            "do not add up",
        ),
    ],
)
def test_hostile_schemas_are_rejected(schema, reason):
    with pytest.raises(WireError, match=reason):
        decode(handmade(schema, b"\x00" * 8))


def entry(**fields) -> bytes:
    tensor = {"name": "w", "dtype": "float32"} | fields
    return json.dumps({"meta": {}, "tensors": [tensor]}).encode()


@pytest.mark.parametrize(
    "schema,reason",
    [
        (b'{"meta": ' + b"[" * 100_000 + b"]" * 100_000 + b', "tensors": []}', "not JSON"),
        (b'{"meta": {}, "tensors": [{"name": "w", "shape": [' + b"9" * 5000 + b"]}]}", "not JSON"),
        (entry(shape=[2**64, 0]), "bad shape"),  # no bytes, but no tensor either
        (entry(shape=[2**20, 2**20], codec="topk", k=0), "once decoded exceed the limit"),
    ],
)
def test_a_hostile_schema_is_a_wire_error_and_allocates_nothing(schema, reason):
    """Whatever the schema holds, decoding raises WireError (a receiver drops the frame and
    goes on): not a RecursionError, a ValueError or an overflow; and a few packed bytes
    (top-k keeping none of 2**40 entries) never stand for more than ``max_bytes`` decoded."""
    with pytest.raises(WireError, match=reason):
        decode(handmade(schema), max_bytes=1 << 30)


def test_multipart_frames_decode_without_copying_aligned_parts():
    msg = sample()
    parts = [bytes(p) for p in encode_parts(msg)]  # read-only, as a socket delivers them
    got = decode(parts)
    for name, t in msg.tensors.items():
        assert torch.equal(got.tensors[name], t)
    first = list(msg.tensors).index("float32")
    address = np.frombuffer(parts[1 + first], dtype=np.uint8).ctypes.data
    assert got.tensors["float32"].data_ptr() == address  # a view of the received part
    split = [parts[0] + parts[1][:3], parts[1][3:], *parts[2:]]  # any other split: joined
    assert torch.equal(decode(split).tensors["int64"], msg.tensors["int64"])
    with pytest.raises(WireError, match="checksum"):
        decode([parts[0], parts[1][:-1] + b"x", *parts[2:]])


def test_encode_refuses_unknown_kinds_and_dtypes():
    with pytest.raises(ValueError):
        encode(Message("gossip", 0, 1, 1, {}))
    with pytest.raises(ValueError):
        encode(Message("model", 0, 1, 1, {"c": torch.zeros(2, dtype=torch.complex64)}))
