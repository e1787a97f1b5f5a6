"""Python's cyclic garbage collector held off for a piece of work.

A full collection walks every container object the process holds. Work that makes
millions of objects without cycles (a 10⁶-row table read back, a 10⁵-node graph drawn)
would trigger one again and again as its objects pile up: 6 of the 16 s of ``p2pfl plot``
on a 10⁵-peer run. Objects without cycles are freed by their reference counts all the same;
what cyclic garbage the work leaves is collected once the collector is back on.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off within (as a ``with`` block or a function's decorator),
    and back on after only if it was on before."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
