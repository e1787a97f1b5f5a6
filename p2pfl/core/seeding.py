"""Named, independent random streams derived from the run's seed.

Every random choice (init, partition, batch order, participation, topology) draws from its
own stream keyed by what it is for, so adding a draw in one place never shifts another and
a peer's stream does not depend on the order in which peers run.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch


def _key(part: int | str) -> int:
    return zlib.crc32(part.encode()) if isinstance(part, str) else int(part)


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed for the stream named by ``keys`` under the run's ``seed``."""
    high, low = np.random.SeedSequence([seed, *(_key(k) for k in keys)]).generate_state(2)
    # high·2^31 + low rounded to a float64, as the first version computed it (numpy promoted
    # its uint64 @ int64 product to float64); kept so that every seed's streams stay the same.
    return int(float((int(high) << 31) + int(low))) & ((1 << 63) - 1)


def numpy_rng(seed: int, *keys: int | str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *keys))


def torch_generator(seed: int, *keys: int | str) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, *keys))
