"""Attackers: peers that run the honest behaviour of any method but lie in what they send.

The ``adversary:`` section of an experiment picks the attacking peers and their attack::

    adversary:
      fraction: 0.2              # a seeded share of the data-holding peers (round half up) ...
      peers: [0, 3]              # ... or these peers
      attack: sign_flip          # a registered attack, or {name: sign_flip, scale: 4}

An attack is a keyword-only dataclass registered in ``ATTACKS`` (its fields are its keys,
each in its own module of this package). :func:`attacked` wraps a node's honest behaviour:
every model it sends passes :meth:`Attack.corrupt` first, so no method is edited to be
attacked, and it works the same simulated and over sockets. What an attacker knows (its
:class:`View`) is what its own node saw — the model its local training started from, the
model it trained, and the latest models its honest neighbours sent it — and who the other
attackers are (they collude). It does not see messages between other peers: the attacks
that the papers run with an omniscient adversary (ALIE, IPM) use this local view instead.

An attacker's own model is no result of the run: it logs no evaluation rows and finishes
with no model, so the output and ``summary.json``'s per-peer accuracies are the honest ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import Registry, bind
from p2pfl.core.seeding import numpy_rng, torch_generator
from p2pfl.data.federated import PeerData
from p2pfl.learning.state import State
from p2pfl.learning.training import TrainResult
from p2pfl.methods.base import NodeContext
from p2pfl.methods.effects import Behaviour, Evaluate, Finish, Recv, Send, Train
from p2pfl.network.topology import Topology


@dataclass(frozen=True)
class View:
    """What an attacking node knows when it sends a model (only parameters, no buffers).

    ``start``: the model its last local training started from (the server's global model
    on a star, its own mixed model on a graph), or the honest model before any training.
    ``heard``: the latest model each honest neighbour sent it, by sender. ``rng``: this
    message's own random stream. ``num_peers``/``num_attackers``: the run's sizes."""

    node: int
    round: int
    start: State
    heard: dict[int, State]
    rng: torch.Generator
    num_peers: int
    num_attackers: int

    def known(self, honest: State) -> list[State]:
        """The honest models the attacker knows: its own, then its neighbours' by sender."""
        return [honest, *(self.heard[j] for j in sorted(self.heard))]


class Attack:
    """Base class: ``corrupt`` turns the honest model into the one sent; ``poison`` turns
    the peer's data into what it trains on (a data attack); ``trains`` False skips the
    local training (the state is handed back as it came)."""

    name: ClassVar[str]
    trains: ClassVar[bool] = True

    def corrupt(self, honest: State, view: View) -> State:
        return honest

    def poison(self, data: PeerData, num_classes: int) -> PeerData:
        return data

    @property
    def corrupts(self) -> bool:
        """Whether it changes the models the attacker sends (a model attack)."""
        return type(self).corrupt is not Attack.corrupt


ATTACKS: Registry[type[Attack]] = Registry("attack")


def update(honest: State, start: State) -> State:
    """The honest update Δ = honest − start (float64, parameters only)."""
    return {k: honest[k].to(torch.float64) - start[k].to(torch.float64) for k in honest}


def applied(start: State, delta: State, dtype_of: State) -> State:
    """start + Δ, cast to the dtypes of ``dtype_of``."""
    return {k: (start[k].to(torch.float64) + d).to(dtype_of[k].dtype) for k, d in delta.items()}


@dataclass(frozen=True)
class Adversary:
    """The ``adversary:`` section, resolved on a topology: who attacks, and how."""

    peers: tuple[int, ...]
    attack: Attack

    @property
    def name(self) -> str:
        return self.attack.name


