"""Batched local training: many peers' SGD runs of one MLP as grouped matrix products.

The per-peer loop (:meth:`p2pfl.learning.training.Trainer.train`) pays Python, autograd, allocation
and optimizer overhead once per peer and step; for an MLP that is most of the work. Here
the peers' weights are stacked along a leading peer axis, ``[peers, out, in]``, and one
step of every peer is a handful of batched products (``torch.baddbmm``): the forward pass,
the backward pass written out by hand, and the SGD update fused into the weight-gradient
product, in place, so no per-step gradient tensors are allocated.

It is the same computation as the per-peer loop: each peer's batch order is drawn from the
same generator in the same way (one ``randperm`` per epoch), a peer's last, smaller batch
is averaged over its own size, and peers with less data stop earlier (peers are sorted by
data size, so the peers still training at a step are a prefix of the stack). Results agree
with the loop to float rounding (sums run in another order), not bit for bit.

Any other model without buffers (no BatchNorm running statistics: ``norm: group`` or
``none``), without dropout and without forward hooks trains batched with ``torch.func``
instead: ``vmap`` over the peer axis of ``grad`` of a ``functional_call``, with SGD (momentum,
weight decay) or Adam applied to the stacked weights in place — the same update formulas as
``torch.optim``. The hand-written MLP path stays where it is faster (docs/performance.md).

Supported (:func:`can_batch`): SGD for a plain MLP (:func:`mlp_layers`); SGD, Adam or SAM,
with or without FedProx's proximal term (:class:`Proximal`), for any model that
:func:`functional` accepts; ``select: last`` or ``best_val`` (each peer's epochs end at its
own steps; its model is scored on its validation split there, as the loop does). A group
in which some peer's regularised loss is not finite raises :class:`NonFinite` (the loop
skips such a step; the caller trains that group one by one). On CUDA, SGD and SAM steps
without a proximal term run over the whole group and replay from a CUDA graph
(:class:`_Fixed`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from p2pfl.data.federated import PeerData
from p2pfl.learning.graphs import Replayed
from p2pfl.learning.models import Layer, mlp_layers
from p2pfl.learning.state import State
from p2pfl.learning.training import (
    Proximal,
    Regularizer,
    TrainConfig,
    TrainResult,
    score,
    work,
)

MAX_GROUP = 128
"""Peers per batched call on the ``torch.func`` path (CUDA in a run): bounds the stacked
weights and momenta held at once."""

MLP_GROUP = 32
"""Peers per call on the hand-written MLP path, whose results do not depend on it (bit for
bit, tested). Smaller stacks are reused where larger ones are mapped and faulted in afresh
each call: 32 instead of 128 halved the page faults of the 1,000-peer run and made it 10%
faster (docs/performance.md, "The 1,000-peer goal")."""


class DataPool:
    """Every peer's training data in one tensor, so a step gathers all peers' batches at once.

    Packing makes each peer's ``train_x``/``train_y`` a view into the pool, so the data is
    still held once. Where every peer's split is rows of the same shared tensors
    (:class:`~p2pfl.data.federated.PeerData`'s ``rows``: the dataset's), the pool is those
    tensors, held once however many peers drew a sample, and :attr:`rows` maps each pool
    row to its row of them (:func:`batch_plan` reads through it). Copies on other devices
    are made on first use and kept.
    """

    def __init__(self, peers: list[PeerData]) -> None:
        self.peers = peers
        sizes = [p.num_train for p in peers]
        self.offsets = [0, *itertools.accumulate(sizes)][:-1]
        cpu, first = torch.device("cpu"), peers[0]
        self.rows: torch.Tensor | None = None
        """Pool row ``i`` is row ``rows[i]`` of :meth:`on`'s tensors (None: row ``i``)."""
        if all(
            p.rows is not None and p.source_x is first.source_x and p.source_y is first.source_y
            for p in peers
        ):
            self._x, self._y = {cpu: first.source_x}, {cpu: first.source_y}
            self.rows = _joined([p.rows.long() for p in peers if p.rows is not None])
            return
        self._x = {cpu: _joined([p.train_x for p in peers])}
        self._y = {cpu: _joined([p.train_y for p in peers])}
        for p, start, n in zip(peers, self.offsets, sizes, strict=True):
            p.train_x = self._x[cpu][start : start + n]
            p.train_y = self._y[cpu][start : start + n]

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The pooled inputs, flattened to ``[samples, features]``, and labels on ``device``."""
        if device not in self._x:
            cpu = torch.device("cpu")
            self._x[device], self._y[device] = self._x[cpu].to(device), self._y[cpu].to(device)
        return self._x[device].flatten(1), self._y[device]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, without a copy where the parts already lie end to end in one
    tensor, as :func:`p2pfl.data.federated.make_federated_data` lays out the peers' data."""
    first = parts[0]
    storage, offset = first.untyped_storage(), first.storage_offset()
    for t in parts:
        if (
            not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.storage_offset() != offset
        ):
            return torch.cat(parts)
        offset += t.numel()
    shape = (sum(len(t) for t in parts), *first.shape[1:])
    return first.as_strided(shape, torch.empty(shape, device="meta").stride())


