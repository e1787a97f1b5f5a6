"""A simulation spread over ranks of ``torch.distributed``: every core, GPU or machine trains.

Every rank runs the same SimPy simulation (cheap and deterministic). With ``compute: model``
a training's simulated duration is known before it runs, so the runtime defers trainings
(:mod:`p2pfl.runtime.train_batcher`); at each flush the pending ones are split across the
ranks by a deterministic rule (longest first, to the least-loaded rank, by the FLOPs the
compute model charges), each rank trains its share with the unchanged single-peer code, and
every rank broadcasts its trained states to the others, in rank order — copied, never
reduced, so no sum changes order. Every rank then holds every result, and the simulations
stay in step. Rank 0 writes the outputs. The clock and the ledger never depend on wall
time, so a run gives the same bytes on 1, 2 or 4 ranks (``tests/test_ranks.py``).

States travel as raw bytes laid out by the state the training started from (same keys,
shapes and dtypes), between processes of one run: nothing is pickled.

``p2pfl run EXP --workers N`` starts N local ranks itself (gloo on loopback); ``torchrun``
sets the same environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) for
ranks on several machines. On a host with several GPUs each rank takes its own
(:meth:`Ranks.take_gpu`); the states still travel through gloo, from the CPU, where every
peer's state lives between its turns.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from p2pfl.core.errors import RankFailed, RunError
from p2pfl.learning.state import State, ghost, state_bytes
from p2pfl.learning.training import TrainResult
from p2pfl.runtime.children import DEATH_SEEN_S, JOIN_ENV, join_timeout

_FIGURES = 5
"""Numbers sent beside each trained state: its validation accuracy, samples trained and
scored, wall seconds and skipped steps (float64)."""
_FIGURE_BYTES = _FIGURES * 8

TIMEOUT = timedelta(minutes=10)
"""How long a rank waits for the others at a flush: the imbalance of one flush's shares."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in a run spread over ``world`` ranks."""

    rank: int
    world: int
    threads_before: int = 0  # the thread count that ``close`` gives back (0: unchanged)
    local_rank: int = 0  # among this host's ranks: torchrun's LOCAL_RANK, else the rank
    death: Callable[[float], str | None] | None = field(default=None, compare=False)
    """Rank 0 of ``--workers``: the line naming a rank that died, waiting up to the given
    seconds for it (a dead rank's connections close before its exit is seen)."""
    sharded: bool = False
    """``--shard``: each rank holds only its own peers' models (:mod:`p2pfl.runtime.shards`)."""
    events: bool = False
    """``--shard-events``: each rank also runs only its own peers' events
    (:mod:`p2pfl.runtime.windows`)."""

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] = os.environ, threads: int = 0, shard: str | None = None
    ) -> Ranks | None:
        """Join the run that ``torchrun`` or ``--workers`` described in ``env`` (``RANK``,
        ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), with ``threads`` threads if
        given; ``None`` for one process."""
        world = int(env.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        rank = int(env["RANK"])
        if not dist.is_initialized():
            _join(env, rank, world)
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        local = int(env.get("LOCAL_RANK", rank))
        sharded, events = shard is not None, shard == "shard-events"
        return cls(rank, world, before if threads else 0, local, sharded=sharded, events=events)

    def owner(self, node: int, peers: int) -> int:
        """The rank that holds ``node``'s model in a sharded run: the peers in contiguous
        blocks, in order (a mean in peer order is then a chain from rank 0 up); a node that
        is not a peer (the server) on rank 0."""
        return node * self.world // peers if node < peers else 0

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
        self,
        starts: list[State],
        owner: list[int],
        mine: dict[int, TrainResult],
        states: bool = True,
    ) -> list[TrainResult]:
        """Every job's result on every rank: ``mine`` holds this rank's jobs; each job's
        trained state has the layout of the state it started from (``starts``).
        ``states=False`` (a sharded run): only the figures travel; another rank's trained
        state is a ghost (``meta`` tensors: its layout, no bytes).

        Each rank broadcasts its jobs' figures and raw states in turn, in rank order; every
        rank knows every buffer's size from ``owner``, so nothing is padded. On loopback,
        gloo's two broadcasts of 3.2 MB took 1.9 ms where its all-gather took 4.8 ms
        (docs/performance.md, "Race against Flower")."""
        jobs = [[j for j in range(len(starts)) if owner[j] == r] for r in range(self.world)]
        buffers = []
        for r, js in enumerate(jobs):
            size = len(js) * _FIGURE_BYTES
            if states:
                size += sum(state_bytes(starts[j]) for j in js)
            if r == self.rank:
                buffers.append(_pack([mine[j] for j in js], size, states))
            else:
                buffers.append(torch.empty(size, dtype=torch.uint8))
        with self.together():
            for r, buffer in enumerate(buffers):
                if len(buffer):
                    dist.broadcast(buffer, src=r)
        results = dict(mine)
        for r, js in enumerate(jobs):
            if r == self.rank or not js:
                continue
            head = len(js) * _FIGURE_BYTES
            figures = buffers[r][:head].view(torch.float64).view(len(js), _FIGURES).tolist()
            offset = head
            for j, (acc, trained, scored, wall, skipped) in zip(js, figures, strict=True):
                if states:
                    raw, offset = read_raw(buffers[r], offset, starts[j])
                    state = {k: v.clone().to(starts[j][k].device) for k, v in raw.items()}
                else:
                    state = ghost(starts[j])
                results[j] = TrainResult(state, acc, int(trained), int(scored), wall, int(skipped))
        return [results[j] for j in range(len(starts))]

    def spread(
        self,
        n: int,
        width: int,
        job: Callable[[int], tuple[float, ...]],
        owner: list[int] | None = None,
    ) -> list[list[float]]:
        """Run ``n`` jobs of equal cost that each return ``width`` floats (evaluations),
        split across the ranks (or each on its ``owner``); every job's floats on every
        rank."""
        owner = self.owners([1.0] * n) if owner is None else owner
        values = torch.zeros(n, width, dtype=torch.float64)
        for j in range(n):
            if owner[j] == self.rank:
                values[j] = torch.tensor(job(j), dtype=torch.float64)
        gathered = [torch.empty_like(values) for _ in range(self.world)]
        with self.together():
            dist.all_gather(gathered, values)
        return [gathered[owner[j]][j].tolist() for j in range(n)]

    def agree(self, fingerprint: bytes) -> None:
        """Check that every rank runs the same experiment (``fingerprint``: its resolved
        config and partition), before any training is exchanged: ranks that ``torchrun``
        or a user started with another file, ``--set`` or dataset would mix their
        trainings into rank 0's outputs, or wait for each other until the timeout."""
        mine = torch.frombuffer(bytearray(hashlib.sha256(fingerprint).digest()), dtype=torch.uint8)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        with self.together():
            dist.all_gather(everyone, mine)
        differ = [r for r, theirs in enumerate(everyone) if not torch.equal(theirs, everyone[0])]
        if differ:
            ranks = ", ".join(map(str, differ))
            raise RunError(
                f"rank(s) {ranks} run another experiment than rank 0 (config or data differ): "
                "start every rank with the same file, --set, --seed and dataset"
            )

    @contextmanager
    def together(self) -> Iterator[None]:
        """A collective call: where another rank is gone, a RunError that says which (or
        gloo's reason), so the run's summary names the cause."""
        try:
            yield
        except RuntimeError as e:  # gloo's errors are RuntimeErrors
            why = self.death(DEATH_SEEN_S) if self.death is not None else None
            if why:
                raise RankFailed(why) from None
            raise RunError(f"rank {self.rank} lost the others ({_reason(e)})") from None

    def take_gpu(self, devices: set[torch.device]) -> None:
        """One rank per GPU: where the peers train on plain ``cuda`` and this host has
        several GPUs, this rank's ``cuda`` becomes GPU ``local_rank`` mod (GPUs). A peer on
        ``cuda:N`` stays there. Call before anything is put on CUDA."""
        if torch.device("cuda") in devices and (count := torch.cuda.device_count()) > 1:
            torch.cuda.set_device(self.local_rank % count)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before:
            torch.set_num_threads(self.threads_before)


