"""Steps that methods share: parts of a behaviour, each used as ``x = yield from step(...)``.

The lines an algorithm box writes as "send w to every k in S", "receive the models of round
t" or "the neighbours of i" are written here once, so that a behaviour reads like its box.
Each step takes its mode as an argument, so one behaviour serves both a reliable network and
one that misbehaves (``network:``): ``live`` says whether a node asks the network which
neighbours it can reach now (``Neighbours``) or takes the graph's own; a deadline of ``None``
waits for every message. A step that is not needed yields nothing, so a method's runs without
those options are what they were, message for message.
"""

from __future__ import annotations

from collections.abc import Iterable

from p2pfl.methods.base import NodeContext
from p2pfl.methods.effects import Neighbours, Now, Recv, Send, State, Steps
from p2pfl.network.message import Message, Meta


def broadcast(
    dsts: Iterable[int], kind: str, round: int, tensors: State, meta: Meta | None = None
) -> Steps[None]:
    """Send the same message to each of ``dsts``, in their order."""
    for dst in dsts:
        yield Send(dst, kind, round, tensors, {} if meta is None else meta)


def reachable(
    ctx: NodeContext, live: bool, round: int | None = None, *, incoming: bool = False
) -> Steps[list[int]]:
    """The neighbours to talk to (``incoming``: those that send to this node): with ``live``,
    those the network says are reachable now, in the graph of ``round`` (``Neighbours``);
    else the graph's own, which on the static undirected graph of a run without ``network:``
    are the same."""
    if not live:
        return ctx.neighbours
    return (yield Neighbours(round=round, incoming=incoming))


def deadline_in(seconds: float | None) -> Steps[float | None]:
    """The time ``seconds`` from now on the run's clock, to ``gather`` by; ``None`` (no
    deadline: wait for all) where ``seconds`` is ``None``, without reading the clock."""
    if seconds is None:
        return None
    return (yield Now()) + seconds


def gather(
    count: int, round: int, deadline: float | None = None, kinds: tuple[str, ...] = ("model",)
) -> Steps[list[Message]]:
    """The ``count`` messages of ``round`` (sorted by sender), or with a ``deadline`` those
    that arrived by then (fewer, or none)."""
    return (yield Recv(kinds=kinds, count=count, round=round, deadline=deadline))
