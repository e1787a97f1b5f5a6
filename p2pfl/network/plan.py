"""Analytic communication plans: the messages a method sends, without running it.

A method describes its traffic in ``transfers(plan)``, next to its behaviour: one
:class:`Transfer` per message, built with :meth:`Plan.send` from the same tensors and meta
the behaviour sends, so the bytes come from the wire format itself (:func:`wire.frame_sizes`)
and compression is accounted for. Payloads whose values do not matter (statistics, stacked
candidates) may be given as tensors on the ``meta`` device: sizes read shapes only.

``phase`` orders the plan in time for the communication-time model of :mod:`p2pfl.app.cost`:
messages of one phase are sent together, and a phase starts when the previous one has
arrived.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from torch import nn

from p2pfl.network.codecs import Codec, Compression, choose
from p2pfl.network.message import Message, Meta, Tensors
from p2pfl.network.topology import Topology
from p2pfl.network.wire import frame_sizes


@dataclass(frozen=True)
class Transfer:
    """One message of a plan: who sends what to whom, in which round and phase, how big."""

    src: int
    dst: int
    kind: str
    round: int
    phase: int
    bytes: int


@dataclass
class Plan:
    """What an analytic description may use: the graph, the seed, the shared initial model
    and its architecture, the peers' data sizes, and the size rule.

    Sizes are the real frame sizes (header included) under ``compression``. With
    ``model_bytes`` M (the paper convention) a message counts its tensor bytes only, scaled
    so that one uncompressed model is exactly M bytes.
    """

    topology: Topology
    seed: int
    state: Tensors
    module: nn.Module
    num_train: list[int]
    num_val: list[int]
    compression: Compression = field(default_factory=dict)
    model_bytes: int | None = None
    _sizes: dict[tuple, int] = field(default_factory=dict, repr=False)

    def size(
        self, kind: str, tensors: Tensors, meta: Meta | None = None, codec: Codec | None = None
    ) -> int:
        """Bytes of one message with these tensors and meta, sent under the ``compression``
        or its own ``codec`` (cached by shapes, meta and codec)."""
        meta = meta or {}
        key = (
            kind,
            tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()),
            json.dumps(meta, sort_keys=True),
            codec,
        )
        if key not in self._sizes:
            compression = choose(self.compression, kind, codec)
            head, body = frame_sizes(Message(kind, 0, 0, 0, tensors, meta), compression)
            if self.model_bytes is None:
                self._sizes[key] = head + body
            else:
                _, model = frame_sizes(Message("model", 0, 0, 0, self.state))
                self._sizes[key] = round(body * self.model_bytes / model)
        return self._sizes[key]

    def send(
        self,
        src: int,
        dst: int,
        kind: str,
        round: int,
        phase: int,
        tensors: Tensors | None = None,
        meta: Meta | None = None,
        codec: Codec | None = None,
    ) -> Transfer:
        """The transfer of one message (no tensors: a control message with only ``meta``);
        ``codec`` as in :class:`p2pfl.methods.effects.Send`."""
        size = self.size(kind, tensors or {}, meta, codec)
        return Transfer(src, dst, kind, round, phase, size)