def _join(env: Mapping[str, str], rank: int, world: int) -> None:
    """Join the others, or end within the join bound (:func:`join_timeout`) with one line:
    a rank above 0 first waits for rank 0's store to listen, then every rank waits for the
    rest; the collectives' own timeout comes after."""
    join = join_timeout()
    deadline = time.monotonic() + join
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    late = f"rank {rank} of {world} could not join the others within {join:g} s ({JOIN_ENV})"
    if rank > 0 and not _listening(host, port, deadline):
        raise RunError(f"{late}: no rank 0 answered at {host}:{port}")
    # torchrun's agent may hold the store itself: its ranks join through env://
    address = None if env is os.environ else f"tcp://{host}:{port}"
    wait = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    try:
        with _cpp_logs_held():
            dist.init_process_group(
                "gloo", init_method=address, rank=rank, world_size=world, timeout=wait
            )
    except dist.DistError as e:  # the rendezvous: a rank never came, or rank 0 gave up
        raise RunError(f"{late}: {_reason(e)}") from None
    except (RuntimeError, ValueError) as e:  # gloo's errors are RuntimeErrors
        raise RunError(
            f"rank {rank} of {world} could not reach the others ({_reason(e)}); "
            "on several hosts, set GLOO_SOCKET_IFNAME to the interface between them"
        ) from None
    if hasattr(dist, "set_timeout"):  # not in torch 2.11: its collectives keep the join bound
        dist.set_timeout(TIMEOUT)


