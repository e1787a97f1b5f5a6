"""A simulation spread over ranks of ``torch.distributed``: every core, GPU or machine trains.

Every rank runs the same SimPy simulation (cheap and deterministic). With ``compute: model``
a training's simulated duration is known before it runs, so the runtime defers trainings
(:mod:`p2pfl.runtime.train_batcher`); at each flush the pending ones are split across the
ranks by a deterministic rule (longest first, to the least-loaded rank, by the FLOPs the
compute model charges), each rank trains its share with the unchanged single-peer code, and
the trained states are all-gathered in rank order — copied, never reduced, so no sum changes
order. Every rank then holds every result, and the simulations stay in step. Rank 0 writes
the outputs. The clock and the ledger never depend on wall time, so a run gives the same
bytes on 1, 2 or 4 ranks (``tests/test_ranks.py``).

States travel as raw bytes laid out by the state the training started from (same keys,
shapes and dtypes), between processes of one run: nothing is pickled.

``p2pfl run EXP --workers N`` starts N local ranks itself (gloo on loopback); ``torchrun``
sets the same environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) for
ranks on several machines.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from p2pfl.core.errors import RunError
from p2pfl.learning.state import State
from p2pfl.learning.training import TrainResult

TIMEOUT = timedelta(minutes=10)
"""How long a rank waits for the others at a flush: the imbalance of one flush's shares."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in a run spread over ``world`` ranks."""

    rank: int
    world: int
    threads_before: int = 0  # the thread count that ``close`` gives back (0: unchanged)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, threads: int = 0) -> Ranks | None:
        """Join the run that ``torchrun`` or ``--workers`` described in ``env`` (``RANK``,
        ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), with ``threads`` threads if
        given; ``None`` for one process."""
        world = int(env.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        rank = int(env["RANK"])
        if not dist.is_initialized():
            # torchrun's agent may hold the store itself: its ranks join through env://
            address = (
                None if env is os.environ else f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
            )
            try:
                dist.init_process_group(
                    "gloo", init_method=address, rank=rank, world_size=world, timeout=TIMEOUT
                )
            except (RuntimeError, ValueError) as e:  # gloo's errors are RuntimeErrors
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RunError(
                    f"rank {rank} of {world} could not reach the others ({reason[:200]}); "
                    "on several hosts, set GLOO_SOCKET_IFNAME to the interface between them"
                ) from None
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        return cls(rank, world, before if threads else 0)

    def owners(self, costs: list[float]) -> list[int]:
        """The rank that trains each job: longest first, each to the least-loaded rank
        (the lower rank on a tie) — the same answer on every rank."""
        owner = [0] * len(costs)
        load = [(0.0, r) for r in range(self.world)]
        for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
            total, r = heapq.heappop(load)
            owner[job] = r
            heapq.heappush(load, (total + costs[job], r))
        return owner

    def exchange(
        self, starts: list[State], owner: list[int], mine: dict[int, TrainResult]
    ) -> list[TrainResult]:
        """Every job's result on every rank: ``mine`` holds this rank's jobs; each job's
        trained state has the layout of the state it started from (``starts``)."""
        sizes = [sum(t.numel() * t.element_size() for t in s.values()) for s in starts]
        per_rank = [
            sum(sizes[j] for j in range(len(starts)) if owner[j] == r) for r in range(self.world)
        ]
        payload = torch.zeros(max(per_rank), dtype=torch.uint8)
        meta = torch.zeros(len(starts), 5, dtype=torch.float64)
        offset = 0
        for j in sorted(mine):
            for t in mine[j].state.values():
                raw = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
                payload[offset : offset + raw.numel()] = raw
                offset += raw.numel()
            done = mine[j]
            meta[j] = torch.tensor(
                [done.val_accuracy, done.train_samples, done.eval_samples, done.wall_s,
                 done.skipped_steps],
                dtype=torch.float64,
            )  # fmt: skip
        payloads = [torch.empty_like(payload) for _ in range(self.world)]
        metas = [torch.empty_like(meta) for _ in range(self.world)]
        dist.all_gather(payloads, payload)
        dist.all_gather(metas, meta)
        offsets = [0] * self.world
        results = []
        for j, start in enumerate(starts):
            if j in mine:
                results.append(mine[j])
                continue
            r = owner[j]
            state: State = {}
            for key, t in start.items():
                n = t.numel() * t.element_size()
                raw = payloads[r][offsets[r] : offsets[r] + n]
                state[key] = raw.clone().view(t.dtype).view(t.shape).to(t.device)
                offsets[r] += n
            acc, trained, scored, wall, skipped = metas[r][j].tolist()
            results.append(TrainResult(state, acc, int(trained), int(scored), wall, int(skipped)))
        return results

    def spread(
        self, n: int, width: int, job: Callable[[int], tuple[float, ...]]
    ) -> list[list[float]]:
        """Run ``n`` jobs of equal cost that each return ``width`` floats (evaluations),
        split across the ranks; every job's floats on every rank."""
        owner = self.owners([1.0] * n)
        values = torch.zeros(n, width, dtype=torch.float64)
        for j in range(n):
            if owner[j] == self.rank:
                values[j] = torch.tensor(job(j), dtype=torch.float64)
        gathered = [torch.empty_like(values) for _ in range(self.world)]
        dist.all_gather(gathered, values)
        return [gathered[owner[j]][j].tolist() for j in range(n)]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before:
            torch.set_num_threads(self.threads_before)
