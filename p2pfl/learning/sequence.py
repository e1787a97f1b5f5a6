"""Sequence models for token data (``dataset: shakespeare``): LEAF's character LSTM and a
small causal transformer, registered in :data:`p2pfl.learning.models.MODELS`.

Both take int64 token windows ``[n, seq_len]`` (their class attribute ``input_dtype`` says
so: :func:`p2pfl.learning.models.model_builder` refuses them on float images or signals,
and image models on tokens) and predict the next token from the last position. Neither has
buffers or dropout, so a state is parameters only and training is deterministic; each layer
that does work besides its ``nn.Linear`` children reports it through a ``flops(inputs,
output)`` method, which :func:`p2pfl.learning.models.forward_flops` adds up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2pfl.core.errors import ConfigError
from p2pfl.learning.models import MODELS, InputShape, token_model


def _check(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(key, f"must be >= 1, got {value}")


def _seq_len(input_shape: InputShape, name: str) -> int:
    """The window length of token inputs ``(seq_len,)``."""
    if len(input_shape) != 1:
        raise ConfigError(
            "name", f"{name} takes token windows [seq_len], got input shape {input_shape}"
        )
    return input_shape[0]


class FlopLSTM(nn.LSTM):
    """``nn.LSTM`` (batch first) that counts its forward FLOPs: per position and layer, the
    four gates' products with the input and the hidden state, 2·4·h·(in + h)."""

    def flops(self, inputs: tuple[Tensor, ...], output: tuple[Tensor, ...]) -> int:
        n, length = inputs[0].shape[:2]
        h, total, width = self.hidden_size, 0, self.input_size
        for _ in range(self.num_layers):
            total += 2 * 4 * h * (width + h)
            width = h
        return n * length * total


class CharLSTM(nn.Module):
    """Embedding → stacked LSTM → Linear from the last position's hidden state."""

    input_dtype = torch.long

    def __init__(self, vocab: int, num_classes: int, embed: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = FlopLSTM(embed, hidden, layers, batch_first=True)
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.out(h[:, -1])


@MODELS.register("char_lstm")
@token_model
def char_lstm(
    input_shape: InputShape,
    num_classes: int,
    *,
    embed: int = 8,
    hidden: int = 256,
    layers: int = 2,
) -> nn.Module:
    """LEAF's Shakespeare model (Caldas et al. 2018, §3; its ``stacked_lstm``): each token
    embedded in 8 dimensions, a 2-layer LSTM of 256 units, a linear layer from the last
    position's output to the classes (819,920 parameters for LEAF's 80 characters).

    The embedding knows as many tokens as there are classes (next-token prediction).

    Args:
        embed: embedding dimension (LEAF: 8).
        hidden: LSTM units per layer (LEAF: 256).
        layers: stacked LSTM layers (LEAF: 2).
    """
    _seq_len(input_shape, "char_lstm")
    for key, value in (("embed", embed), ("hidden", hidden), ("layers", layers)):
        _check(key, value)
    return CharLSTM(num_classes, num_classes, embed, hidden, layers)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees itself and those before it."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        n, length, d = x.shape
        qkv = self.qkv(x).view(n, length, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(n, length, d))

    def flops(self, inputs: tuple[Tensor, ...], output: Tensor) -> int:
        """The scores q·kᵀ and their weighted sum of v, over all position pairs (the mask
        is not subtracted): 2 · 2·L²·d per sample (its Linear layers count themselves)."""
        n, length, d = inputs[0].shape
        return 4 * n * length * length * d


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d_model: int, heads: int, ff: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, ff), nn.GELU(), nn.Linear(ff, d_model))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class CharTransformer(nn.Module):
    """Token and learned position embeddings → causal blocks → LayerNorm → Linear from the
    last position."""

    input_dtype = torch.long

    def __init__(
        self, vocab: int, num_classes: int, seq_len: int, d_model: int, layers: int, heads: int,
        ff: int,
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = nn.Sequential(*(Block(d_model, heads, ff) for _ in range(layers)))
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks(self.embed(x) + self.position[: x.shape[1]])
        return self.out(self.norm(h[:, -1]))


@MODELS.register("char_transformer")
@token_model
def char_transformer(
    input_shape: InputShape,
    num_classes: int,
    *,
    d_model: int = 64,
    layers: int = 2,
    heads: int = 4,
    ff: int | None = None,
) -> nn.Module:
    """A small causal (GPT-style, pre-norm) transformer over character tokens: token plus
    learned position embeddings, ``layers`` blocks of causal self-attention and a GELU MLP,
    a final LayerNorm and a linear layer from the last position to the classes (the
    embedding knows as many tokens as there are classes). No dropout
    (training stays deterministic). The defaults (d_model 64, 2 layers, 4 heads) have
    115,536 parameters for 80 characters and windows of 80.

    Args:
        d_model: width of the token vectors.
        layers: transformer blocks.
        heads: attention heads per block (must divide d_model).
        ff: hidden width of each block's MLP (default 4·d_model).
    """
    seq_len = _seq_len(input_shape, "char_transformer")
    for key, value in (("d_model", d_model), ("layers", layers), ("heads", heads)):
        _check(key, value)
    if d_model % heads:
        raise ConfigError("heads", f"must divide d_model {d_model}, got {heads}")
    if ff is not None:
        _check("ff", ff)
    return CharTransformer(
        num_classes, num_classes, seq_len, d_model, layers, heads, ff or 4 * d_model
    )