@contextmanager
def _cpp_logs_held() -> Iterator[None]:
    """c10d's C++ logs (warnings with stack traces, written to file descriptor 2 while a
    rank waits for the others) held back: written after a join that succeeds, dropped after
    one that fails, whose one error line names the cause."""
    sys.stderr.flush()
    stderr = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(stderr, 2)
            os.close(stderr)
        held.seek(0)
        os.write(2, held.read())


def _listening(host: str, port: int, deadline: float) -> bool:
    """Whether ``host:port`` accepts a connection before ``deadline`` (monotonic seconds)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() + 0.2 >= deadline:
                return False
            time.sleep(0.2)


def _reason(e: Exception) -> str:
    """The first line of gloo's error (its messages run to many lines), at most 200 chars."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _pack(done: list[TrainResult], size: int, states: bool = True) -> torch.Tensor:
    """``done``'s figures (float64), then (``states``) their states' raw bytes, in one
    ``size``-byte buffer."""
    head = len(done) * _FIGURE_BYTES
    held = head + (sum(state_bytes(d.state) for d in done) if states else 0)
    if held != size:  # a method's training changed its state's layout
        raise RunError(f"trained states hold {held - head} bytes, their start states {size - head}")
    buffer = torch.empty(size, dtype=torch.uint8)
    if done:
        figures = [
            [d.val_accuracy, d.train_samples, d.eval_samples, d.wall_s, d.skipped_steps]
            for d in done
        ]
        buffer[:head].view(torch.float64).view(len(done), _FIGURES)[:] = torch.tensor(
            figures, dtype=torch.float64
        )
    if states:
        write_raw((t for d in done for t in d.state.values()), buffer, head)
    return buffer


def write_raw(tensors: Iterable[torch.Tensor], buffer: torch.Tensor, offset: int = 0) -> int:
    """Copy ``tensors``' raw bytes into ``buffer``, one after the other from ``offset``;
    the offset after the last."""
    for t in tensors:
        raw = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        buffer[offset : offset + raw.numel()] = raw
        offset += raw.numel()
    return offset


def read_raw(buffer: torch.Tensor, offset: int, layout: State) -> tuple[State, int]:
    """Views of ``buffer``'s bytes from ``offset`` as tensors laid out as ``layout`` (its
    keys, dtypes and shapes, in order: what :func:`write_raw` wrote); the offset after."""
    state: State = {}
    for key, t in layout.items():
        n = t.numel() * t.element_size()
        state[key] = buffer[offset : offset + n].view(t.dtype).view(t.shape)
        offset += n
    return state, offset
