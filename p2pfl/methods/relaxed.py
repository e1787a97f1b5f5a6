"""FedInit's relaxed initialization (Sun, Shen, Tao, NeurIPS 2023; the poster's Alg. 1 and
Table 2), a plug-in for multi-round methods.

A peer that receives a model w starts its local training from w + β·(w − last), where
``last`` is the model its own previous local training ended at (the shared init before its
first), and keeps the new end model as ``last``: one model of state per peer, kept in the
peer's behaviour, and nothing extra on the wire. Only trainable parameters are relaxed;
buffers (BatchNorm statistics) start from the received values. The host method's anchors
(FedProx's proximal term) see the relaxed start as "the model received".

``aggregate`` chooses what the host then combines: ``model`` (the poster's Alg. 1, default)
sends the end model, so the server averages end models; ``delta`` (the authors' code) sends
w + (end − start), so averaging applies the updates measured from the relaxed starts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass
from typing import Any, Literal

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import bind
from p2pfl.methods.effects import Effect, State, Train


@dataclass(frozen=True)
class RelaxedInit:
    """The ``algorithm.relaxed_init`` key: ``{beta: 0.1, aggregate: model|delta}``.

    Args:
        beta: β >= 0: a peer starts local training from w + β(w − its last local model) (0: the host
            method bit for bit).
        aggregate: what a peer sends: ``model`` (the end of its training) or ``delta`` (w + (end −
            start)).
    """

    beta: float = 0.1
    aggregate: Literal["model", "delta"] = "model"

    def __post_init__(self) -> None:
        if self.beta < 0:
            raise ConfigError("beta", f"must be >= 0, got {self.beta}")

    def start(self, received: State, last: State, trainable: Collection[str]) -> State:
        """w + β·(w − last) on the trainable parameters; buffers as received."""
        return {
            k: w + self.beta * (w - last[k]) if k in trainable else w for k, w in received.items()
        }

    def upload(self, received: State, start: State, end: State) -> State:
        """What the peer sends after training: its end model, or in ``delta`` mode the
        received model moved by its update, w + (end − start)."""
        if self.aggregate == "model":
            return end
        return {k: v - (start[k] - received[k]) for k, v in end.items()}


def parse_relaxed_init(options: dict[str, Any] | None) -> RelaxedInit | None:
    """The checked ``relaxed_init`` key of a method (``None``: not used)."""
    if options is None:
        return None
    try:
        return RelaxedInit(**bind(RelaxedInit, options))
    except ConfigError as e:
        raise e.within("relaxed_init") from None


def local_round(
    relaxed: RelaxedInit | None,
    local_train: Callable[[State, int], Train],
    received: State,
    last: State,
    trainable: Collection[str],
    round: int,
) -> Generator[Effect, Any, tuple[State, State]]:
    """One local training of a peer holding ``last`` that received ``received``: relaxed
    when ``relaxed`` is set, else from ``received``. Returns (end model, model to send)."""
    if relaxed is None:
        end = (yield local_train(received, round)).state
        return end, end
    start = relaxed.start(received, last, trainable)
    end = (yield local_train(start, round)).state
    return end, relaxed.upload(received, start, end)
