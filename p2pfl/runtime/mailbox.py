"""A node's inbox: which arrived messages a ``Recv`` takes, the same in every runtime.

Messages are taken oldest first and handed to the method sorted by sender, so what a method
sees never depends on network timing: the simulated and the socket runtime agree.
"""

from __future__ import annotations

from p2pfl.methods.effects import Recv
from p2pfl.network.message import Message


def matches(recv: Recv, msg: Message) -> bool:
    return (
        msg.kind in recv.kinds
        and (recv.round is None or msg.round == recv.round)
        and (recv.before is None or msg.round < recv.before)
        and (recv.src is None or msg.src == recv.src)
    )


def take(inbox: list[Message], recv: Recv, partial: bool = False) -> list[Message] | None:
    """Remove and return ``recv.count`` matching messages (oldest first), sorted by sender;
    ``None`` if fewer have arrived, unless ``partial`` (a deadline passed): then those."""
    hits = [i for i, m in enumerate(inbox) if matches(recv, m)][: recv.count]
    if len(hits) < recv.count and not partial:
        return None
    taken = [inbox[i] for i in hits]
    for i in reversed(hits):
        del inbox[i]
    return sorted(taken, key=lambda m: m.src)


def describe(recv: Recv, name) -> str:
    """``recv`` in words, e.g. ``1 model message(s) of round 4 from 2``."""
    src = "" if recv.src is None else f" from {name(recv.src)}"
    rnd = "" if recv.round is None else f" of round {recv.round}"
    rnd += "" if recv.before is None else f" of a round before {recv.before}"
    by = "" if recv.deadline is None else f" by t={recv.deadline:g}s"
    return f"{recv.count} {'/'.join(recv.kinds)} message(s){rnd}{src}{by}"
