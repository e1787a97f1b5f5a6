"""Wire compression: each codec's documented round-trip error, exact frame sizes, raw
pass-through of integer tensors, bad frames rejected, and the ``compression:`` section."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from conftest import experiment
from p2pfl.core.errors import ConfigError
from p2pfl.network.codecs import CODECS, FP16_MAX, Codec, TopK, from_section, topk_count
from p2pfl.network.message import Message
from p2pfl.network.wire import WireError, decode, encode, frame_sizes


def make(codec: str, fraction: float = 0.1) -> Codec:
    """A registered codec by name (top-k keeping ``fraction`` of the entries)."""
    return TopK(fraction) if codec == "topk" else CODECS.get(codec)()


def round_trip(t: torch.Tensor, codec: str, fraction: float = 0.1) -> torch.Tensor:
    frame = encode(Message("model", 0, 1, 1, {"x": t}), {"model": make(codec, fraction)})
    out = decode(frame).tensors["x"]
    assert out.dtype == t.dtype and out.shape == t.shape
    return out


def samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(300, 7, generator=g),
        torch.randn(1000, generator=g, dtype=torch.float64) * 1e3,
        torch.rand(50, generator=g) * 1e-6,  # half subnormals
        torch.zeros(20),
        torch.tensor([0.0, -1.0, 3.0, -3.0, 2.5, 1e-30]),
    ]


@pytest.mark.parametrize("t", samples(), ids=range(5))
def test_fp16_error_is_half_an_ulp(t):
    err = (round_trip(t, "fp16").double() - t.double()).abs()
    bound = torch.clamp(t.double().abs() * 2**-11, min=2**-25)
    assert (err <= bound).all()


def test_fp16_clamps_to_the_largest_half():
    t = torch.tensor([1e6, -1e6, 7.0, 0.0, 0.0])
    assert round_trip(t, "fp16").tolist() == [FP16_MAX, -FP16_MAX, 7.0, 0.0, 0.0]


@pytest.mark.parametrize("t", samples(), ids=range(5))
def test_int8_error_is_half_a_step(t):
    scale = t.double().abs().max()
    err = (round_trip(t, "int8").double() - t.double()).abs()
    float32_rounding = t.double().abs() * 2**-23
    assert (err <= scale / 254 + float32_rounding).all()


@pytest.mark.parametrize("t", samples(), ids=range(5))
def test_int16_error_is_half_a_step(t):
    scale = t.double().abs().max()
    err = (round_trip(t, "int16").double() - t.double()).abs()
    float32_rounding = t.double().abs() * 2**-23
    assert (err <= scale / 65534 + float32_rounding).all()


def test_int8_rejects_non_finite_values():
    with pytest.raises(ValueError, match="inf or NaN"):
        round_trip(torch.tensor([1.0, float("inf"), 2.0, 3.0, 4.0, 5.0]), "int8")


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.4])
@pytest.mark.parametrize("t", samples()[:3], ids=range(3))
def test_topk_keeps_the_largest_entries_exactly(t, fraction):
    out = round_trip(t, "topk", fraction).double().flatten()
    x = t.double().flatten()
    k = topk_count(x.numel(), fraction)
    kept = out != 0
    assert int(kept.sum()) <= k and torch.equal(out[kept], x[kept])
    kth = x.abs().sort(descending=True).values[k - 1]
    assert (x - out).abs().max() <= kth
    assert ((x - out) ** 2).sum() <= (1 - k / x.numel()) * (x**2).sum() + 1e-12


def test_a_codec_that_would_not_shrink_a_tensor_leaves_it_raw():
    t = torch.randn(100)
    assert torch.equal(round_trip(t, "topk", 0.5), t)  # 50·(4 + 4) bytes is not < 400
    msg = Message("model", 0, 1, 1, {"x": t})
    assert len(encode(msg, {"model": TopK(0.5)})) == len(encode(msg))


def test_topk_breaks_ties_by_the_lower_index():
    out = round_trip(torch.tensor([1.0, -2.0, 2.0, 2.0, 0.5, 0.0, 1.0, 1.0]), "topk", 0.25)
    assert out.tolist() == [0.0, -2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]


STATE = {
    "w": torch.randn(64, 16),
    "b": torch.randn(64, dtype=torch.float64),
    "bn.num_batches_tracked": torch.tensor(7),
    "labels": torch.tensor([True, False, True]),
    "codes": torch.arange(100, dtype=torch.int64),
    "one": torch.tensor([3.0]),
}


@pytest.mark.parametrize(
    ("codec", "floating_bytes"),
    [
        ("none", 4 * 1024 + 8 * 64 + 4),
        ("fp16", 2 * 1024 + 2 * 64 + 2),
        ("int8", (4 + 1024) + (4 + 64) + 4),  # "one" stays raw: 4 + 1 bytes is not < 4
        ("int16", (4 + 2 * 1024) + (4 + 2 * 64) + 4),
        ("topk", math.ceil(0.1 * 1024) * 8 + math.ceil(0.1 * 64) * 12 + 4),
    ],
)
def test_frame_sizes_are_exact_and_integer_tensors_travel_raw(codec, floating_bytes):
    msg = Message("model", 0, 1, 1, STATE)
    compression = {"model": make(codec)}
    frame = encode(msg, compression)
    head, body = frame_sizes(msg, compression)
    assert head + body == len(frame)
    assert body == floating_bytes + 8 + 3 + 8 * 100  # counter, mask and codes stay raw
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in STATE.items()}
    assert frame_sizes(Message("model", 5, 6, 7, meta), compression) == (head, body)
    got = decode(frame).tensors
    for name in ("bn.num_batches_tracked", "labels", "codes"):
        assert torch.equal(got[name], STATE[name])


def test_codecs_apply_only_to_their_kind():
    compression = {"statistics": make("int8")}
    model = Message("model", 0, 1, 1, STATE)
    assert len(encode(model, compression)) == len(encode(model))
    stats = Message("statistics", 0, 1, 1, STATE)
    assert len(encode(stats, compression)) < len(encode(stats))


def corrupt_entry(frame: bytearray, old: bytes, new: bytes) -> bytes:
    """Replace text in the schema (same length, so the prefix stays valid)."""
    assert len(old) == len(new)
    return bytes(frame).replace(old, new, 1)


def test_bad_codec_entries_are_rejected():
    t = {"x": torch.randn(100)}
    topk = encode(Message("model", 0, 1, 1, t), {"model": make("topk")})
    int8 = encode(Message("model", 0, 1, 1, t), {"model": make("int8")})
    cases = {
        "codec 'int9'": corrupt_entry(int8, b'"int8"', b'"int9"'),
        "topk count": corrupt_entry(topk, b'"k":10', b'"k":-1'),
    }
    for reason, frame in cases.items():
        with pytest.raises(WireError, match=reason):
            decode(frame)
    schema_end = len(topk) - 10 * 8
    bad_index = bytearray(topk)
    bad_index[schema_end : schema_end + 4] = (1000).to_bytes(4, "little")
    with pytest.raises(WireError):
        decode(bad_index)


def test_the_compression_section_is_checked():
    config = experiment(
        compression={"model": {"codec": "int8"}, "statistics": {"codec": "topk"}}
    ).config
    assert config["compression"] == {
        "model": {"codec": "int8"},
        "statistics": {"codec": "topk", "fraction": 0.01},
    }
    assert experiment().config["compression"] == {}
    bad = [
        ({"modle": {"codec": "int8"}}, "compression.modle", "unknown message kind"),
        ({"model": {"codec": "int4"}}, "compression.model.codec", "must be one of"),
        ({"model": {"codec": "topk", "fraction": 0}}, "compression.model.fraction", "(0, 1]"),
        ({"model": "int8"}, "compression.model", "must be a mapping"),
        ({"model": {"codec": "int8", "fraction": 0.1}}, "compression.model.fraction", "unknown"),
    ]
    for section, key, message in bad:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
            experiment(compression=section)
        assert e.value.key == key


@dataclass(frozen=True)
class Halves(Codec):
    """A plug-in codec with a key of its own: every value times ``factor`` as float16."""

    name = "test_halves"

    factor: float = 0.5

    def fields(self, numel: int, dtype: torch.dtype) -> dict:
        return {"factor": self.factor}

    def packed_size(self, entry: dict, numel: int, dtype: torch.dtype) -> int:
        return 2 * numel

    def pack(self, flat: torch.Tensor, entry: dict) -> torch.Tensor:
        return (flat * entry["factor"]).to(torch.float16).view(torch.uint8)

    def unpack(self, raw: torch.Tensor, entry: dict, numel: int, dtype) -> torch.Tensor:
        return raw.clone().view(torch.float16).to(dtype)


@pytest.fixture
def halves(monkeypatch: pytest.MonkeyPatch) -> None:
    """``test_halves`` registered for this test only (the docs' reference test lists every
    registered codec's keys, each with a description)."""
    monkeypatch.setitem(CODECS._items, "test_halves", Halves)


def test_a_registered_codec_is_named_in_the_section_with_its_own_keys(halves):
    config = experiment(compression={"model": {"codec": "test_halves", "factor": 0.25}}).config
    assert config["compression"] == {"model": {"codec": "test_halves", "factor": 0.25}}
    compression = from_section(config["compression"])
    t = torch.tensor([4.0, -8.0, 1.0])
    frame = encode(Message("model", 0, 1, 1, {"x": t}), compression)
    assert decode(frame).tensors["x"].tolist() == [1.0, -2.0, 0.25]  # the receiver's entry
    with pytest.raises(ConfigError, match="valid keys are: codec, factor") as e:
        experiment(compression={"model": {"codec": "test_halves", "fraction": 0.1}})
    assert e.value.key == "compression.model.fraction"
