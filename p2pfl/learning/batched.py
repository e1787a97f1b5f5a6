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

Supported (:func:`mlp_layers`, :func:`supports`): a ``p2pfl.learning.models.mlp`` (Linear
layers with ReLU between), SGD with momentum and weight decay, ``select: last``, no regulariser.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from p2pfl.data.federated import PeerData
from p2pfl.learning.models import Hidden
from p2pfl.learning.state import State
from p2pfl.learning.training import Regularizer, TrainConfig, TrainResult, work

MAX_GROUP = 128
"""Peers per batched call: bounds the stacked weights and momenta held at once."""

Layer = tuple[str, str | None]
"""The state keys of one Linear layer: (weight, bias or None)."""


class DataPool:
    """Every peer's training data in one tensor, so a step gathers all peers' batches at once.

    Packing makes each peer's ``train_x``/``train_y`` a view into the pool, so the data is
    still held once. Copies on other devices are made on first use and kept.
    """

    def __init__(self, peers: list[PeerData]) -> None:
        self.peers = peers
        sizes = [p.num_train for p in peers]
        self.offsets = [0, *itertools.accumulate(sizes)][:-1]
        self._x = {torch.device("cpu"): torch.cat([p.train_x for p in peers])}
        self._y = {torch.device("cpu"): torch.cat([p.train_y for p in peers])}
        for p, start, n in zip(peers, self.offsets, sizes, strict=True):
            p.train_x = self._x[torch.device("cpu")][start : start + n]
            p.train_y = self._y[torch.device("cpu")][start : start + n]

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The pooled inputs, flattened to ``[samples, features]``, and labels on ``device``."""
        if device not in self._x:
            cpu = torch.device("cpu")
            self._x[device], self._y[device] = self._x[cpu].to(device), self._y[cpu].to(device)
        return self._x[device].flatten(1), self._y[device]


@dataclass
class Job:
    """One peer's training: its start state, which peer it is, its batch-order generator."""

    state: State
    peer: int
    generator: torch.Generator


def mlp_layers(module: nn.Module) -> list[Layer] | None:
    """The Linear layers of an MLP (Flatten, then Linear+ReLU blocks, then a Linear), in
    order; ``None`` for any other architecture (convolutions, norms, other activations) and
    for modules with forward hooks (e.g. position-aware neurons), which change the function."""
    if any(m._forward_hooks or m._forward_pre_hooks for m in module.modules()):
        return None
    children = list(module.named_children()) if isinstance(module, nn.Sequential) else []
    if not children or not isinstance(children[0][1], nn.Flatten):
        return None
    layers: list[Layer] = []
    for i, (name, child) in enumerate(children[1:], 1):
        last = i == len(children) - 1
        if last and type(child) is nn.Linear:
            prefix, linear = name, child
        elif (
            not last
            and type(child) is Hidden
            and type(child.layer) is nn.Linear
            and type(child.norm) is nn.Identity
            and type(child.act) is nn.ReLU
            and type(child.pool) is nn.Identity
        ):
            prefix, linear = f"{name}.layer", child.layer
        else:
            return None
        bias = f"{prefix}.bias" if linear.bias is not None else None
        layers.append((f"{prefix}.weight", bias))
    return layers


def supports(module: nn.Module, cfg: TrainConfig, regularizer: Regularizer | None) -> bool:
    """Whether a training of ``module`` with ``cfg`` can run batched."""
    return (
        cfg.optimizer == "sgd"
        and cfg.select == "last"
        and regularizer is None
        and mlp_layers(module) is not None
    )


def train_batched(
    module: nn.Module, pool: DataPool, jobs: list[Job], cfg: TrainConfig, device: torch.device
) -> list[TrainResult]:
    """Train every job's state with ``cfg`` (see :func:`supports`); one result per job.

    ``module`` is the architecture's template (only its structure is read). Each result's
    ``wall_s`` is an equal share of its group's wall time.
    """
    layers = mlp_layers(module)
    if layers is None:
        raise ValueError("batched training needs a p2pfl mlp")
    results: list[TrainResult] = []
    for i in range(0, len(jobs), MAX_GROUP):
        group = jobs[i : i + MAX_GROUP]
        start = time.perf_counter()
        states = _train_group(layers, pool, group, cfg, device)
        share = (time.perf_counter() - start) / len(group)
        for job, state in zip(group, states, strict=True):
            results.append(TrainResult(state, -1.0, *work(cfg, pool.peers[job.peer]), share))
    return results


def batch_plan(
    pool: DataPool, jobs: list[Job], batch_size: int, epochs: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every peer's batches, step by step, as rows of the pool.

    ``jobs`` must be sorted by data size, largest first. Returns ``index``
    ``[steps, peers, batch_size]`` (padding points at row 0), ``weight`` (1/batch size on
    real slots, 0 on padding: each peer's mean loss) and, per step, how many leading peers
    take it. The orders come from each job's generator exactly as the per-peer loop draws
    them.
    """
    per_peer = []
    for job in jobs:
        n = pool.peers[job.peer].num_train
        steps = math.ceil(n / batch_size)
        rows = torch.full((epochs, steps * batch_size), -1, dtype=torch.long)
        for e in range(epochs):
            rows[e, :n] = torch.randperm(n, generator=job.generator) + pool.offsets[job.peer]
        per_peer.append(rows.view(epochs * steps, batch_size))
    index = torch.full((len(per_peer[0]), len(jobs), batch_size), -1, dtype=torch.long)
    for p, rows in enumerate(per_peer):
        index[: len(rows), p] = rows
    real = index >= 0
    count = real.sum(-1, keepdim=True)
    active = (count.squeeze(-1) > 0).sum(-1).tolist()
    return index.clamp(min=0), real / count.clamp(min=1), active


def _train_group(
    layers: list[Layer], pool: DataPool, jobs: list[Job], cfg: TrainConfig, device: torch.device
) -> list[State]:
    """One batched SGD run over a group of peers; returns their trained CPU states."""
    order = sorted(range(len(jobs)), key=lambda i: -pool.peers[jobs[i].peer].num_train)
    ranked = [jobs[i] for i in order]
    index, weight, active = batch_plan(pool, ranked, cfg.batch_size, cfg.epochs)
    x_all, y_all = pool.on(device)
    index, weight = index.to(device), weight.to(device)
    keys = list(ranked[0].state)
    stacked = {k: torch.stack([j.state[k] for j in ranked]).to(device) for k in keys}
    momenta = {k: torch.empty_like(v) for k, v in stacked.items()} if cfg.momentum else {}
    with torch.no_grad():
        for step, k in enumerate(active):
            idx = index[step, :k]
            params = {name: v[:k] for name, v in stacked.items()}
            bufs = {name: v[:k] for name, v in momenta.items()}
            _step(layers, params, bufs, x_all[idx], y_all[idx], weight[step, :k], cfg, step == 0)
    trained = [{k: v[i].to("cpu", copy=True) for k, v in stacked.items()} for i in range(len(jobs))]
    states: list[State] = [{}] * len(jobs)
    for i, state in zip(order, trained, strict=True):
        states[i] = state
    return states


def _step(
    layers: list[Layer],
    params: dict[str, torch.Tensor],
    bufs: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    cfg: TrainConfig,
    first: bool,
) -> None:
    """One SGD step of every peer in the stack on its batch ``x`` ``[peers, batch, in]``;
    ``first``: the momentum buffers are still unset."""
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
            _sgd(params[b], bufs.get(b), cfg, grad.sum(1), first)
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
