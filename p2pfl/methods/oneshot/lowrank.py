"""The 9-bit low-rank code of K-FAC factors and Grams (FedFisher, App. C; ``compress: true``).

A payload change, not a wire codec: each symmetric matrix is replaced by its truncated SVD of
rank r, whose U, σ and Vᵀ are each quantized to 9 bits (8 bits plus sign, one float32 scale
each; :func:`p2pfl.network.codecs.quantize`). A ``statistics`` message then holds all the
9-bit codes of an upload bit-packed into one uint8 stream ``codes``, and the three scales of
each matrix as ``NAME#scale``. The message tensors are the code itself, so the ledger counts
the bytes really sent.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from p2pfl.methods.effects import State
from p2pfl.network.codecs import dequantize, quantize

FACTOR_BITS = 9
"""Bits per quantized entry of U, σ and Vᵀ (8 bits plus sign, as in the paper)."""


def rank_for(model_size: int, dims: list[int]) -> int:
    """The paper's rank r = ⌊2d / Σ_f (2·dim_f + 1)⌋ over the matrices f sent.

    For K-FAC (A and G per layer) this is ⌊d / Σ_l (a_l + g_l + 1)⌋; for RegMean's Grams
    ⌊2d / Σ_l (2·b_l + 1)⌋: the factors then take about as many bits as half the model.
    """
    return max(1, (2 * model_size) // sum(2 * n + 1 for n in dims))


def entries(dim: int, rank: int) -> int:
    """Number of quantized entries for a dim × dim matrix at ``rank``: U, σ and Vᵀ."""
    k = min(dim, rank)
    return 2 * dim * k + k


def encode_matrix(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """9-bit codes of (U[:, :k], σ[:k], Vᵀ[:k]) flattened in that order, and their three
    scales (float32 [3])."""
    k = min(matrix.shape[0], rank)
    u, s, vh = torch.linalg.svd(matrix.double())
    parts = [quantize(part, FACTOR_BITS) for part in (u[:, :k], s[:k], vh[:k])]
    codes = torch.cat([c.reshape(-1) for c, _ in parts])
    return codes, torch.stack([scale for _, scale in parts])


def decode_matrix(codes: Tensor, scales: Tensor, dim: int, rank: int) -> Tensor:
    """The float32 matrix U·diag(σ)·Vᵀ from :func:`encode_matrix`'s codes."""
    k = min(dim, rank)
    u, s, vh = (
        dequantize(c, sc, FACTOR_BITS).double()
        for c, sc in zip(codes.split([dim * k, k, k * dim]), scales, strict=True)
    )
    return ((u.reshape(dim, k) * s) @ vh.reshape(k, dim)).float()


def encode(mats: dict[str, Tensor], rank: int) -> State:
    """All matrices as one 9-bit stream ``codes`` plus three scales per matrix."""
    codes, out = [], {}
    for name, m in mats.items():
        c, scales = encode_matrix(m, rank)
        codes.append(c)
        out[f"{name}#scale"] = scales
    return {"codes": pack_bits(torch.cat(codes), FACTOR_BITS)} | out


def decode(tensors: State, sides: list[tuple[str, int]], rank: int) -> dict[str, Tensor]:
    """The matrices (name, side) of a message made by :func:`encode`, in that order."""
    counts = [entries(side, rank) for _, side in sides]
    codes = unpack_bits(tensors["codes"], FACTOR_BITS, sum(counts)).split(counts)
    return {
        name: decode_matrix(c, tensors[f"{name}#scale"], side, rank)
        for (name, side), c in zip(sides, codes, strict=True)
    }


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
