"""The effects a peer behaviour yields; a runtime carries them out and sends back the result.

A method is the behaviour of one node, written as a generator::

    def behaviour(ctx):
        (msg,) = yield Recv(kinds=("model",))            # -> list[Message], sorted by sender
        result = yield Train(msg.tensors, round=msg.round)  # -> TrainResult
        yield Send(ctx.server, "model", msg.round, result.state)
        yield Finish(result.state)

It never touches clocks, sockets or SimPy, so the same code runs simulated or over ZeroMQ.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from p2pfl.data.federated import PeerData
from p2pfl.learning.state import State
from p2pfl.learning.training import Regularizer
from p2pfl.network.codecs import Codec
from p2pfl.network.message import Message, Meta

T = TypeVar("T")


@dataclass(frozen=True)
class Send:
    """Send ``tensors`` to neighbour ``dst``; returns at once (the uplink queues the transfer).

    ``codec`` packs this message's floating tensors in place of the ``compression:``
    section's codec for its kind (:mod:`p2pfl.network.codecs`)."""

    dst: int
    kind: str
    round: int
    tensors: State
    meta: Meta = field(default_factory=dict)
    codec: Codec | None = None


@dataclass(frozen=True)
class Recv:
    """Wait for ``count`` messages of one of ``kinds`` (and ``round``/``src`` if given;
    ``before``: of a round before that one).

    Returns them as a list sorted by sender, then by arrival, so the order never depends
    on timing. With a ``deadline`` (a time on the run's clock, see ``Now``) it returns at
    the latest then, with the matching messages that arrived (fewer, or none);
    ``deadline=math.inf`` waits until the run is over (simulated: when nothing else can
    happen; over sockets: ``transport.timeout_s`` without them) — a peer listening for a turn
    that may never come. A deadline that has passed takes what has arrived, at once.
    """

    kinds: tuple[str, ...] = ("model",)
    count: int = 1
    round: int | None = None
    src: int | None = None
    deadline: float | None = None
    before: int | None = None


@dataclass(frozen=True)
class Now:
    """Returns the time on the run's clock (simulated seconds, or wall seconds since the
    start over sockets): what a method needs to set a deadline."""


@dataclass(frozen=True)
class Wait:
    """Resume at time ``until`` on the run's clock (at once if it has passed); messages
    keep arriving in the inbox meanwhile."""

    until: float


@dataclass(frozen=True)
class Neighbours:
    """Returns the neighbours this node believes reachable now, sorted: those of the graph
    in force (the one for ``round`` where the graph is redrawn each round) that are online
    and not cut off, as a membership or heartbeat service would tell it. ``incoming``: the
    peers that send to this node (they differ on a directed graph)."""

    round: int | None = None
    incoming: bool = False


@dataclass(frozen=True)
class Train:
    """Train a copy of ``state`` on this peer's data; returns a ``TrainResult``.

    ``tag`` names the random stream for batch order (with the peer and round), so two
    trainings in one round can draw different orders. ``overrides`` replaces keys of the
    experiment's ``train:`` section for this call.
    """

    state: State
    round: int
    tag: str = ""
    regularizer: Regularizer | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Compute:
    """Run ``fn(module, data, device)`` with ``state`` loaded, on this peer's own data.

    For local statistics (projection matrices, Fisher information, activations); returns
    what ``fn`` returns. The compute model charges ``passes`` forward+backward passes over
    the peer's training set.
    """

    state: State
    fn: Callable[[nn.Module, PeerData, torch.device], Any]
    passes: float = 1.0


@dataclass(frozen=True)
class Evaluate:
    """Score ``state`` on the global test set and log accuracy and loss; returns ``(acc, loss)``
    (``None`` in a simulation spread over ranks, which scores it later, at its next flush, and
    where the round is not scored: ``eval.every``, ``eval.peers``)."""

    state: State
    round: int


@dataclass(frozen=True)
class Report:
    """Score ``state`` on the global test set and record it in ``summary.json`` under
    ``baselines[name]`` (e.g. one-shot FedAvg computed from the same local models). A list
    of states is scored as an output ensemble (the mean, or ``weights``-weighted, logits)."""

    name: str
    state: State | list[State]
    weights: torch.Tensor | None = None  # for a list: [models, classes] logit weights


@dataclass(frozen=True)
class Artifact:
    """Save a matrix of this run as ``NAME.csv`` and a heat-map ``NAME.png`` in the run dir."""

    name: str
    matrix: torch.Tensor
    title: str = ""


@dataclass(frozen=True)
class Log:
    """Write one metric row for this node."""

    round: int
    metric: str
    value: float


@dataclass(frozen=True)
class Serve:
    """From now on, answer each arriving message of one of ``kinds`` at once, even while this
    node trains or waits: the runtime runs ``handler(msg)`` on the message's arrival, as a
    separate thread of the peer would (Lian et al. 2018, §4: the averaging thread).

    The handler is a generator that may yield only ``Send``, ``Log``, ``Now`` and
    ``Neighbours`` (it takes no time of its own). It runs between the behaviour's own steps,
    never in the middle of one, so the two may share the node's state (a variable both
    close over) without locks: a handler that runs during a ``Train`` changes the node's
    model, not the copy being trained. A served message never reaches the inbox.
    ``Serve(None)`` stops serving; so does the end of the behaviour.
    """

    handler: Callable[[Message], Generator[Effect, Any, None]] | None
    kinds: tuple[str, ...] = ("model",)


@dataclass(frozen=True)
class Finish:
    """Declare this node's final model (``None`` if it holds none).

    ``output=True`` marks the run's result (the server's model, the chain's last peer).
    Where no node claims it, the result is the uniform mean of the peers' final models.
    """

    state: State | None
    output: bool = False


Effect = (
    Send
    | Recv
    | Now
    | Wait
    | Neighbours
    | Train
    | Compute
    | Evaluate
    | Report
    | Artifact
    | Log
    | Serve
    | Finish
)
Behaviour = Generator[Effect, Any, None]
"""A node's whole behaviour: it yields effects and gets each one's result back."""
Steps = Generator[Effect, Any, T]
"""Part of a behaviour that ends with a value: ``x = yield from part(...)``."""
