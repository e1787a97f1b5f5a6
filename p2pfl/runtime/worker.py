"""Local effects shared by every runtime: training, statistics, evaluation, reports.

A runtime owns the clock and the network (``Send``, ``Recv``, ``Finish``); the worker
carries out every other effect with :meth:`Worker.perform`, and says how many simulated
seconds each piece of compute costs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2pfl.core.errors import RunError
from p2pfl.core.seeding import torch_generator
from p2pfl.learning import batched
from p2pfl.learning.ensemble import score_ensemble
from p2pfl.learning.state import State
from p2pfl.learning.training import (
    Proximal,
    TrainConfig,
    TrainResult,
    resolve_device,
    work,
)
from p2pfl.methods.effects import Artifact, Compute, Effect, Evaluate, Log, Report, Train
from p2pfl.reporting.heatmap import save_heatmap, save_matrix_csv
from p2pfl.reporting.reporters import Reporter
from p2pfl.runtime.ranks import Ranks
from p2pfl.runtime.setup import Setup
from p2pfl.runtime.shards import Shards

HELD_EVALS = 128
"""Over ranks, the deferred evaluations held per rank before they are scored without waiting
for the next flush (each holds a copy of its model: 10⁴ peers scored after their last
training would hold a second population of models until the end)."""

HELD_SCORES = 65536
"""Over sharded ranks, the evaluations held before their scores are exchanged without
waiting for the next flush. Each owner scores its peers at once and holds two floats: a
bound as small as :data:`HELD_EVALS` would make the ranks take turns, since a round's
evaluations come in peer order and so one rank's block after another's."""

_Group = tuple[TrainConfig, torch.device, float | None]
"""A batched group's key: the trainings' config, device and proximal ``mu``."""


class Worker:
    """Carries out the local effects of any node of one run."""

    def __init__(
        self,
        setup: Setup,
        metrics: Reporter,
        out: Path | None = None,
        ranks: Ranks | None = None,
        shards: Shards | None = None,
    ) -> None:
        self.trainer = setup.trainer
        self.data = setup.data
        self.train_cfg = setup.train
        self.population = setup.population
        self.topology = setup.topology
        self.seed = setup.seed
        self.metrics = metrics
        self.eval_every = setup.eval.every
        self.scored = setup.eval.scored(setup.seed, setup.topology.num_peers)
        """``eval.peers``' sample (``None``: every peer); nodes past the peers (a server) are
        always scored."""
        self.total_rounds = setup.method.total_rounds(setup.topology.num_peers)
        self.out = out
        self.baselines: dict[str, float] = {}
        # what a Report and an Artifact leave (--shard-events: kept, for rank 0 to write)
        self.baseline: Callable[[str, float], None] = self.baselines.__setitem__
        self.save_artifact: Callable[[str, list[Any], str, str], None] = self._save_artifact
        self._devices = {
            p: resolve_device(prof.device) for p, prof in enumerate(self.population.profiles)
        }
        self._server_device = resolve_device(self.population.profiles[0].device)
        self._pool: batched.DataPool | None = None
        self._supported: dict[tuple, bool] = {}  # batched.supports/divisible, per config
        self.ranks = ranks
        self.shards = shards  # with ``--shard``: whose models this rank holds
        self._evals: list[tuple[int, State | tuple[float, float] | None]] = []
        """Deferred evaluations (over ranks): the peer and a copy of its model to score, or
        (sharded) its owner's scores, ``None`` on another rank."""
        self._rows: list[tuple[float, int, str, str, float | tuple[int, int]]] = []

    def perform(self, node: int, eff: Effect, now: float) -> tuple[Any, float]:
        """Carry out a local effect; return its result and its simulated duration."""
        if self.shards is not None and isinstance(eff, Train | Compute | Report | Artifact):
            raise RunError(
                f"{type(eff).__name__} at once on every rank: a sharded run (--shard) needs "
                "trainings that it can defer (peers.compute: model, no method-side "
                "regularizer) and no Compute, Report or Artifact effects; run it without --shard"
            )
        if isinstance(eff, Train):
            return self.train(node, eff)
        if isinstance(eff, Compute):
            return self.compute(node, eff)
        if isinstance(eff, Evaluate):
            return self.evaluate(node, eff, now), 0.0
        if isinstance(eff, Report):
            return self.report(node, eff), 0.0
        if isinstance(eff, Artifact):
            self.artifact(node, eff)
            return None, 0.0
        if isinstance(eff, Log):
            self.log(node, eff, now)
            return None, 0.0
        raise TypeError(f"node {node} yielded {eff!r}, which is not an effect")

    def device(self, node: int) -> torch.device:
        return self._devices.get(node, self._server_device)

    def num_samples(self, node: int) -> int:
        return self.data.peers[node].num_train if node < len(self.data.peers) else 0

    def train(self, node: int, eff: Train) -> tuple[TrainResult, float]:
        """Run the training and return it with its simulated duration in seconds."""
        cfg, gen = self._train_setup(node, eff)
        result = self.trainer.train(
            eff.state, self.data.peers[node], cfg, gen, self.device(node), eff.regularizer
        )
        flops = self.trainer.compute_flops(result.train_samples, result.eval_samples)
        return result, self._seconds(node, flops, result.wall_s)

    def _train_setup(self, node: int, eff: Train) -> tuple[TrainConfig, torch.Generator]:
        """The training's config and its batch-order stream (peer, round, tag)."""
        if node >= len(self.data.peers):
            raise RuntimeError(f"node {self.topology.name(node)} holds no data and cannot train")
        cfg = self.train_cfg.with_overrides(eff.overrides)
        return cfg, torch_generator(self.seed, "train", node, eff.round, eff.tag)

    def batchable_seconds(self, node: int, eff: Train) -> float | None:
        """The simulated duration of a training that may be deferred, to run batched with
        others (``peers.batched``, a supported model and optimizer) or on another rank
        (:mod:`p2pfl.runtime.ranks`: any training but one whose regularizer is not FedProx's
        proximal term); ``None`` if it must run on its own, now.
        Either needs ``compute: model``: a duration known before the training runs."""
        population = self.population
        if population.compute != "model" or node >= len(self.data.peers):
            return None
        if self.ranks is None and not (population.batched and self._batchable(node, eff)):
            return None
        if self.ranks is not None and not isinstance(eff.regularizer, Proximal | None):
            return None  # it may keep figures its method reads (FedELMY's pool terms): trained
            # where the method runs, on every rank, not on one rank and exchanged without them
        return self._seconds(node, self._flops(node, eff), 0.0)

    def _batchable(self, node: int, eff: Train) -> bool:
        cfg = self.train_cfg.with_overrides(eff.overrides)
        device = self.device(node)
        # what supports() reads of a regularizer: whether there is one, and a proximal one
        key = (cfg, device, eff.regularizer is None, isinstance(eff.regularizer, Proximal))
        if (known := self._supported.get(key)) is None:
            module = self.trainer.module(device)
            known = self._supported[key] = batched.supports(module, cfg, eff.regularizer)
        return known

    def divisible(self, jobs: list[tuple[int, Train]]) -> bool:
        """Whether these deferred trainings are one batched group (two or more) in which a
        peer's bits do not depend on which peers share its call (:func:`batched.divisible`),
        in one process: then any parts of it train to the same bits as the whole
        (:class:`~p2pfl.runtime.train_batcher.TrainBatcher` computes such a group a chunk
        at a time)."""
        if (self.ranks is not None and self.shards is None) or len(jobs) < 2:
            return False
        if not self.population.batched:
            return False
        keys = set()
        for node, eff in jobs:
            if eff.regularizer is not None or not self._batchable(node, eff):
                return False
            keys.add((self.train_cfg.with_overrides(eff.overrides), self.device(node)))
            if len(keys) > 1:
                return False
        ((cfg, device),) = keys
        return self._divisible(cfg, device)

    def _divisible(self, cfg: TrainConfig, device: torch.device) -> bool:
        """:func:`batched.divisible` for a config and device, asked once."""
        key = ("divisible", cfg, device)
        if (known := self._supported.get(key)) is None:
            module = self.trainer.module(device)
            known = self._supported[key] = batched.divisible(module, cfg, device)
        return known

    def work(self, node: int, eff: Train) -> tuple[int, int]:
        """(samples trained, samples scored) by ``eff`` on ``node``, known before it runs."""
        return work(self.train_cfg.with_overrides(eff.overrides), self.data.peers[node])

    def shortest_training(self) -> float:
        """The least simulated duration of a training with the run's ``train:`` settings
        over the peers that have samples to train (``inf`` where none has); ``compute:
        model`` only, where a training's duration is known before it runs."""
        assert self.population.compute == "model"
        cfg = self.train_cfg
        return min(
            (
                self._seconds(node, self.trainer.compute_flops(*work(cfg, data)), 0.0)
                for node, data in enumerate(self.data.peers)
                if data.num_train
            ),
            default=math.inf,
        )

    def _flops(self, node: int, eff: Train) -> float:
        return self.trainer.compute_flops(*self.work(node, eff))

    def pool(self) -> batched.DataPool:
        """All peers' training data in one tensor (made on first use: simulation only)."""
        if self._pool is None:
            self._pool = batched.DataPool(self.data.peers)
        return self._pool

    def train_many(self, jobs: list[tuple[int, Train]]) -> list[TrainResult]:
        """Run deferred trainings (see :meth:`batchable_seconds`); over several ranks, each
        trains its share and every rank gets every result. The batched groups are formed
        before the split and go whole to one rank, unless a peer's bits do not depend on its
        group (:func:`batched.divisible`): then each rank batches its share of the group.
        Either way a training's bits never depend on the number of ranks."""
        units = self._units(jobs, divide=self.ranks is not None)
        if self.ranks is None:
            done = self._train_units(jobs, units)
            return [done[i] for i in range(len(jobs))]
        self.settle()
        if self.shards is not None:
            unit_owner = [self._owner(jobs, members) for _, members in units]
        else:
            unit_owner = self.ranks.owners(
                [sum(self._flops(*jobs[i]) for i in members) for _, members in units]
            )
        owner = [0] * len(jobs)
        for (_, members), rank in zip(units, unit_owner, strict=True):
            for i in members:
                owner[i] = rank
        mine = [u for u, rank in zip(units, unit_owner, strict=True) if rank == self.ranks.rank]
        starts = [eff.state for _, eff in jobs]
        trained = self._train_units(jobs, mine)
        return self.ranks.exchange(starts, owner, trained, states=self.shards is None)

    def _owner(self, jobs: list[tuple[int, Train]], members: list[int]) -> int:
        """The rank that trains a unit of a sharded run: its peers' owner (a batched group
        whose peers' bits depend on their group would span ranks: refused)."""
        assert self.shards is not None
        owners = {self.shards.owner(jobs[i][0]) for i in members}
        if len(owners) > 1:
            raise RunError(
                "a batched group whose peers' bits depend on the group (not "
                "batched.divisible) spans ranks: run it without --shard or without "
                "peers.batched"
            )
        return owners.pop()

    def _units(
        self, jobs: list[tuple[int, Train]], divide: bool = False
    ) -> list[tuple[_Group | None, list[int]]]:
        """The jobs in units of work: with ``peers.batched``, those sharing a config, a
        device and a proximal term's ``mu`` form one batched group (of two or more, or of
        one where :func:`batched.divisible` allows: then a peer's bits never depend on what
        trains beside it, so a population split over ranks trains to the same bits); every
        other job is a unit of its own (``None``: trained one by one). ``divide``: a group
        that :func:`batched.divisible` allows is one unit per member, still batched, for
        ranks to share (each rank's members of a group train as one call)."""
        groups: dict[_Group, list[int]] = {}
        alone: list[tuple[_Group | None, list[int]]] = []
        for i, (node, eff) in enumerate(jobs):
            if self.population.batched and self._batchable(node, eff):
                mu = eff.regularizer.mu if isinstance(eff.regularizer, Proximal) else None
                key = (self.train_cfg.with_overrides(eff.overrides), self.device(node), mu)
                groups.setdefault(key, []).append(i)
            else:
                alone.append((None, [i]))
        units: list[tuple[_Group | None, list[int]]] = []
        for key, m in groups.items():
            cfg, device, mu = key
            parts = mu is None and self._divisible(cfg, device)
            if len(m) < 2 and not parts:  # trained one by one
                alone.append((None, m))
            elif divide and parts:
                units += [(key, [i]) for i in m]
            else:
                units.append((key, m))
        return units + sorted(alone, key=lambda unit: unit[1][0])

    def _train_units(
        self, jobs: list[tuple[int, Train]], units: list[tuple[_Group | None, list[int]]]
    ) -> dict[int, TrainResult]:
        """Each unit's results by job index: a group as one batched computation, unless its
        loss is not finite somewhere (``batched.NonFinite``: then one by one, as a single)."""
        results: dict[int, TrainResult] = {}
        together: dict[_Group, list[int]] = {}  # a divided group's members here: one call
        for key, members in units:
            if key is not None:
                together.setdefault(key, []).extend(members)
        for key, members in [*together.items(), *(u for u in units if u[0] is None)]:
            if key is not None:
                results |= self._train_group(jobs, key, members)
            for i in members:
                if i not in results:
                    results[i] = self.train(*jobs[i])[0]
        return results

    def _train_group(
        self, jobs: list[tuple[int, Train]], key: _Group, members: list[int]
    ) -> dict[int, TrainResult]:
        cfg, device, _ = key
        batch = []
        for i in members:
            node, eff = jobs[i]
            proximal = eff.regularizer if isinstance(eff.regularizer, Proximal) else None
            generator = self._train_setup(node, eff)[1]
            batch.append(batched.Job(eff.state, node, generator, proximal))
        try:
            trained = batched.train_batched(
                self.trainer.module(device), self.pool(), batch, cfg, device
            )
        except batched.NonFinite:
            return {}
        self.trainer.busy_s += sum(r.wall_s for r in trained)
        return dict(zip(members, trained, strict=True))

    def compute(self, node: int, eff: Compute) -> tuple[Any, float]:
        """Run a local statistic on the node's data; return it with its simulated duration."""
        start = time.perf_counter()
        module = self.trainer.module(self.device(node))
        module.load_state_dict(eff.state)
        result = eff.fn(module, self.data.peers[node], self.device(node))
        wall = time.perf_counter() - start
        self.trainer.busy_s += wall
        samples = eff.passes * self.data.peers[node].num_train
        return result, self._seconds(node, 3.0 * self.trainer.forward_flops * samples, wall)

    def _seconds(self, node: int, flops: float, wall_s: float) -> float:
        """Simulated duration of a compute step on ``node`` (modelled or measured)."""
        profile = self.population.profiles[node]
        if self.population.compute == "measured":
            return wall_s / profile.speed
        return flops / (profile.flops_per_s or self.population.flops_per_s * profile.speed)

    def report(self, node: int, eff: Report) -> tuple[float, float]:
        """Score a baseline model and keep its accuracy for ``summary.json``."""
        x, y, device = self.data.test_x, self.data.test_y, self.device(node)
        if isinstance(eff.state, list):
            acc, loss = score_ensemble(
                self.trainer.module(device), eff.state, x, y, device, eff.weights
            )
        else:
            acc, loss = self.trainer.evaluate(eff.state, x, y, device)
        self.baseline(eff.name, acc)
        return acc, loss

    def artifact(self, node: int, eff: Artifact) -> None:
        """Write a matrix as CSV and heat-map into the run directory."""
        matrix = eff.matrix.detach().cpu().numpy()
        title = eff.title or f"{eff.name} ({self.topology.name(node)})"
        self.save_artifact(eff.name, matrix.tolist(), str(matrix.dtype), title)

    def _save_artifact(self, name: str, values: list[Any], dtype: str, title: str) -> None:
        if self.out is None:
            return
        matrix = np.array(values, dtype=dtype)
        save_matrix_csv(matrix, self.out / f"{name}.csv")
        save_heatmap(matrix, self.out / f"{name}.png", title, "column", "row")

    def evaluate(self, node: int, eff: Evaluate, now: float) -> tuple[float, float] | None:
        """Score on the global test set when the round is due (``eval.every``, and the last)
        and the peer is in ``eval.peers``' sample."""
        if eff.round % self.eval_every and eff.round != self.total_rounds:
            return None
        if self.scored is not None and node < self.topology.num_peers and node not in self.scored:
            return None
        name = self.topology.name(node)
        if self.ranks is not None:  # no method uses the scores: exchange them at the next flush
            if self.shards is None:  # each rank scores a share: hold a copy to score then
                held: State | tuple[float, float] | None = {
                    k: v.clone() for k, v in eff.state.items()
                }
                bound = HELD_EVALS * self.ranks.world
            else:  # only the owner holds the model: it scores it now, the others wait
                held = self._score(node, eff.state) if self.shards.mine(node) else None
                bound = HELD_SCORES
            self._evals.append((node, held))
            self._log(now, eff.round, name, "accuracy", (len(self._evals) - 1, 0))
            self._log(now, eff.round, name, "loss", (len(self._evals) - 1, 1))
            if len(self._evals) >= bound:
                self.settle()  # every rank at this same point: what is held stays bounded
            return None
        acc, loss = self._score(node, eff.state)
        self._log(now, eff.round, name, "accuracy", acc)
        self._log(now, eff.round, name, "loss", loss)
        return acc, loss

    def probe(self, now: float, round: int, state: State) -> float:
        """Score the run's model (``eval.every_s``) and log it as the ``run`` rows; return
        its accuracy."""
        acc, loss = self.trainer.evaluate(
            state, self.data.test_x, self.data.test_y, self._server_device
        )
        self._log(now, round, "run", "accuracy", acc)
        self._log(now, round, "run", "loss", loss)
        return acc

    def _score(self, node: int, state: State) -> tuple[float, float]:
        return self.trainer.evaluate(state, self.data.test_x, self.data.test_y, self.device(node))

    def log(self, node: int, eff: Log, now: float) -> None:
        self._log(now, eff.round, self.topology.name(node), eff.metric, eff.value)

    def _log(
        self, now: float, round: int, peer: str, metric: str, value: float | tuple[int, int]
    ) -> None:
        """Write a metric row, or hold it (in order) behind deferred evaluations; a pair
        ``(i, k)`` stands for the ``k``-th score of deferred evaluation ``i``."""
        if self._evals:
            self._rows.append((now, round, peer, metric, value))
        else:
            assert not isinstance(value, tuple)
            self.metrics.log(now, round, peer, metric, value)

    def settle(self, alone: bool = False) -> None:
        """Run the deferred evaluations, split across the ranks, and write the rows held
        behind them: ``metrics.csv`` reads as if each had been scored when it was asked.
        ``alone``: score them all here, with no collective (a run that failed: another rank
        may be gone), the same scores."""
        if self.ranks is None or not self._evals:
            return
        evals = self._evals

        def scored(i: int) -> tuple[float, float]:
            node, held = evals[i]
            assert held is not None, "a sharded rank has only its own peers' scores"
            return held if isinstance(held, tuple) else self._score(node, held)

        scores: Sequence[Sequence[float]] = (
            [scored(i) for i in range(len(evals))] if alone
            else self.ranks.spread(
                len(evals), 2, scored,
                [self.shards.owner(n) for n, _ in evals] if self.shards else None,
            )
        )  # fmt: skip
        self._evals = []
        for now, round, peer, metric, value in self._rows:
            if isinstance(value, tuple):
                value = scores[value[0]][value[1]]
            self.metrics.log(now, round, peer, metric, value)
        self._rows = []
