"""Named, independent random streams derived from the run's seed.

Every random choice (init, partition, batch order, participation, topology) draws from its
own stream keyed by what it is for, so adding a draw in one place never shifts another and
a peer's stream does not depend on the order in which peers run.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def _key(part: int | str) -> int:
    return zlib.crc32(part.encode()) if isinstance(part, str) else int(part)


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed for the stream named by ``keys`` under the run's ``seed``."""
    high, low = seed_sequence_state([seed, *(_key(k) for k in keys)])
    # high·2^31 + low rounded to a float64, as the first version computed it (numpy promoted
    # its uint64 @ int64 product to float64); kept so that every seed's streams stay the same.
    return int(float((high << 31) + low)) & ((1 << 63) - 1)


_M32 = 0xFFFFFFFF
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715


def seed_sequence_state(entropy: list[int]) -> tuple[int, int]:
    """``numpy.random.SeedSequence(entropy).generate_state(2)`` (pool of four 32-bit words,
    no spawn key), in plain Python: the same two words in about half the time of numpy's
    inside a run, where training pushes numpy's code out of the CPU's caches (33-49 µs per
    call against 60-100 µs; 17 µs in a loop), and a run derives one seed per local training.
    ``tests/test_core_sim.py`` checks it against numpy on random entropy."""
    words: list[int] = []
    for n in entropy:  # each integer as 32-bit words, least significant first (0: one word)
        if n < 0:
            raise ValueError(f"entropy must be non-negative, got {n}")
        words.append(n & _M32)
        n >>= 32
        while n:
            words.append(n & _M32)
            n >>= 32
    words += [0] * (4 - len(words))
    h, pool = _INIT_A, []
    for v in words[:4]:  # hashmix each of the first four words into the pool
        v ^= h
        h = h * _MULT_A & _M32
        v = v * h & _M32
        pool.append(v ^ v >> 16)
    for src in range(4):  # every pool word into every other
        for dst in range(4):
            if src != dst:
                v = pool[src] ^ h
                h = h * _MULT_A & _M32
                v = v * h & _M32
                r = _MIX_L * pool[dst] - _MIX_R * (v ^ v >> 16) & _M32
                pool[dst] = r ^ r >> 16
    for word in words[4:]:  # the remaining entropy into every pool word
        for dst in range(4):
            v = word ^ h
            h = h * _MULT_A & _M32
            v = v * h & _M32
            r = _MIX_L * pool[dst] - _MIX_R * (v ^ v >> 16) & _M32
            pool[dst] = r ^ r >> 16
    first = pool[0] ^ _INIT_B
    h = _INIT_B * _MULT_B & _M32
    first = first * h & _M32
    second = pool[1] ^ h
    h = h * _MULT_B & _M32
    second = second * h & _M32
    return first ^ first >> 16, second ^ second >> 16


def numpy_rng(seed: int, *keys: int | str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *keys))


def torch_generator(seed: int, *keys: int | str) -> torch.Generator:
    import torch  # here: the commands that only read runs (plot, report) never load torch

    return torch.Generator().manual_seed(derive_seed(seed, *keys))