def resolve_adversary(options: dict[str, Any]) -> dict[str, Any]:
    """Check an ``adversary:`` mapping; return it with defaults filled in (config.yaml)."""
    keys = bind(_section, options)
    if keys["fraction"] is not None and keys["peers"] is not None:
        raise ConfigError("peers", "give fraction or peers, not both")
    if keys["fraction"] is not None and not 0 <= keys["fraction"] < 1:
        raise ConfigError("fraction", f"must be in [0, 1), got {keys['fraction']}")
    attack = keys["attack"]
    if isinstance(attack, str):
        attack = {"name": attack}
    try:
        if "name" not in attack:
            raise ConfigError("name", f"missing; choose one of: {', '.join(ATTACKS.names())}")
        cls = ATTACKS.get(attack["name"])
        rest = {k: v for k, v in attack.items() if k != "name"}
        attack = {"name": attack["name"]} | bind(cls, rest, also=("name",))
        cls(**{k: v for k, v in attack.items() if k != "name"})  # its own checks
    except ConfigError as e:
        raise e.within("attack") from None
    return keys | {"attack": attack}


def _section(
    attack: str | dict, fraction: float | None = None, peers: list[int] | None = None
) -> None:
    """The keys of the ``adversary:`` section (a signature for :func:`bind`).

    Args:
        attack: a registered attack by name, or a mapping with ``name`` and its keys (see the
            attacks below).
        fraction: a seeded share of the data-holding peers attacks (rounded half up), in [0, 1); one
            that rounds up to every peer is refused.
        peers: or: these peers attack (give one of ``fraction`` and ``peers``); at least one
            data-holding peer must stay honest.
    """


def build_adversary(options: dict[str, Any], topology: Topology, seed: int) -> Adversary | None:
    """The attackers of a resolved ``adversary:`` section on ``topology``; None if none."""
    candidates = topology.peers
    if options["peers"] is not None:
        for p in options["peers"]:
            if p not in candidates:
                raise ConfigError(
                    "peers", f"{p} is not a data-holding peer (0..{len(candidates) - 1})"
                )
        chosen = sorted(set(options["peers"]))
    else:
        k = int((options["fraction"] or 0.0) * len(candidates) + 0.5)
        rng = numpy_rng(seed, "adversary")
        chosen = sorted(int(p) for p in rng.choice(candidates, k, replace=False))
    if not chosen:
        return None
    if len(chosen) == len(candidates):  # nothing left to defend, nor to score
        key = "peers" if options["peers"] is not None else "fraction"
        raise ConfigError(
            key, f"makes all {len(candidates)} data-holding peers attackers: no honest peer is left"
        )
    attack = options["attack"]
    cls = ATTACKS.get(attack["name"])
    return Adversary(tuple(chosen), cls(**{k: v for k, v in attack.items() if k != "name"}))


def attacked(behaviour: Behaviour, adversary: Adversary, ctx: NodeContext) -> Behaviour:
    """``behaviour`` of the attacking node ``ctx.node``: each model it sends is corrupted."""
    attack, node = adversary.attack, ctx.node
    bad = set(adversary.peers)
    params = ctx.trainable
    start: State | None = None
    heard: dict[int, State] = {}
    value: Any = None
    try:
        while True:
            try:
                effect = behaviour.send(value)
            except StopIteration:
                return
            if isinstance(effect, Train):
                start = effect.state
                if not attack.trains:
                    value = TrainResult(dict(effect.state), math.nan, 0, 0, 0.0)
                    continue
            elif isinstance(effect, Evaluate):
                value = (math.nan, math.nan)  # its model is no result of the run
                continue
            elif isinstance(effect, Finish):
                effect = Finish(None)
            elif isinstance(effect, Send) and params and params <= effect.tensors.keys():
                honest = {k: v for k, v in effect.tensors.items() if k in params}  # state order
                view = View(
                    node, effect.round,
                    {k: (start or effect.tensors)[k] for k in honest}, dict(heard),
                    torch_generator(ctx.seed, "attack", node, effect.round, effect.dst),
                    ctx.topology.num_peers, len(bad),
                )  # fmt: skip
                effect = replace(effect, tensors=effect.tensors | attack.corrupt(honest, view))
            value = yield effect
            if isinstance(effect, Recv):
                for m in value:
                    if m.src in ctx.peers and m.src not in bad and params <= m.tensors.keys():
                        heard[m.src] = {k: v for k, v in m.tensors.items() if k in params}
    finally:
        behaviour.close()


def honest_mean(states: Sequence[State]) -> State:
    """The coordinate-wise mean of states (float64)."""
    return {k: torch.stack([s[k].to(torch.float64) for s in states]).mean(0) for k in states[0]}
