"""Lossy codecs for what one-shot methods upload (FedFisher spec §1, App. C of the paper).

- :func:`quantize` / :func:`dequantize`: symmetric max-abs quantization of a tensor to
  ``bits`` bits (sign included): codes round((2^(bits−1) − 1)·t / max|t|) and one float32
  scale. 16-bit codes are what models and diagonal Fishers travel as.
- :func:`lowrank_encode` / :func:`lowrank_decode`: a symmetric matrix as a truncated SVD of
  rank r whose U, σ and V^T are each quantized to 9 bits (8 bits plus sign, one scale each),
  bit-packed into one uint8 stream. This is the compressed form of K-FAC factors and Grams.

The message tensors hold exactly the codes (int16 as its raw bytes, since the wire has no
int16 type; 9-bit codes packed), so the ledger counts the bytes really sent.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

FACTOR_BITS = 9
"""Bits per quantized entry of U, σ and V^T (8 bits plus sign, as in the paper)."""


def quantize(t: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Codes (int16 for ``bits`` ≤ 16) and the float32 scale max|t| of ``t``."""
    levels = 2 ** (bits - 1) - 1
    scale = t.abs().max().float() if t.numel() else torch.tensor(0.0)
    if scale == 0:
        return torch.zeros(t.shape, dtype=torch.int16), scale
    codes = torch.round(t.double() * (levels / scale.double()))
    return codes.to(torch.int16), scale


def dequantize(codes: Tensor, scale: Tensor, bits: int) -> Tensor:
    """float32 values scale·codes / (2^(bits−1) − 1)."""
    levels = 2 ** (bits - 1) - 1
    return (codes.double() * (scale.double() / levels)).float()


def int16_bytes(codes: Tensor) -> Tensor:
    """int16 codes as their raw bytes (flat uint8), for the wire."""
    return codes.reshape(-1).view(torch.uint8)


def int16_from_bytes(raw: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    return raw.view(torch.int16).reshape(shape)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Signed codes in [−(2^(bits−1) − 1), 2^(bits−1) − 1] as a uint8 stream of
    ⌈bits·n / 8⌉ bytes (offset to unsigned, least significant bit first)."""
    offset = 2 ** (bits - 1) - 1
    values = (codes.reshape(-1).to(torch.int64) + offset).numpy().astype(np.uint32)
    planes = (values[:, None] >> np.arange(bits, dtype=np.uint32)) & 1
    return torch.from_numpy(np.packbits(planes.astype(np.uint8).reshape(-1), bitorder="little"))


def unpack_bits(stream: Tensor, bits: int, count: int) -> Tensor:
    """The first ``count`` signed codes of a stream made by :func:`pack_bits` (int64)."""
    offset = 2 ** (bits - 1) - 1
    planes = np.unpackbits(stream.numpy(), count=bits * count, bitorder="little")
    values = planes.reshape(count, bits).astype(np.int64) @ (1 << np.arange(bits))
    return torch.from_numpy(values - offset)


def lowrank_rank(model_size: int, dims: list[int]) -> int:
    """The paper's rank r = ⌊2d / Σ_f (2·dim_f + 1)⌋ over the matrices f sent.

    For K-FAC (A and G per layer) this is ⌊d / Σ_l (a_l + g_l + 1)⌋; for RegMean's Grams
    ⌊2d / Σ_l (2·b_l + 1)⌋: the factors then take about as many bits as half the model.
    """
    return max(1, (2 * model_size) // sum(2 * n + 1 for n in dims))


def lowrank_count(dim: int, rank: int) -> int:
    """Number of quantized entries for a dim × dim matrix at ``rank``: U, σ and V^T."""
    k = min(dim, rank)
    return 2 * dim * k + k


def lowrank_encode(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """9-bit codes of (U[:, :k], σ[:k], V^T[:k]) flattened in that order, and their three
    scales (float32 [3])."""
    k = min(matrix.shape[0], rank)
    u, s, vh = torch.linalg.svd(matrix.double())
    parts = [quantize(part, FACTOR_BITS) for part in (u[:, :k], s[:k], vh[:k])]
    codes = torch.cat([c.reshape(-1) for c, _ in parts])
    return codes, torch.stack([scale for _, scale in parts])


def lowrank_decode(codes: Tensor, scales: Tensor, dim: int, rank: int) -> Tensor:
    """The float32 matrix U·diag(σ)·V^T from :func:`lowrank_encode`'s codes."""
    k = min(dim, rank)
    u, s, vh = (
        dequantize(c, sc, FACTOR_BITS).double()
        for c, sc in zip(codes.split([dim * k, k, k * dim]), scales, strict=True)
    )
    return ((u.reshape(dim, k) * s) @ vh.reshape(k, dim)).float()


def packed_bytes(count: int, bits: int = FACTOR_BITS) -> int:
    return math.ceil(bits * count / 8)
