"""What a runtime is handed: every part of an experiment, built from its resolved config."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from p2pfl.core.errors import ConfigError, RunError
from p2pfl.core.options import bind
from p2pfl.core.seeding import derive_seed, numpy_rng
from p2pfl.data.federated import FederatedData
from p2pfl.learning.state import ghost
from p2pfl.learning.training import TrainConfig, Trainer, resolve_device
from p2pfl.methods.attacks import Adversary, attacked
from p2pfl.methods.base import Method, NodeContext
from p2pfl.methods.effects import Behaviour, State
from p2pfl.network.codecs import Compression, from_section
from p2pfl.network.dynamics import Network
from p2pfl.network.peers import Population
from p2pfl.network.topology import Topology
from p2pfl.reporting.matching import MatchingConfig
from p2pfl.reporting.progress import check_targets
from p2pfl.reporting.reporters import check_reporters


@dataclass(frozen=True)
class EvalConfig:
    """The ``eval:`` section: how often the global test set is scored, the optional
    neuron-matching measure after the run (:mod:`p2pfl.reporting.matching`), where the
    rows go besides ``metrics.csv`` (:mod:`p2pfl.reporting.reporters`), and the accuracies
    whose time to reach ``summary.json`` reports (``targets``: :mod:`p2pfl.reporting.progress`).

    Args:
        every: score on the global test set every this many rounds (and always the last).
        per_peer: at the end, score every peer's final model (``summary.json`` ``per_peer``).
        matching: neuron matching after the run, ``{peers, epochs, samples}`` (see
            ``eval.matching``); null: none.
        reporters: where the ``metrics.csv`` rows also go, e.g. ``[tensorboard]`` (see
            ``eval.reporters``).
        targets: accuracies in (0, 1] whose time to accuracy ``summary.json`` reports
            (``time_to_accuracy``: the simulated time, bytes and round when first reached).
        peers: score only this many peers at each scored round, the same sample every
            round, drawn from the seed (a server is always scored); null: every peer. Where
            scoring every peer costs more than the study needs: a third of a 10⁴-peer
            DFedAvgM run (docs/how-to/large-populations.md).
    """

    every: int = 1
    per_peer: bool = True
    matching: dict | None = None
    reporters: tuple[str, ...] = ()
    targets: tuple[float, ...] = ()
    every_s: float | None = None  # simulation: score the run's model every so many seconds
    peers: int | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError("every", "must be >= 1")
        if self.every_s is not None and not 0 < self.every_s < math.inf:
            raise ConfigError("every_s", f"must be a number of seconds > 0, got {self.every_s}")
        if self.peers is not None and self.peers < 1:
            raise ConfigError("peers", f"must be >= 1 (null: every peer), got {self.peers}")
        check_reporters(self.reporters)
        check_targets(self.targets)
        if self.matching is not None:
            try:
                keys = asdict(MatchingConfig(**bind(MatchingConfig, self.matching)))
            except ConfigError as e:
                raise e.within("matching") from None
            object.__setattr__(self, "matching", keys)  # stored with its defaults filled in

    def scored(self, seed: int, num_peers: int) -> frozenset[int] | None:
        """The peers whose models are scored (``peers``' sample), ``None`` for every peer."""
        if self.peers is None:
            return None
        sample = numpy_rng(seed, "eval", "peers").choice(num_peers, self.peers, replace=False)
        return frozenset(sample.tolist())


@dataclass(frozen=True)
class StopConfig:
    """The ``stop:`` section: end the run when a simulated time has passed (``time_s``), when
    the peers together have trained on ``samples`` samples, or when the run's model reaches
    ``accuracy`` (scored every ``eval.every_s``), whichever comes first. The method's rounds
    still bound the run; left unset, they are unbounded (:data:`UNBOUNDED_ROUNDS`). Each
    node's model at the stop is the one it last evaluated (its last finished round or
    iteration).

    Args:
        time_s: stop at this time on the run's clock: simulated seconds, or over ZeroMQ wall seconds
            since the common start.
        samples: stop when the peers together have trained on this many samples.
        accuracy: stop at the first ``eval.every_s`` score of the run's model at or above it
            (simulation only; needs ``eval.every_s``).
    """

    time_s: float | None = None
    samples: int | None = None
    accuracy: float | None = None

    def __post_init__(self) -> None:
        if self.time_s is None and self.samples is None and self.accuracy is None:
            raise ConfigError("time_s", "give time_s, samples or accuracy (or leave out stop:)")
        if self.time_s is not None and not 0 < self.time_s < math.inf:
            raise ConfigError("time_s", f"must be a number of seconds > 0, got {self.time_s}")
        if self.samples is not None and self.samples < 1:
            raise ConfigError("samples", f"must be >= 1, got {self.samples}")
        if self.accuracy is not None and not 0 < self.accuracy <= 1:
            raise ConfigError("accuracy", f"must be in (0, 1], got {self.accuracy}")


MAX_TIMEOUT_S = 1e6
"""The longest timeout a run accepts (11.6 days; ZeroMQ counts milliseconds in an int32)."""


@dataclass(frozen=True)
class TransportConfig:
    """The ``transport:`` section: how real (ZeroMQ) runs behave; ignored in simulation.

    Args:
        timeout_s: the longest any receive waits in a real run (at most 10⁶ s); it must cover the
            sender's compute before it sends.
        startup_timeout_s: every node must have started and said hello within this.
        max_message_bytes: larger frames are refused, and frames whose tensors would decode to more
            bytes.
        host: the interface the launcher's nodes bind on.
        curve_keys: a directory of CURVE key pairs (made by ``p2pfl keys``): every link is encrypted
            and authenticated (null: no encryption; trust the network).
    """

    timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    max_message_bytes: int = 1 << 30
    host: str = "127.0.0.1"
    curve_keys: str | None = None

    def __post_init__(self) -> None:
        for key in ("timeout_s", "startup_timeout_s", "max_message_bytes"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, f"must be > 0, got {getattr(self, key)}")
        for key in ("timeout_s", "startup_timeout_s"):  # socket options count int32 ms
            if not getattr(self, key) <= MAX_TIMEOUT_S:
                raise ConfigError(key, f"must be <= {MAX_TIMEOUT_S:g} s, got {getattr(self, key)}")
        if self.max_message_bytes > 1 << 40:
            raise ConfigError("max_message_bytes", "must be <= 2**40")


UNBOUNDED_ROUNDS = 1_000_000
"""The rounds of a method whose run a ``stop:`` section bounds, when the user gives none."""


@dataclass
class Setup:
    """Everything a runtime needs, built from a resolved config."""

    config: dict[str, Any]
    method: Method
    population: Population
    topology: Topology
    trainer: Trainer
    data: FederatedData
    train: TrainConfig
    eval: EvalConfig
    transport: TransportConfig  # how real runs behave
    network: Network | None = None  # the ``network:`` section, if the run has one
    adversary: Adversary | None = None  # the ``adversary:`` section, if it names attackers
    stop: StopConfig | None = None  # the ``stop:`` section, if the run has one

    @property
    def seed(self) -> int:
        return self.config["seed"]

    @functools.cached_property
    def compression(self) -> Compression:
        """The ``compression:`` section, parsed once for every node and runtime."""
        return from_section(self.config["compression"])

    @property
    def devices(self) -> set[torch.device]:
        """The devices the peers train on."""
        return {resolve_device(p.device) for p in self.population.profiles}

    def check_forkable(self, what: str) -> None:
        """Raise :class:`RunError` if this run trains on CUDA and this process has already
        initialized CUDA, which does not survive a fork: ``what`` (ranks, nodes) would
        fail in their first CUDA call. A run on the CPU forks from any process."""
        if torch.cuda.is_initialized() and any(d.type == "cuda" for d in self.devices):
            raise RunError(f"CUDA was initialized before the {what} were forked")

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        """The behaviour node ``ctx.node`` runs: the method's, wrapped if it attacks."""
        behaviour = self.method.behaviour(ctx)
        if self.adversary is not None and ctx.node in self.adversary.peers:
            return attacked(behaviour, self.adversary, ctx)
        return behaviour

    def init_state(self) -> State:
        """The model every node starts from (seeded by the run's seed)."""
        return self.trainer.init_state(derive_seed(self.seed, "init"))

    def contexts(self, mine: Callable[[int], bool] | None = None) -> dict[int, NodeContext]:
        """Every node's context. ``mine`` (a sharded run): the nodes whose models this
        process holds; every other node starts from a ghost of the model (``meta``
        tensors, :mod:`p2pfl.runtime.shards`)."""
        params = self.trainer.module(torch.device("cpu")).named_parameters()
        trainable = frozenset(name for name, _ in params)
        ghost_init = (
            self.init_state if mine is None else functools.partial(ghost, self.init_state())
        )
        return {
            node: NodeContext(
                node=node,
                topology=self.topology,
                num_samples=self.data.peers[node].num_train
                if node < self.topology.num_peers
                else 0,
                seed=self.seed,
                init_state=self.init_state if mine is None or mine(node) else ghost_init,
                trainable=trainable,
                compression=self.compression,
            )
            for node in self.topology.graph.nodes
        }
