"""Where a one-shot upload goes: the base of every method whose peers upload once.

``placement: star``: every peer uploads to the star's centre, which aggregates and sends the
model back. ``placement: mesh``: every peer uploads to every other peer of a complete graph
and aggregates for itself, in peer order, so all peers end with the same model. Shared by
the one-shot merges (:mod:`p2pfl.methods.oneshot.protocol`) and MA-Echo.

``deadline_s`` lives with a network that misbehaves: an aggregator merges the complete
uploads that arrived by that time (from the start of the run), and a peer whose result never
comes keeps its own model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Literal

from p2pfl.core.errors import ConfigError, RunError
from p2pfl.methods.base import Method, NodeContext
from p2pfl.methods.effects import Behaviour, Effect, Recv
from p2pfl.network.message import Message
from p2pfl.network.topology import Topology


@dataclass(kw_only=True, eq=False)
class UploadOnce(Method):
    """A one-shot method: ``peer`` runs on every peer, ``centre`` on a star's centre.

    Args:
        placement: ``star``: the centre aggregates and returns the model; ``mesh``: every peer sends
            to every other and aggregates for itself (a complete graph).
        deadline_s: the aggregator merges the complete uploads that arrived by this time from the
            start of the run (null: wait for every peer).
    """

    placement: Literal["star", "mesh"] = "star"
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ConfigError("deadline_s", "must be > 0")

    def check(self, topology: Topology, seed: int) -> None:
        if self.placement == "star" and topology.server is None:
            raise ConfigError(
                "kind",
                f"{self.name} with placement: star needs kind: star, not {topology.kind!r}",
            )
        complete = all(
            len(topology.neighbours(p)) == topology.num_peers - 1 for p in topology.peers
        )
        if self.placement == "mesh" and (topology.server is not None or not complete):
            raise ConfigError(
                "kind",
                f"{self.name} with placement: mesh needs a complete graph of peers (kind: mesh), "
                f"not {topology.kind!r}",
            )

    def total_rounds(self, num_peers: int) -> int:
        return 1

    def targets(self, topology: Topology, node: int) -> list[int]:
        """Where a peer uploads: the star's centre, or every other peer (mesh)."""
        if self.placement == "star":
            return [star_centre(topology)]
        return [p for p in topology.peers if p != node]

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        return self.centre(ctx) if ctx.is_server else self.peer(ctx)

    def uploads(self, count: int, per_peer: int) -> Generator[Effect, Any, list[Message]]:
        """The ``count`` upload messages of round 1; with ``deadline_s`` (from the start of
        the run), the complete uploads (all ``per_peer`` parts of a peer) that arrived by
        then — at least one: a network that misbehaves may keep the others away."""
        kinds = ("model", "statistics")
        if self.deadline_s is None:
            return (yield Recv(kinds=kinds, count=count, round=1))
        msgs = yield Recv(kinds=kinds, count=count, round=1, deadline=self.deadline_s)
        parts = Counter(m.src for m in msgs)
        complete = [m for m in msgs if parts[m.src] == per_peer]
        if not complete:
            raise RunError(f"no complete upload arrived by the deadline (t={self.deadline_s:g}s)")
        return complete

    def peer(self, ctx: NodeContext) -> Behaviour:
        """A peer: train, compute what it uploads, upload; then aggregate (mesh) or wait
        for the centre's model (star)."""
        raise NotImplementedError

    def centre(self, ctx: NodeContext) -> Behaviour:
        """The star's centre: aggregate every upload, send the model back."""
        raise NotImplementedError


def star_centre(topology: Topology) -> int:
    """The star's centre (``check`` has made sure there is one)."""
    if topology.server is None:
        raise ValueError(f"a {topology.kind!r} topology has no centre")
    return topology.server
