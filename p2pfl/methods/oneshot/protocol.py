"""The one-shot protocol and the base of the one-shot merges (FedFisher, Alg. 1 and §4).

Every peer trains once from the shared init, computes the statistics its aggregator needs
(:mod:`p2pfl.methods.oneshot.statistics`) on its own training data, and uploads once: its
model with its sample count and one message per kind of statistic
(:mod:`p2pfl.methods.oneshot.payload`), to the star's centre or to every other peer of a
mesh (:mod:`p2pfl.methods.oneshot.placement`). A method is a *merge*: what it needs and the
candidate models it builds from the uploads. :class:`OneShot` is itself the one-shot FedAvg
merge (Σ p_i w_i, p_i = n_i / N); FedFisher, Fisher merging and RegMean subclass it.

Model selection (``select``). A merge may offer several candidates (FedFisher's
checkpoints, RegMean's off-diagonal scales). ``final`` takes the last one. ``val`` scores
every candidate on the peers' own validation splits and keeps the best pooled accuracy:
only correct-answer counts travel (``control`` messages). Under ``mesh`` every peer holds
the candidates already; under ``star`` the centre sends them to the peers to be scored.

Message rounds are phases: 1 the upload, 2 the validation exchange, 3 the result (star).
Baselines (``baselines``) are merges of the same uploads, reported under ``baselines`` in
summary.json with ``Report``; their statistics are uploaded too (and counted).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterator
from dataclasses import dataclass, fields
from functools import cached_property, partial
from typing import Any, ClassVar, Literal, cast

import torch
from torch import Tensor, nn

from p2pfl.core.errors import ConfigError
from p2pfl.data.federated import FederatedData
from p2pfl.learning.curvature import covered_layers
from p2pfl.learning.state import average_states
from p2pfl.methods.base import METHODS, NodeContext
from p2pfl.methods.effects import (
    Behaviour,
    Compute,
    Effect,
    Evaluate,
    Finish,
    Log,
    Recv,
    Report,
    Send,
    State,
    Train,
)
from p2pfl.methods.oneshot.payload import (
    Part,
    Upload,
    as_received,
    read_uploads,
    stack,
    unstack,
    upload_parts,
)
from p2pfl.methods.oneshot.placement import UploadOnce, star_centre
from p2pfl.methods.oneshot.statistics import (
    StatisticsByKind,
    count_correct,
    local_statistics,
    shaped_statistics,
)
from p2pfl.network.message import Message
from p2pfl.network.plan import Plan, Transfer

BASELINES = ("fedavg", "fisher_merge", "regmean", "fedfisher_diag", "fedfisher_kfac")
UPLOAD, VALIDATION, RESULT = 1, 2, 3


def shares(uploads: list[Upload]) -> list[float]:
    """p_i = n_i / N."""
    total = sum(u.num_samples for u in uploads)
    return [u.num_samples / total for u in uploads]


def fedavg(uploads: list[Upload]) -> State:
    """Σ p_i w_i (accumulated in float64)."""
    return average_states([u.state for u in uploads], [float(u.num_samples) for u in uploads])


@dataclass(kw_only=True, eq=False)
class OneShot(UploadOnce):
    """One-shot FedAvg; the base of the one-shot merges (see the module docstring).

    Args:
        compress: 16-bit models and diagonal Fishers; 9-bit low-rank K-FAC factors and Grams.
        triangle: send only the upper triangle of raw K-FAC factors and Grams.
        select: the output among the candidates: ``val`` (best pooled peer-validation accuracy) or
            ``final`` (the last).
        baselines: merges of the same uploads reported in ``summary.json`` ``baselines`` (their
            statistics are uploaded and counted too).
    """

    name: ClassVar[str] = "fedavg"
    #: statistics the merge needs from every peer
    needs: ClassVar[tuple[str, ...]] = ()

    compress: bool = False
    triangle: bool = True
    select: Literal["val", "final"] = "val"
    baselines: tuple[str, ...] = ("fedavg",)

    def __post_init__(self) -> None:
        super().__post_init__()
        for b in self.baselines:
            if b not in BASELINES:
                raise ConfigError("baselines", f"unknown baseline {b!r}; choose from {BASELINES}")
            if b == self.label:
                raise ConfigError("baselines", f"{b!r} is the method itself")
        self.baselines = tuple(dict.fromkeys(self.baselines))

    @property
    def label(self) -> str:
        """The name its accuracy is reported under."""
        return self.name

    def count(self) -> int:
        """How many candidates :meth:`candidates` returns."""
        return 1

    def candidates(self, uploads: list[Upload]) -> list[State]:
        """The merged models to choose from (``select: final`` takes the last)."""
        return [fedavg(uploads)]

    def common(self) -> dict[str, Any]:
        """The upload and selection keys a baseline shares with this method (its own
        baselines left out)."""
        return {f.name: getattr(self, f.name) for f in fields(OneShot)} | {"baselines": ()}

    def baseline(self, name: str) -> OneShot:
        """The merge a baseline name stands for, with this method's :meth:`common` keys."""
        keys = self.common()
        if name == "fedavg":
            return OneShot(**keys)
        if name.startswith("fedfisher_"):
            name, keys = "fedfisher", keys | {"fisher": name.removeprefix("fedfisher_")}
        return cast(type[OneShot], METHODS.get(name))(**keys)

    # --- checks and plan ------------------------------------------------------------------

    def check_data(self, model: nn.Module, data: FederatedData) -> None:
        """The statistics must cover every trainable layer (:func:`covered_layers`), and
        ``select: val`` needs validation samples to choose among the candidates."""
        if self.kinds():
            try:
                covered_layers(model)
            except ValueError as e:
                raise ConfigError(
                    "model.name",
                    f"{self.name} needs {'/'.join(self.kinds())} statistics of every layer: {e}",
                ) from None
        if self.deadline_s is not None and self.voting():
            raise ConfigError(
                "algorithm.deadline_s",
                f"{self.name} with select: val waits for every peer's vote; "
                "with a deadline set algorithm.select: final",
            )
        if self.voting() and not any(len(p.val_y) for p in data.peers):
            raise ConfigError(
                "partition.val_fraction",
                f"{self.name} with select: val picks among candidate models on the peers' "
                "validation splits, which are empty; set it > 0 or algorithm.select: final",
            )

    @cached_property
    def merges(self) -> list[OneShot]:
        """The method first, then its baselines."""
        return [self] + [self.baseline(b) for b in self.baselines]

    def kinds(self) -> tuple[str, ...]:
        """Every statistic uploaded: the method's and its baselines'."""
        return tuple(sorted({k for m in self.merges for k in m.needs}))

    def voting(self) -> bool:
        """Whether a validation exchange happens (``select: val`` and some choice to make)."""
        return self.select == "val" and any(m.count() > 1 for m in self.merges)

    def parts(self, state: State, stats: StatisticsByKind, num_samples: int) -> list[Part]:
        """A peer's upload as messages (:func:`~p2pfl.methods.oneshot.payload.upload_parts`)."""
        return upload_parts(
            state, stats, num_samples, self.kinds(), compress=self.compress, triangle=self.triangle
        )

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Phase 1: every peer uploads its model (with its sample count) and one message per
        statistic its merges need, to the centre (star) or to every other peer (mesh). With
        ``select: val`` and K candidates in all: star, the centre sends the K stacked models
        to every peer (phase 2) and each returns its correct counts (phase 3); mesh, every
        peer sends its counts to every other (phase 2). Star: the centre returns the model."""
        topology = plan.topology
        stats = shaped_statistics(plan.module, self.kinds())
        for p in topology.peers:
            parts = self.parts(plan.state, stats, plan.num_train[p])
            for dst in self.targets(topology, p):
                for kind, tensors, meta, codec in parts:
                    yield plan.send(p, dst, kind, UPLOAD, 1, tensors, meta, codec)
        phase = 2
        if self.voting():
            count = sum(m.count() for m in self.merges if m.count() > 1)
            correct = {"correct": torch.zeros(count, dtype=torch.int64)}
            if self.placement == "star":
                stacked, server = stack([plan.state] * count), star_centre(topology)
                for p in topology.peers:
                    yield plan.send(server, p, "model", VALIDATION, 2, stacked, {"count": count})
                for p in topology.peers:
                    meta = {"samples": plan.num_val[p]}
                    yield plan.send(p, server, "control", VALIDATION, 3, correct, meta)
                phase = 4
            else:
                for p in topology.peers:
                    for q in self.targets(topology, p):
                        meta = {"samples": plan.num_val[p]}
                        yield plan.send(p, q, "control", VALIDATION, 2, correct, meta)
        if self.placement == "star":
            for p in topology.peers:
                yield plan.send(star_centre(topology), p, "model", RESULT, phase, plan.state)

    # --- behaviour --------------------------------------------------------------------------

    def peer(self, ctx: NodeContext) -> Behaviour:
        trained = (yield Train(ctx.init_state(), UPLOAD)).state
        kinds = self.kinds()
        stats: StatisticsByKind = {}
        if kinds:
            classes = next(reversed(trained.values())).shape[0]  # the output layer's rows
            passes = (1 + 2 * classes) / 3 if {"diag", "kfac"} & set(kinds) else 1 / 3
            stats = yield Compute(trained, partial(local_statistics, kinds=kinds), passes)
        parts = self.parts(trained, stats, ctx.num_samples)
        others = [p for p in ctx.peers if p != ctx.node]
        for dst in self.targets(ctx.topology, ctx.node):
            for kind, tensors, meta, codec in parts:
                yield Send(dst, kind, UPLOAD, tensors, meta, codec)
        if self.placement == "star":
            if self.voting():
                (msg,) = yield Recv(kinds=("model",), round=VALIDATION)
                yield from self.vote(ctx, unstack(msg.tensors, msg.meta["count"]), [msg.src])
            if self.deadline_s is not None:  # the result may never come: keep the own model
                got = yield Recv(kinds=("model",), round=RESULT, deadline=math.inf)
                yield Finish(got[0].tensors if got else trained)
                return
            (msg,) = yield Recv(kinds=("model",), round=RESULT)
            yield Finish(msg.tensors)
            return
        msgs = yield from self.uploads(len(others) * len(parts), len(parts))
        uploads = self.read(as_received(parts, ctx.node, UPLOAD, ctx.compression) + msgs)
        state = yield from self.aggregate(ctx, uploads, report=ctx.node == ctx.peers[0])
        yield Finish(state)

    def centre(self, ctx: NodeContext) -> Behaviour:
        per_peer = 1 + len(self.kinds())
        msgs = yield from self.uploads(len(ctx.peers) * per_peer, per_peer)
        state = yield from self.aggregate(ctx, self.read(msgs), report=True)
        for p in ctx.peers:
            yield Send(p, "model", RESULT, state)
        yield Finish(state, output=True)

    def read(self, msgs: list[Message]) -> list[Upload]:
        """The uploads in ``msgs``, in peer order, decoded."""
        return read_uploads(msgs, compress=self.compress, triangle=self.triangle)

    def aggregate(
        self, ctx: NodeContext, uploads: list[Upload], report: bool
    ) -> Generator[Effect, Any, State]:
        """Merge with every merge, choose among candidates, report; returns the model."""
        lists = [m.candidates(uploads) for m in self.merges]
        chosen = [c[-1] for c in lists]
        if self.voting():
            pool = [s for c in lists if len(c) > 1 for s in c]
            if ctx.is_server:
                for p in ctx.peers:
                    yield Send(p, "model", VALIDATION, stack(pool), {"count": len(pool)})
                correct, seen = yield from self.collect(ctx.peers)
            else:
                others = [p for p in ctx.peers if p != ctx.node]
                own, n_val = yield from self.vote(ctx, pool, others)
                correct, seen = yield from self.collect(others)
                correct, seen = correct + own, seen + n_val
            start = 0
            for i, (m, c) in enumerate(zip(self.merges, lists, strict=True)):
                if len(c) > 1:
                    votes = correct[start : start + len(c)]
                    best = int(torch.argmax(votes))  # ties: the earliest
                    chosen[i] = c[best]
                    start += len(c)
                    if report:
                        yield Log(UPLOAD, f"{m.label}.candidate", best)
                        yield Log(UPLOAD, f"{m.label}.val_accuracy", float(votes[best]) / seen)
        if report:
            for m, c, best_state in zip(self.merges, lists, chosen, strict=True):
                if m is not self:
                    yield Report(m.label, best_state)
                if self.voting() and len(c) > 1:
                    yield Report(f"{m.label}@last", c[-1])
            yield Evaluate(chosen[0], UPLOAD)
        return chosen[0]

    def vote(
        self, ctx: NodeContext, cands: list[State], to: list[int]
    ) -> Generator[Effect, Any, tuple[Tensor, int]]:
        """Score ``cands`` on this peer's validation split and send the correct-answer counts
        to ``to``; returns (counts, validation size)."""
        counts, n_val = yield Compute(cands[0], partial(count_correct, cands=cands), 0)
        for dst in to:
            yield Send(dst, "control", VALIDATION, {"correct": counts}, {"samples": n_val})
        return counts, n_val

    def collect(self, voters: list[int]) -> Generator[Effect, Any, tuple[Tensor, int]]:
        """Sum the counts ``voters`` send; returns (counts, pooled validation size)."""
        msgs = yield Recv(kinds=("control",), count=len(voters), round=VALIDATION)
        correct = sum((m.tensors["correct"] for m in msgs), torch.zeros((), dtype=torch.int64))
        return correct, sum(m.meta["samples"] for m in msgs)
