"""Deferred training in the simulation: trainings that overlap in simulated time run batched.

With ``compute: model`` a training's simulated duration is known before it runs (FLOPs over
speed), and its result can only be seen by the node that asked for it, which is blocked
until the training ends. So the runtime can charge the time at once and compute the result
later: a deferred training waits on its own timeout like any other, and the first one to
end computes every training still pending, as one batched call. Peers training in the same
simulated window (a round of FedAvg, every peer of DFedAvgM) thus train together, the clock
still charges each its own time, and the events happen in the same order as without it.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

from p2pfl.learning.training import TrainResult
from p2pfl.methods.effects import Train
from p2pfl.runtime.worker import Worker


@dataclass
class _Pending:
    node: int
    train: Train
    result: TrainResult | None = None


class TrainBatcher:
    """Holds deferred trainings until one of them ends, then runs them all together."""

    def __init__(self, env: simpy.Environment, worker: Worker) -> None:
        self.env = env
        self.worker = worker
        self.pending: list[_Pending] = []

    def train(
        self, node: int, eff: Train, seconds: float
    ) -> Generator[simpy.Event, Any, TrainResult]:
        """Charge ``seconds`` of simulated time, then return the training's result."""
        job = _Pending(node, eff)
        self.pending.append(job)
        yield self.env.timeout(seconds)
        if job.result is None:
            self._flush()
        assert job.result is not None
        return job.result

    def _flush(self) -> None:
        jobs, self.pending = self.pending, []
        results = self.worker.train_many([(j.node, j.train) for j in jobs])
        for job, result in zip(jobs, results, strict=True):
            job.result = result
