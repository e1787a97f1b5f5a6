"""In-process delivery (the simulation's choke point) gives what a frame would decode to."""

from __future__ import annotations

import pytest
import torch

from p2pfl.network.codecs import Int8, TopK
from p2pfl.network.message import Message
from p2pfl.network.wire import decode, deliver, encode


def messages() -> list[Message]:
    g = torch.Generator().manual_seed(0)
    return [
        Message("model", 0, 1, 3, {"w": torch.randn(20, 7, generator=g), "b": torch.zeros(7)}),
        Message(
            "statistics", 2, 0, 1,
            {
                "t": torch.randn(6, 4, generator=g).T,  # not contiguous
                "d": torch.randn(5, generator=g, dtype=torch.float64),
                "h": torch.randn(3, generator=g).to(torch.bfloat16),
                "n": torch.tensor(7),  # no dimensions
                "i": torch.arange(4),
                "m": torch.tensor([True, False]),
                "e": torch.empty(0, 3),
                "p": torch.nn.Parameter(torch.ones(2)),
            },
        ),
        Message("control", 1, 0, 2, {}, {"z": 1, "a": [1, 2.5, "x"], "stop": True, "t": (1, 2)}),
    ]  # fmt: skip


@pytest.mark.parametrize("compression", [None, {"model": Int8()}, {"statistics": TopK(0.5)}])
@pytest.mark.parametrize("msg", messages(), ids=["model", "statistics", "control"])
def test_delivery_equals_decoding_the_frame(msg, compression):
    frame = encode(msg, compression)
    expected = decode(frame)
    got, size = deliver(msg, compression)
    assert size == len(frame)
    assert (got.kind, got.src, got.dst, got.round) == (msg.kind, msg.src, msg.dst, msg.round)
    assert list(got.meta.items()) == list(expected.meta.items())  # values, types and order
    assert list(got.tensors) == list(expected.tensors)
    for name, t in expected.tensors.items():
        out = got.tensors[name]
        assert out.dtype == t.dtype and out.shape == t.shape and out.is_contiguous()
        assert not out.requires_grad and out.device.type == "cpu"
        assert torch.equal(out, t)


def test_delivered_tensors_are_the_receivers_own():
    source = torch.zeros(3)
    got, _ = deliver(Message("model", 0, 1, 1, {"x": source}))
    source += 1
    assert torch.equal(got.tensors["x"], torch.zeros(3))