@dataclass
class Job:
    """One peer's training: its start state, which peer it is, its batch-order generator,
    its proximal term (FedProx), if any."""

    state: State
    peer: int
    generator: torch.Generator
    proximal: Proximal | None = None


class NonFinite(ArithmeticError):
    """A peer's regularised loss was not finite at some step: the loop skips that step,
    which a batched step cannot; train the group one by one instead."""


def functional(module: nn.Module) -> bool:
    """Whether ``module`` trains the same stacked under ``torch.func.vmap`` as alone: no
    buffers (BatchNorm's running statistics would be shared), no dropout (its masks would
    come from another generator), no forward hooks."""
    return not (
        unbatchable(module) is not None
        or any(True for _ in module.buffers())
        or any(isinstance(m, nn.modules.dropout._DropoutNd) for m in module.modules())
        or any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
    )


def unbatchable(module: nn.Module) -> str | None:
    """Why ``module`` cannot train batched at all (``peers.batched: true`` is refused), or
    None. Recurrent layers (``char_lstm``): ``torch.func.vmap`` has no batching rule for
    the fused LSTM kernels (CPU ``mkldnn_rnn_layer``, cuDNN's RNN), so a stacked call would
    run its peers one after another through vmap's slow fallback; stacking them gains
    nothing."""
    rnn = next((m for m in module.modules() if isinstance(m, nn.RNNBase)), None)
    if rnn is None:
        return None
    return (
        f"this model has a recurrent layer ({type(rnn).__name__}), which cannot train batched: "
        "torch.func.vmap has no batching rule for the fused LSTM/GRU kernels, so peers would "
        "still train one by one; set peers.batched: false (the results are the same)"
    )


def can_batch(module: nn.Module, cfg: TrainConfig, regularizer: Regularizer | None) -> bool:
    """Whether :func:`train_batched` can train ``module`` with ``cfg`` and ``regularizer``."""
    if regularizer is not None and not isinstance(regularizer, Proximal):
        return False
    return _hand_written(module, cfg, regularizer) or functional(module)


def _hand_written(module: nn.Module, cfg: TrainConfig, regularizer: Regularizer | None) -> bool:
    """Whether the hand-written MLP path trains it: a plain MLP, SGD, no regulariser."""
    return cfg.optimizer == "sgd" and regularizer is None and mlp_layers(module) is not None


def divisible(module: nn.Module, cfg: TrainConfig, device: torch.device) -> bool:
    """Whether a group of jobs may be trained in any parts with the same bits: on the
    hand-written MLP path on a CPU a peer's result does not depend on which peers share its
    call, nor how many (tested down to one), so ranks can each batch a share of a group."""
    return device.type == "cpu" and _hand_written(module, cfg, None)


def supports(module: nn.Module, cfg: TrainConfig, regularizer: Regularizer | None) -> bool:
    """Whether a runtime should train ``module`` batched: where it pays. On a CPU that is
    the hand-written MLP path only: the ``torch.func`` path ran at 0.73-0.96x the loop for
    an MLP 784-200-10 and 0.86x for LeNet-5 on one core (100 peers, docs/performance.md),
    since it adds autograd's work to the same products; it is for CUDA, where one call
    replaces a hundred peers' small kernel launches."""
    if not can_batch(module, cfg, regularizer):
        return False
    return _hand_written(module, cfg, regularizer) or any(p.is_cuda for p in module.parameters())


