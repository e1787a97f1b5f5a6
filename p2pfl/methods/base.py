"""The method interface: what every federated-learning method provides.

A method's constructor keywords are its ``algorithm:`` YAML keys (with type hints and
defaults): the built-in methods are dataclasses whose fields are those keys, so a subclass
(FedProx of FedAvg, FedFisher of the one-shot base) lists only the keys it adds and checks
them in ``__post_init__``; a method that runs in rounds takes the ``rounds`` key, its check
and ``total_rounds`` from :class:`Rounds`. ``behaviour(ctx)`` is the generator one node runs (see
:mod:`p2pfl.methods.effects`); the same object serves every node, so it must keep no
per-node state on ``self``.
``transfers(plan)`` lists the messages it sends, analytically (``p2pfl cost``). ``check``,
``check_data`` and ``check_network`` reject, before anything runs, a topology, a model or
data, or a network it cannot use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import Registry
from p2pfl.data.federated import FederatedData
from p2pfl.learning.robust import Aggregator, parse_aggregator
from p2pfl.methods.effects import Behaviour, State
from p2pfl.methods.relaxed import RelaxedInit, parse_relaxed_init
from p2pfl.network.codecs import Compression
from p2pfl.network.dynamics import Network
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import Topology


@dataclass(frozen=True)
class NodeContext:
    """What one node knows: who it is, its neighbours, its data size, the shared init,
    which keys of a model state are trainable parameters (the others are buffers), and the
    run's ``compression:`` section (how the network packs each message kind: a node that
    merges its own upload with the others' takes it as they decode it)."""

    node: int
    topology: Topology
    num_samples: int
    seed: int
    init_state: Callable[[], State]
    trainable: frozenset[str]
    compression: Compression | None = None

    @property
    def neighbours(self) -> list[int]:
        return self.topology.neighbours(self.node)

    @property
    def server(self) -> int | None:
        return self.topology.server

    @property
    def peers(self) -> list[int]:
        return self.topology.peers

    @property
    def is_server(self) -> bool:
        return self.node == self.topology.server


class Method:
    """Base class of a method: a keyword-only dataclass whose fields are its ``algorithm:``
    keys (a subclass lists only the keys it adds), registered with ``@METHODS.register(NAME)``
    (which sets ``name``). It writes ``behaviour`` and ``total_rounds``, may narrow
    ``topologies``, say it is ``serverless`` or extend the checks, and gives ``transfers``
    for ``p2pfl cost``."""

    name: ClassVar[str]
    #: topology kinds the method runs on; empty means any connected graph.
    topologies: ClassVar[tuple[str, ...]] = ()
    #: the method has no server: a topology with one (a star) is refused.
    serverless: ClassVar[bool] = False
    #: why the ``adversary:`` attacks do not apply to what it sends (None: they do).
    unattackable: ClassVar[str | None] = None

    def check(self, topology: Topology, seed: int) -> None:
        """Raise ``ConfigError`` (key ``kind``) if the method cannot run on ``topology``."""
        if self.topologies and topology.kind not in self.topologies:
            raise ConfigError(
                "kind",
                f"{self.name} runs on {' or '.join(self.topologies)}, not on {topology.kind!r}",
            )
        if self.serverless and topology.server is not None:
            raise ConfigError(
                "kind", f"{self.name} is serverless; use a ring, mesh or random graph"
            )

    def check_data(self, model: nn.Module, data: FederatedData) -> None:
        """Raise ``ConfigError`` if the method cannot learn ``model`` (a fresh copy, free to
        run) from ``data``: a need that spans sections, so the key is a full path such as
        ``partition.val_fraction``. Runs with the other checks, before anything is written."""

    def check_network(self, network: Network) -> None:
        """Raise ``ConfigError`` (the method's own key) if the method cannot run on the run's
        ``network:`` section (one that misbehaves: ``network.changes_graph`` says whether
        ``network.graph`` redraws or schedules the graph). Runs with the other checks,
        before anything is written."""

    def total_rounds(self, num_peers: int) -> int:
        """How many rounds the run logs (drives the progress bar and the last evaluation)."""
        raise NotImplementedError

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        raise NotImplementedError

    def transfers(self, plan: Plan) -> Iterable[Transfer]:
        """Every message the method sends on ``plan.topology``, analytically (the formula of
        its cost, see :mod:`p2pfl.network.plan`); ``check`` has passed."""
        raise NotImplementedError(f"{self.name} has no analytic cost description")


@dataclass(kw_only=True, eq=False)
class Rounds(Method):
    """A method that runs a number of rounds: the ``rounds`` key (>= 1), which is also what
    the run logs. A subclass lists its own keys after it and calls
    ``super().__post_init__()`` first.

    Args:
        rounds: how many rounds the method runs (>= 1); with a ``stop:`` section and no ``rounds``
            given, unbounded.
    """

    rounds: int = 20

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ConfigError("rounds", f"must be >= 1, got {self.rounds}")

    def total_rounds(self, num_peers: int) -> int:
        return self.rounds


@dataclass(kw_only=True, eq=False)
class Aggregating(Rounds):
    """A rounds method whose merge is a rule of ``AGGREGATORS`` (``aggregator``: the mean,
    or a robust rule against attackers) and that may start each round from FedInit's relaxed
    point (``relaxed_init``, :mod:`p2pfl.methods.relaxed`): the two keys FedAvg and DFedAvgM
    share, checked once here into ``rule`` and ``relaxed``.

    Args:
        aggregator: the merge: ``mean`` (the method's own weighted mean) or a robust rule of
            ``algorithm.aggregator`` (``median``, ``trimmed_mean``, ``krum``, ``centered_clipping``,
            ``clipped_gossip``), a name or a mapping with ``name`` and its keys.
        relaxed_init: FedInit: ``{beta, aggregate}`` (see ``algorithm.relaxed_init``); null: start
            each round from the received model.
    """

    aggregator: str | dict = "mean"
    relaxed_init: dict | None = None
    relaxed: RelaxedInit | None = field(init=False, repr=False)
    rule: Aggregator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.relaxed = parse_relaxed_init(self.relaxed_init)
        self.rule = parse_aggregator(self.aggregator)


METHODS: Registry[type[Method]] = Registry("method")
