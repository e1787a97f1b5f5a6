"""Local effects shared by every runtime: training, statistics, evaluation, reports.

A runtime owns the clock and the network (``Send``, ``Recv``, ``Finish``); the worker
carries out every other effect with :meth:`Worker.perform`, and says how many simulated
seconds each piece of compute costs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from p2pfl.core.seeding import torch_generator
from p2pfl.data.federated import FederatedData
from p2pfl.learning import batched
from p2pfl.learning.ensemble import score_ensemble
from p2pfl.learning.training import TrainConfig, Trainer, TrainResult, resolve_device, work
from p2pfl.methods.effects import Artifact, Compute, Effect, Evaluate, Log, Report, Train
from p2pfl.network.peers import Population
from p2pfl.network.topology import Topology
from p2pfl.reporting.heatmap import save_heatmap, save_matrix_csv
from p2pfl.reporting.reporters import Reporter


class Worker:
    """Carries out the local effects of any node of one run."""

    def __init__(
        self,
        trainer: Trainer,
        data: FederatedData,
        train_cfg: TrainConfig,
        population: Population,
        topology: Topology,
        seed: int,
        metrics: Reporter,
        eval_every: int,
        total_rounds: int,
        out: Path | None = None,
        progress: bool = False,
    ) -> None:
        self.trainer = trainer
        self.data = data
        self.train_cfg = train_cfg
        self.population = population
        self.topology = topology
        self.seed = seed
        self.metrics = metrics
        self.eval_every = eval_every
        self.total_rounds = total_rounds
        self.out = out
        self.baselines: dict[str, float] = {}
        self._bar = tqdm(total=total_rounds, unit="round", disable=not progress, leave=False)
        self._devices = {
            p: resolve_device(prof.device) for p, prof in enumerate(population.profiles)
        }
        self._server_device = resolve_device(population.profiles[0].device)
        self._pool: batched.DataPool | None = None

    def perform(self, node: int, eff: Effect, now: float) -> tuple[Any, float]:
        """Carry out a local effect; return its result and its simulated duration."""
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
        """The simulated duration of a training that may be deferred and run batched with
        others (``peers.batched``, ``compute: model``, a supported model and optimizer);
        ``None`` if it must run on its own, now."""
        population = self.population
        if not population.batched or population.compute != "model" or node >= len(self.data.peers):
            return None
        cfg = self.train_cfg.with_overrides(eff.overrides)
        if not batched.supports(self.trainer.module(self.device(node)), cfg, eff.regularizer):
            return None
        flops = self.trainer.compute_flops(*work(cfg, self.data.peers[node]))
        return self._seconds(node, flops, 0.0)

    def pool(self) -> batched.DataPool:
        """All peers' training data in one tensor (made on first use: simulation only)."""
        if self._pool is None:
            self._pool = batched.DataPool(self.data.peers)
        return self._pool

    def train_many(self, jobs: list[tuple[int, Train]]) -> list[TrainResult]:
        """Run deferred trainings (see :meth:`batchable_seconds`): those sharing a config
        and a device as one batched computation, a lone one as usual."""
        groups: dict[tuple[TrainConfig, torch.device], list[int]] = {}
        for i, (node, eff) in enumerate(jobs):
            key = (self.train_cfg.with_overrides(eff.overrides), self.device(node))
            groups.setdefault(key, []).append(i)
        results: list[TrainResult | None] = [None] * len(jobs)
        for (cfg, device), members in groups.items():
            if len(members) == 1:
                results[members[0]] = self.train(*jobs[members[0]])[0]
                continue
            batch = []
            for i in members:
                node, eff = jobs[i]
                batch.append(batched.Job(eff.state, node, self._train_setup(node, eff)[1]))
            trained = batched.train_batched(
                self.trainer.module(device), self.pool(), batch, cfg, device
            )
            self.trainer.busy_s += sum(r.wall_s for r in trained)
            for i, result in zip(members, trained, strict=True):
                results[i] = result
        return [r for r in results if r is not None]

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
        speed = self.population.profiles[node].speed
        if self.population.compute == "measured":
            return wall_s / speed
        return flops / (self.population.flops_per_s * speed)

    def report(self, node: int, eff: Report) -> tuple[float, float]:
        """Score a baseline model and keep its accuracy for ``summary.json``."""
        x, y, device = self.data.test_x, self.data.test_y, self.device(node)
        if isinstance(eff.state, list):
            acc, loss = score_ensemble(
                self.trainer.module(device), eff.state, x, y, device, eff.weights
            )
        else:
            acc, loss = self.trainer.evaluate(eff.state, x, y, device)
        self.baselines[eff.name] = acc
        return acc, loss

    def artifact(self, node: int, eff: Artifact) -> None:
        """Write a matrix as CSV and heat-map into the run directory."""
        if self.out is None:
            return
        matrix = eff.matrix.detach().cpu().numpy()
        save_matrix_csv(matrix, self.out / f"{eff.name}.csv")
        title = eff.title or f"{eff.name} ({self.topology.name(node)})"
        save_heatmap(matrix, self.out / f"{eff.name}.png", title, "column", "row")

    def evaluate(self, node: int, eff: Evaluate, now: float) -> tuple[float, float] | None:
        """Score on the global test set when the round is due (``eval.every``, and the last)."""
        if eff.round % self.eval_every and eff.round != self.total_rounds:
            return None
        acc, loss = self.trainer.evaluate(
            eff.state, self.data.test_x, self.data.test_y, self.device(node)
        )
        name = self.topology.name(node)
        self.metrics.log(now, eff.round, name, "accuracy", acc)
        self.metrics.log(now, eff.round, name, "loss", loss)
        self._advance(eff.round)
        return acc, loss

    def log(self, node: int, eff: Log, now: float) -> None:
        self.metrics.log(now, eff.round, self.topology.name(node), eff.metric, eff.value)

    def _advance(self, round: int) -> None:
        if round > self._bar.n:
            self._bar.update(round - self._bar.n)

    def close(self) -> None:
        self._bar.close()