def train_batched(
    module: nn.Module,
    pool: DataPool,
    jobs: list[Job],
    cfg: TrainConfig,
    device: torch.device,
    generic: bool = False,
    fixed: bool | None = None,
) -> list[TrainResult]:
    """Train every job's state with ``cfg`` (see :func:`can_batch`); one result per job.

    ``module`` is the architecture's template (only its structure is read). The jobs all
    have a proximal term with one ``mu``, or none has. Each result's ``wall_s`` is an equal
    share of its group's wall time. ``generic`` takes the ``torch.func`` path even for a
    plain MLP with SGD (to compare the two). ``fixed`` runs every step after the first over
    the whole group (see :class:`_Fixed`); by default it does so where CUDA can replay
    those steps from a captured graph (:func:`replayable`). Raises :class:`NonFinite`.
    """
    if len({None if j.proximal is None else j.proximal.mu for j in jobs}) > 1:
        raise ValueError("batched jobs must share their proximal term's mu, or have none")
    proximal = jobs[0].proximal
    if not can_batch(module, cfg, proximal):
        raise ValueError("this model or optimizer cannot train batched (see can_batch)")
    mu = proximal.mu if proximal is not None else 0.0
    layers = mlp_layers(module) if _hand_written(module, cfg, proximal) and not generic else None
    step = _MlpStep(layers) if layers is not None else _FuncStep(module, mu)
    size = MLP_GROUP if layers is not None else MAX_GROUP
    if fixed is None:
        fixed = device.type == "cuda" and replayable(cfg, proximal)
    elif fixed and not replayable(cfg, proximal):
        raise ValueError("fixed steps need SGD or SAM without a proximal term (see replayable)")
    results: list[TrainResult] = []
    for i in range(0, len(jobs), size):
        group = jobs[i : i + size]
        start = time.perf_counter()
        trained = _train_group(step, module, pool, group, cfg, device, fixed)
        share = (time.perf_counter() - start) / len(group)
        for job, (state, acc) in zip(group, trained, strict=True):
            results.append(TrainResult(state, acc, *work(cfg, pool.peers[job.peer]), share))
    return results


