"""Deferred training in the simulation: trainings that overlap in simulated time run batched.

With ``compute: model`` a training's simulated duration is known before it runs (FLOPs over
speed), and its result can only be seen by the node that asked for it, which is blocked
until the training ends. So the runtime can charge the time at once and compute the result
later: a deferred training waits on its own timeout like any other, and the first one to
end computes every training still pending, as one batched call. Peers training in the same
simulated window (a round of FedAvg, every peer of DFedAvgM) thus train together, the clock
still charges each its own time, and the events happen in the same order as without it.

A large population pending at once (10⁴ peers of DFedAvgM) would hold every peer's start
and trained models together, twice the population's states. Where a peer's trained bits do
not depend on which peers share its batched call (:meth:`Worker.divisible`: one group on the
hand-written MLP path, on the CPU), the pending trainings form a *cohort* when the first
ends, as before, but are computed ``CHUNK`` at a time, those that end soonest first, each
chunk when its first training ends: a peer's start model is let go (it sends, mixes) before
most others are trained. Same bits, same event order; only when the compute happens moves.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import simpy

from p2pfl.learning.training import TrainResult
from p2pfl.methods.effects import Train
from p2pfl.runtime.worker import Worker

CHUNK = 128
"""Trainings of a divisible cohort computed per call (a lone one too trains batched, to the
same bits: :meth:`Worker._units`)."""


TRIM_JOBS = 1000
"""A cohort this large first hands the heap's free pages back (glibc's ``malloc_trim``): the
models a round freed would otherwise stay resident beside the next round's, and set the
peak (a 1,000-peer DFedAvgM run: 1,501 MiB at its peak instead of 1,599; a few ms per
cohort)."""


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None


_TRIM = _malloc_trim()


@dataclass(eq=False)
class _Pending:
    node: int
    train: Train
    end: float
    result: TrainResult | None = None
    cohort: deque[_Pending] | None = None  # the divisible cohort it waits in, if any


class TrainBatcher:
    """Holds deferred trainings until one of them ends, then runs them together."""

    def __init__(self, env: simpy.Environment, worker: Worker) -> None:
        self.env = env
        self.worker = worker
        self.pending: list[_Pending] = []

    def start(self, node: int, eff: Train, seconds: float) -> tuple[_Pending, simpy.Event]:
        """Defer a training that ends ``seconds`` from now: its job, and the timeout its
        node waits on (scheduled last), after which :meth:`result` gives its result."""
        job = _Pending(node, eff, self.env.now + seconds)
        self.pending.append(job)
        return job, self.env.timeout(seconds)

    def result(self, job: _Pending) -> TrainResult:
        """A deferred training's result, once its timeout has passed."""
        if job.result is None:
            if job.cohort is None:
                self._flush()
            if job.result is None:
                self._chunk(job)
        assert job.result is not None
        return job.result

    def _flush(self) -> None:
        """Every pending training: at once, or as a cohort computed chunk by chunk."""
        jobs, self.pending = self.pending, []
        if _TRIM is not None and len(jobs) >= TRIM_JOBS:
            _TRIM(0)  # the last round's freed models back to the system before this one's
        if self.worker.divisible([(j.node, j.train) for j in jobs]):
            # by end, then as they were asked for: the order SimPy ends their timeouts in
            cohort = deque(sorted(jobs, key=lambda j: j.end))
            for j in cohort:
                j.cohort = cohort
            return
        self._run(jobs)

    def _chunk(self, job: _Pending) -> None:
        """``job``, the trainings of its cohort before it (only a crashed peer's, never
        asked for, can lie there) and those that end soonest after it: ``CHUNK`` in all, or
        over sharded ranks ``CHUNK`` of each rank's, so that every rank trains at once (a
        rank's peers are a contiguous block, which the soonest ``CHUNK`` would mostly fall
        in)."""
        cohort = job.cohort
        assert cohort is not None
        shards = self.worker.shards
        owner = shards.owner if shards is not None else lambda node: 0
        taking = shards.ranks.world if shards is not None else 1  # ranks short of CHUNK
        taken: dict[int, int] = {}
        chunk: list[_Pending] = []
        passed: list[_Pending] = []  # a rank's beyond its CHUNK: left for a later chunk
        found = False
        while cohort and not (found and taking == 0):
            j = cohort.popleft()
            rank = owner(j.node)
            n = taken.get(rank, 0)
            if found and n >= CHUNK:
                passed.append(j)
                continue
            chunk.append(j)
            taken[rank] = n + 1
            if n + 1 == CHUNK:
                taking -= 1
            found = found or j is job
        cohort.extendleft(reversed(passed))
        self._run(chunk)

    def _run(self, jobs: list[_Pending]) -> None:
        results = self.worker.train_many([(j.node, j.train) for j in jobs])
        for job, result in zip(jobs, results, strict=True):
            job.result = result
            job.cohort = None