def batch_plan(
    pool: DataPool, jobs: list[Job], batch_size: int, epochs: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every peer's batches, step by step, as rows of the pool's tensors (:meth:`DataPool.on`).

    ``jobs`` must be sorted by data size, largest first. Returns ``index``
    ``[steps, peers, batch_size]`` (padding points at the pool's row 0), ``weight``
    (1/batch size on real slots, 0 on padding: each peer's mean loss) and, per step, how
    many leading peers take it. The orders come from each job's generator exactly as the
    per-peer loop draws them.
    """
    peers = len(jobs)
    sizes = [pool.peers[job.peer].num_train for job in jobs]
    steps = [math.ceil(n / batch_size) for n in sizes]
    # each peer's epochs, one permutation each, drawn in order from its own generator
    perms = [
        torch.randperm(n, generator=job.generator)
        for job, n in zip(jobs, sizes, strict=True)
        for _ in range(epochs)
    ]
    index = torch.full((epochs * steps[0] * peers * batch_size,), -1, dtype=torch.long)
    if sum(sizes):
        # where sample i of peer p's epoch e goes: step e·steps_p + i // B, slot i % B
        lengths = torch.tensor(sizes).repeat_interleave(epochs)
        segment = torch.arange(peers * epochs).repeat_interleave(lengths)
        starts = lengths.cumsum(0) - lengths
        i = torch.arange(len(segment)) - starts[segment]
        p = segment // epochs
        step = (segment % epochs) * torch.tensor(steps)[p] + i // batch_size
        offsets = torch.tensor([pool.offsets[job.peer] for job in jobs])
        index[(step * peers + p) * batch_size + i % batch_size] = torch.cat(perms) + offsets[p]
    index = index.view(epochs * steps[0], peers, batch_size)
    real = index >= 0
    count = real.sum(-1, keepdim=True)
    active = (count.squeeze(-1) > 0).sum(-1).tolist()
    index = index.clamp(min=0)
    return index if pool.rows is None else pool.rows[index], real / count.clamp(min=1), active


def replayable(cfg: TrainConfig, proximal: Proximal | None) -> bool:
    """Whether a step after the first is the same computation every time, so that CUDA can
    replay it from one captured graph: SGD or SAM (Adam's bias corrections change with the
    step count) without a proximal term (whose finiteness check reads the loss back)."""
    return cfg.optimizer in ("sgd", "sam") and proximal is None


def _train_group(
    step: Step,
    module: nn.Module,
    pool: DataPool,
    jobs: list[Job],
    cfg: TrainConfig,
    device: torch.device,
    fixed: bool = False,
) -> list[tuple[State, float]]:
    """One batched run over a group of peers; returns their trained CPU states and their
    best validation accuracies (``select: best_val``; -1 where none was scored). With
    ``fixed``, steps after the first run through :class:`_Fixed`."""
    order = sorted(range(len(jobs)), key=lambda i: -pool.peers[jobs[i].peer].num_train)
    ranked = [jobs[i] for i in order]
    index, weight, active = batch_plan(pool, ranked, cfg.batch_size, cfg.epochs)
    x_all, y_all = pool.on(device)
    index, weight = index.to(device), weight.to(device)
    shape = pool.peers[0].source_x.shape[1:]  # one sample's, for models that are not MLPs
    keys = list(ranked[0].state)
    stacked = {k: torch.stack([j.state[k] for j in ranked]).to(device) for k in keys}
    anchors = [j.proximal.anchor for j in ranked if j.proximal is not None]
    anchor = None
    if anchors:
        names = [name for name, _ in module.named_parameters()]
        anchor = {k: torch.stack([a[k] for a in anchors]).to(device) for k in names}
    slots = step.slots(cfg)
    # the MLP path's first step sets every momentum buffer (SGD's first step ignores what
    # it held: torch.mul(out=), baddbmm_ with beta 0), so they need no zeros; a fixed step
    # also moves the peers that took no first step
    blank = torch.empty_like if isinstance(step, _MlpStep) and not fixed else torch.zeros_like
    moments = {s: {k: blank(v) for k, v in stacked.items()} for s in slots}
    best = _BestEpoch(module, pool, ranked, cfg, device)
    whole = _Fixed(step, stacked, moments, (x_all, y_all), shape, cfg) if fixed else None
    final = {k: v.clone() for k, v in stacked.items()} if whole is not None else stacked
    # a step's padding slots (weight 0) all hold the pool's row 0: a trimming step
    # (Step.trims) computes one of them, after the widest peer's real rows, for the rest
    widths = [cfg.batch_size] * len(active)
    if step.trims and whole is None:
        dims = [tuple(stacked[w].shape[1:]) for w, _ in step.layers]  # type: ignore[attr-defined]
        widths = [
            n + 1 if n + 1 < cfg.batch_size and _cut_ok(dims, n + 1, cfg.batch_size, device)
            else cfg.batch_size
            for n in (weight > 0).sum(-1).amax(-1).tolist()
        ]  # fmt: skip
    with torch.no_grad():
        best.before(stacked)
        for t, k in enumerate(active):
            params = {name: v[:k] for name, v in stacked.items()}
            if whole is not None and t:
                whole(index[t], weight[t])
            else:
                b = widths[t]
                rows = index[t, :k, :b].reshape(-1)  # index_select: 3-4x faster than x_all[rows]
                opt = {s: {name: v[:k] for name, v in m.items()} for s, m in moments.items()}
                x = x_all.index_select(0, rows).view(k, -1, *shape)
                y = y_all.index_select(0, rows).view(k, -1)
                near = None if anchor is None else {name: v[:k] for name, v in anchor.items()}
                if b < cfg.batch_size:
                    step(params, opt, x, y, weight[t, :k, :b], cfg, t, near, cfg.batch_size - b)
                else:
                    step(params, opt, x, y, weight[t, :k], cfg, t, near)
            if whole is not None:  # the peers whose last step this was: keep their weights
                done = active[t + 1] if t + 1 < len(active) else 0
                for name, v in final.items():
                    v[done:k] = stacked[name][done:k]
            best.after(t, params)
    # one copy per tensor, not per peer; none where every peer kept a best_val state
    last = any(state is None for state in best.states)
    host = {k: v.to("cpu") for k, v in final.items()} if last else {}
    trained = [
        (best.states[i] or {k: v[i].clone() for k, v in host.items()}, best.acc[i])
        for i in range(len(jobs))
    ]
    out: list[tuple[State, float]] = [({}, -1.0)] * len(jobs)
    for i, result in zip(order, trained, strict=True):
        out[i] = result
    return out


_CUT: dict[tuple, bool] = {}


def _cut_ok(dims: list[tuple[int, ...]], width: int, batch: int, device: torch.device) -> bool:
    """Whether an MLP step's products give a batch's rows the same bits when the batch is
    ``width`` rows as when it is ``batch`` (``dims``: each layer's ``(out, in)``): each
    layer's forward and backward products row by row, and its weight gradient over the
    rows, the rows past ``width`` holding exact (signed) zeros. Checked once per shape on
    random values, the kernels' order not depending on them: on a CPU, torch's batched
    products take another path for 1-3 rows, whose sums differ (so such widths are not
    cut)."""
    key = (tuple(dims), width, batch, device)
    if key not in _CUT:
        gen = torch.Generator().manual_seed(width)
        ok = True
        for out, inp in dims:
            x = torch.rand(2, batch, inp, generator=gen).to(device)
            w = torch.randn(2, out, inp, generator=gen).to(device)
            g = torch.randn(2, batch, out, generator=gen).to(device)
            g[:, width:] *= 0.0  # signed zeros, as a padding slot's gradient
            cut = g[:, :width]
            buf = torch.empty(2, out, inp, device=device)
            ok = ok and (
                torch.equal((x @ w.transpose(1, 2))[:, :width], x[:, :width] @ w.transpose(1, 2))
                and torch.equal((g @ w)[:, :width], cut @ w)
                and torch.equal(
                    buf.baddbmm(g.transpose(1, 2), x, beta=0.0),
                    buf.baddbmm(cut.transpose(1, 2), x[:, :width], beta=0.0),
                )
            )
        _CUT[key] = ok
    return _CUT[key]


class _Fixed:
    """A group's steps after the first, each over the whole group at one shape.

    Peers that have finished still step, on batches of weight zero (their gradients are
    zero, but momentum and weight decay move them), so their weights are taken at their
    last step (:func:`_train_group`). In exchange every step is the same computation on the
    same tensors, only the batch rows and weights changing, which CUDA replays from one
    captured graph (:class:`~p2pfl.learning.graphs.Replayed`): one launch instead of a few
    hundred kernels a step. Results equal the prefix steps' to float rounding (the kernels
    see more peers) and replay bit for bit.
    """

    def __init__(
        self,
        step: Step,
        params: Tensors,
        state: dict[str, Tensors],
        data: tuple[torch.Tensor, torch.Tensor],
        shape: torch.Size,
        cfg: TrainConfig,
    ) -> None:
        peers, device = len(next(iter(params.values()))), data[0].device
        rows = self.rows = torch.zeros(peers * cfg.batch_size, dtype=torch.long, device=device)
        weight = self.weight = torch.zeros(peers, cfg.batch_size, device=device)

        def run() -> None:  # its inputs are the tensors above; no reference to self (a cycle)
            x = data[0].index_select(0, rows).view(peers, -1, *shape)
            y = data[1].index_select(0, rows).view(peers, -1)
            step(params, state, x, y, weight, cfg, 1)

        self.step = Replayed(run, device)

    def __call__(self, index: torch.Tensor, weight: torch.Tensor) -> None:
        """One step: ``index`` ``[peers, batch]`` rows of the pool, ``weight`` their weights."""
        self.rows.copy_(index.view(-1))
        self.weight.copy_(weight)
        self.step()


class _BestEpoch:
    """``select: best_val`` for a batched group: at the end of each of a peer's epochs (its
    own number of steps), its model is scored on its validation split, and kept if strictly
    better than its earlier epochs (as :meth:`Trainer.train` does). Idle for ``last``."""

    def __init__(
        self,
        module: nn.Module,
        pool: DataPool,
        ranked: list[Job],
        cfg: TrainConfig,
        device: torch.device,
    ) -> None:
        self.module, self.device = module, device
        self.val = [(pool.peers[j.peer].val_x, pool.peers[j.peer].val_y) for j in ranked]
        self.steps = [math.ceil(pool.peers[j.peer].num_train / cfg.batch_size) for j in ranked]
        self.on = cfg.select == "best_val"
        self.acc = [-1.0] * len(ranked)
        self.states: list[State | None] = [None] * len(ranked)

    def _forward(self, params: Tensors) -> Callable[[torch.Tensor], torch.Tensor]:
        """One peer's model as a function of its input: its weights in the template."""
        return lambda x: torch.func.functional_call(self.module, params, (x,))

    def before(self, params: Tensors) -> None:
        """The group's start: a peer without training samples takes no step, but the loop
        still scores its model at each epoch's end (its start model every time, so the
        first score stands)."""
        for i, steps in enumerate(self.steps):
            if self.on and not steps:
                self._keep(i, params)

    def after(self, t: int, params: Tensors) -> None:
        """Step ``t`` is done for the leading peers that ``params`` holds."""
        for i in range(len(next(iter(params.values())))) if self.on else ():
            if not (t + 1) % self.steps[i]:
                self._keep(i, params)

    def _keep(self, i: int, params: Tensors) -> None:
        """Score peer ``i``'s model in ``params``; keep it if strictly better."""
        x, y = self.val[i]
        if not len(y):
            return
        mine = {k: v[i] for k, v in params.items()}
        acc, _ = score(self._forward(mine), x, y, self.device)
        if acc > self.acc[i]:
            self.acc[i], self.states[i] = acc, {k: v.to("cpu", copy=True) for k, v in mine.items()}


Tensors = dict[str, torch.Tensor]


class Step:
    """One optimizer step of every peer in the stack, in place: ``params`` and the
    optimizer's ``state`` (one stack per slot name) are views of the active peers; ``x`` is
    ``[peers, batch, *sample]``, ``weight`` ``[peers, batch]`` (1/batch size, 0 on padding);
    ``t`` counts the steps before this one; ``anchor``: the proximal term's anchors."""

    trims = False
    """Whether a step gives the same bits on a batch cut after its first padding slot as on
    the whole ``batch_size``, told how many identical padding slots it left out (``fill``):
    a step of an MLP that is as slow as its batch is wide (6 samples a peer at 10⁴ peers of
    Fashion-MNIST, batch size 32: a fifth of the work)."""

    def slots(self, cfg: TrainConfig) -> tuple[str, ...]:
        """The optimizer's per-weight state: SGD's (and SAM's) momentum buffer, Adam's two
        moments."""
        if cfg.optimizer == "adam":
            return ("exp_avg", "exp_avg_sq")
        return ("momentum",) if cfg.momentum else ()

    def __call__(
        self,
        params: Tensors,
        state: dict[str, Tensors],
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
        cfg: TrainConfig,
        t: int,
        anchor: Tensors | None = None,
        fill: int = 0,
    ) -> None:
        raise NotImplementedError


class _FuncStep(Step):
    """Any :func:`functional` model: per-peer gradients by ``vmap(grad(loss))``; with
    ``mu``, the loss adds :class:`Proximal`'s term towards each peer's anchor."""

    def __init__(self, module: nn.Module, mu: float = 0.0) -> None:
        names = [name for name, _ in module.named_parameters()]

        def loss(p: Tensors, x, y, w) -> torch.Tensor:
            out = torch.func.functional_call(module, p, (x,))
            return (F.cross_entropy(out, y, reduction="none") * w).sum()  # the batch's mean

        def regularised(p: Tensors, x, y, w, anchor: Tensors) -> torch.Tensor:
            ce = loss(p, x, y, w)
            return ce + Proximal(anchor, mu).of({k: p[k] for k in names}, ce)

        self.plain = torch.func.vmap(torch.func.grad(loss))
        self.regularised = torch.func.vmap(torch.func.grad_and_value(regularised))

    def grads(self, params: Tensors, x, y, weight, anchor: Tensors | None, check=True) -> Tensors:
        """Every peer's gradient; with ``anchor`` and ``check``, :class:`NonFinite` if a
        peer's loss is not finite (the loop checks the first pass of a step only)."""
        with torch.enable_grad():
            if anchor is None:
                return self.plain(params, x, y, weight)
            grads, loss = self.regularised(params, x, y, weight, anchor)
        if check and not bool(torch.isfinite(loss).all()):
            raise NonFinite("a regularised loss was not finite")
        return grads

    def __call__(self, params, state, x, y, weight, cfg, t, anchor=None):  # Step.__call__'s
        grads = self.grads(params, x, y, weight, anchor)
        if cfg.optimizer == "sam":  # the gradient at w + rho·g/‖g‖ (training._sam_gradient)
            norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1)
            scale = cfg.rho / (norms.norm(dim=1) + 1e-12)
            shifted = {
                k: v + grads[k] * scale.view(-1, *[1] * (v.dim() - 1)) if k in grads else v
                for k, v in params.items()
            }
            grads = self.grads(shifted, x, y, weight, anchor, check=False)
        for name, p in params.items():
            if cfg.optimizer == "adam":
                _adam(p, state["exp_avg"][name], state["exp_avg_sq"][name], grads[name], cfg, t)
            else:
                _sgd(p, state.get("momentum", {}).get(name), cfg, grads[name], t == 0)


class _MlpStep(Step):
    """A plain MLP with SGD: the backward pass written out, the update fused into it."""

    trims = True  # a padding row's gradient is exactly 0 and adds nothing (tested)

    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers

    def __call__(self, params, state, x, y, weight, cfg, t, anchor=None, fill=0):  # Step's
        _mlp_step(
            self.layers, params, state.get("momentum", {}), x.flatten(2), y, weight, cfg,
            t == 0, fill,
        )  # fmt: skip


def _mlp_step(
    layers: list[Layer],
    params: Tensors,
    bufs: Tensors,
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    cfg: TrainConfig,
    first: bool,
    fill: int = 0,
) -> None:
    """One SGD step of every peer in the stack on its batch ``x`` ``[peers, batch, in]``;
    ``first``: the momentum buffers are still unset; ``fill``: the batch's last row, a
    padding slot (weight 0), stands for that many more of them, left out.

    Each row's activations and gradients are computed on their own (a product's rows do
    not depend on its other rows), and the weights' gradients sum over the batch one row
    after another, where more padding rows add nothing (their gradient is an exact zero:
    0 again added to a sum that already holds it); the biases' ``sum`` over the batch adds
    in an order that depends on its length, so there the left-out rows are put back
    (tested: the same bits as the whole batch)."""
    acts = [x]
    for i, (w, b) in enumerate(layers):
        out = acts[-1] @ params[w].transpose(1, 2)
        if b is not None:
            out += params[b].unsqueeze(1)
        acts.append(out.relu_() if i < len(layers) - 1 else out)
    # d(mean cross-entropy)/d(logits) = (softmax - onehot) / batch size, per peer
    grad = acts.pop().softmax(-1)
    grad.scatter_add_(-1, y.unsqueeze(-1), torch.full_like(grad[..., :1], -1.0))
    grad *= weight.unsqueeze(-1)
    for i in reversed(range(len(layers))):
        w, b = layers[i]
        inputs = acts[i]
        back = grad @ params[w] if i else None  # before the weight moves
        _sgd(params[w], bufs.get(w), cfg, (grad.transpose(1, 2), inputs), first)
        if b is not None:
            rows = grad if not fill else torch.cat([grad, grad[:, -1:].expand(-1, fill, -1)], 1)
            _sgd(params[b], bufs.get(b), cfg, rows.sum(1), first)
        if back is not None:
            grad = back.mul_(inputs > 0)


Gradient = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A gradient, or a pair ``(a, b)`` whose batched product ``a @ b`` is the gradient."""


def _sgd(
    p: torch.Tensor, buf: torch.Tensor | None, cfg: TrainConfig, grad: Gradient, first: bool
) -> None:
    """``torch.optim.SGD``'s update of ``p`` in place (no dampening, no Nesterov).

    A product gradient is accumulated straight into the buffer or the weight, never
    materialised. On the ``first`` step the buffer is set to ``d``, as SGD's clone does.
    """
    if buf is not None:  # buf = m·buf + g + wd·p;  p -= lr·buf
        _accumulate(buf, 0.0 if first else cfg.momentum, 1.0, grad)
        if cfg.weight_decay:
            buf.add_(p, alpha=cfg.weight_decay)
        p.sub_(buf, alpha=cfg.lr)
        return
    if cfg.weight_decay:  # p -= lr·(g + wd·p)
        p.mul_(1.0 - cfg.lr * cfg.weight_decay)
    _accumulate(p, 1.0, -cfg.lr, grad)


def _adam(
    p: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    cfg: TrainConfig,
    t: int,
) -> None:
    """``torch.optim.Adam``'s update of ``p`` in place (default betas and eps, L2 weight
    decay added to the gradient); ``t`` steps were taken before this one."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    if cfg.weight_decay:
        grad = grad.add(p, alpha=cfg.weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = t + 1
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-cfg.lr / (1 - beta1**step))


def _accumulate(t: torch.Tensor, beta: float, alpha: float, grad: Gradient) -> None:
    """``t = beta·t + alpha·grad``, in place (``beta = 0`` ignores what ``t`` held)."""
    if isinstance(grad, tuple):
        t.baddbmm_(*grad, beta=beta, alpha=alpha)
    elif beta == 0.0:
        torch.mul(grad, alpha, out=t)
    else:
        if beta != 1.0:
            t.mul_(beta)
        t.add_(grad, alpha=alpha)
