"""Local work: training a model state on one peer's data, and scoring a state.

A single template module per device is reused for every peer: a peer's model exists only
as a CPU ``state_dict`` between its turns, and is loaded into the template for a step.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import bind
from p2pfl.data.federated import PeerData
from p2pfl.learning.graphs import Replayed
from p2pfl.learning.models import InputShape, forward_flops, mlp_layers, model_builder
from p2pfl.learning.state import State, clone_state

# Extra loss term: ``regularizer(module, ce)`` is added to the cross-entropy ``ce``.
Regularizer = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class Proximal:
    """(mu/2)·‖θ − anchor‖² over the parameters (FedProx's term; Li et al., 2020, Eq. 2):
    a :data:`Regularizer` that batched training can also apply to stacked weights."""

    anchor: State
    mu: float

    def __call__(self, module: nn.Module, ce: torch.Tensor) -> torch.Tensor:
        return self.of(dict(module.named_parameters()), ce)

    def of(self, params: dict[str, torch.Tensor], ce: torch.Tensor) -> torch.Tensor:
        """The term for ``params`` (a module's named parameters, in their order)."""
        total = ce.new_zeros(())
        for name, p in params.items():
            total = total + (p - self.anchor[name].to(p.device)).pow(2).sum()
        return 0.5 * self.mu * total


@dataclass(frozen=True)
class TrainConfig:
    """The ``train:`` section: how every local training runs (methods may override keys).

    ``optimizer: sam`` is sharpness-aware minimisation (Foret et al., 2021; DFedSAM's local
    optimiser) over SGD with ``momentum`` and ``weight_decay``: each step takes the gradient
    at w + rho·g/‖g‖ and applies it at w.

    Args:
        epochs: local epochs per training (>= 1).
        batch_size: samples per SGD step.
        optimizer: ``sgd``, ``adam`` or ``sam`` (sharpness-aware SGD); a fresh optimizer for every
            local training.
        lr: the learning rate (> 0).
        momentum: SGD's heavy-ball momentum, in [0, 1).
        weight_decay: L2-coupled weight decay (Adam's ``weight_decay``, not AdamW).
        rho: ``sam``: the ascent radius ρ.
        select: the model a training returns: its ``last`` epoch's, or ``best_val``: the epoch with
            the strictly best validation accuracy (ties keep the earlier).
    """

    epochs: int = 1
    batch_size: int = 32
    optimizer: Literal["sgd", "adam", "sam"] = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    rho: float = 0.05
    select: Literal["last", "best_val"] = "last"

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(key, "must be >= 1")
        if self.lr <= 0:
            raise ConfigError("lr", "must be > 0")
        if not 0 <= self.momentum < 1:
            raise ConfigError("momentum", "must be in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", "must be >= 0")
        if self.rho <= 0:
            raise ConfigError("rho", "must be > 0")

    def check_data(self, peers: list[PeerData]) -> None:
        """``select: best_val`` scores each epoch on the peer's validation split, so some
        peer must have one (the key is a full path: the need spans two sections)."""
        if self.select == "best_val" and not any(len(p.val_y) for p in peers):
            raise ConfigError(
                "partition.val_fraction",
                "leaves no validation samples, but train.select: best_val picks each "
                "training's best epoch on them; set it > 0 or train.select: last",
            )

    def with_overrides(self, overrides: dict[str, Any]) -> TrainConfig:
        """This config with some keys replaced (checked like the YAML section)."""
        return TrainConfig(**bind(TrainConfig, self.__dict__ | overrides)) if overrides else self


@dataclass
class TrainResult:
    """A trained state, its validation accuracy, and the work it took.

    ``train_samples`` counts forward+backward passes of one sample (SAM makes two per
    sample); ``skipped_steps`` counts steps dropped because the regularised loss was not
    finite.
    """

    state: State
    val_accuracy: float
    train_samples: int
    eval_samples: int
    wall_s: float
    skipped_steps: int = 0


def resolve_device(device: str) -> torch.device:
    """A ``peers.device`` value as a torch device; a CUDA device this host lacks is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{device} requested but no CUDA device is available")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ConfigError(
            "device",
            f"{device} requested but this host has {torch.cuda.device_count()} CUDA device(s)",
        )
    return torch.device(device)


class Trainer:
    """Trains and scores states of one architecture; also its FLOP-based compute model."""

    def __init__(
        self,
        model_options: dict[str, Any],
        input_shape: InputShape,
        num_classes: int,
        input_dtype: torch.dtype | None = None,  # the data's: int64 for tokens (text)
    ):
        self._build = model_builder(model_options, input_shape, num_classes, input_dtype)
        self._modules: dict[torch.device, nn.Module] = {torch.device("cpu"): self._build()}
        self.forward_flops = forward_flops(self._modules[torch.device("cpu")], input_shape)
        self.busy_s = 0.0  # wall time spent inside train/evaluate (the overhead floor)
        self.graphs = True  # on CUDA, the loop replays its full-size SGD steps (off: to compare)
        self._full: dict[tuple, _FullBatch] = {}
        self._init: dict[int, State] = {}
        self._layers: dict[torch.device, tuple[list[tuple[str, str | None]], dict] | None] = {}

    def init_state(self, seed: int) -> State:
        """The seeded initial model every peer shares (built once per seed, then copied:
        every node asks for it, and building a model costs more than copying one)."""
        if seed not in self._init:
            with torch.random.fork_rng(devices=[]):
                # the CPU's generator alone: models are built on the CPU, and torch.manual_seed
                # would also queue seeds for CUDA and two other backends, 0.3 ms of stack traces
                torch.default_generator.manual_seed(seed)
                self._init[seed] = clone_state(self._build().state_dict())
        return clone_state(self._init[seed])

    def module(self, device: torch.device) -> nn.Module:
        """The template on ``device``. On CUDA, cuDNN is held to deterministic algorithms:
        a run on a GPU replays bit for bit, as on the CPU (its default wgrad algorithms
        add with atomics, in no fixed order)."""
        if device not in self._modules:
            if device.type == "cuda":
                torch.backends.cudnn.deterministic = True
            self._modules[device] = self._build().to(device)
        return self._modules[device]

    def train(
        self,
        state: State,
        data: PeerData,
        cfg: TrainConfig,
        generator: torch.Generator,
        device: torch.device,
        regularizer: Regularizer | None = None,
    ) -> TrainResult:
        """Train a copy of ``state`` for ``cfg.epochs`` with a fresh optimizer.

        With ``select: best_val`` the returned state is the epoch with the strictly best
        validation accuracy (ties keep the earlier epoch), as in the FedELMY code. A step
        whose regularised loss is not finite is skipped (FedELMY's −α·d1 makes the loss
        unbounded below when α > β; docs/fedelmy.md).
        """
        start = time.perf_counter()
        model = self.module(device)
        model.load_state_dict(state)
        params = [p for p in model.parameters() if p.requires_grad]
        x_all, y_all = data.train_x.to(device), data.train_y.to(device)
        full = self._replayed(model, params, x_all, cfg, regularizer, device)
        opt = optimizer(params, cfg) if full is None else full.start()
        n = len(y_all)
        best_acc, best_state, skipped = -1.0, None, 0
        for _ in range(cfg.epochs):
            model.train()
            order = torch.randperm(n, generator=generator).to(device)
            for i in range(0, n, cfg.batch_size):
                idx = order[i : i + cfg.batch_size]
                if full is not None and len(idx) == cfg.batch_size:
                    full(x_all, y_all, idx)
                    continue
                # index_select: the rows of x_all[idx] in a third of its time
                x, y = x_all.index_select(0, idx), y_all.index_select(0, idx)
                skipped += not _step(model, params, opt, x, y, cfg, regularizer)
            if cfg.select == "best_val" and len(data.val_y):
                acc, _ = self._score(model, data.val_x, data.val_y, device)
                if acc > best_acc:
                    best_acc, best_state = acc, clone_state(model.state_dict())
        if best_state is None:
            best_state = clone_state(model.state_dict())
        wall = time.perf_counter() - start
        self.busy_s += wall
        return TrainResult(best_state, best_acc, *work(cfg, data), wall, skipped)

    def _replayed(
        self,
        model: nn.Module,
        params: list[nn.Parameter],
        x_all: torch.Tensor,
        cfg: TrainConfig,
        regularizer: Regularizer | None,
        device: torch.device,
    ) -> _FullBatch | None:
        """On CUDA, the full-size steps of plain SGD, one :class:`_FullBatch` for every
        training with the same batch size, optimizer settings and sample shape. Adam keeps
        its step count on the CPU and a regulariser's finiteness check reads the loss back,
        so they stay eager; so does SAM, whose capture was not tried on a GPU."""
        eager = regularizer is not None or cfg.optimizer != "sgd"
        if not self.graphs or device.type != "cuda" or eager:
            return None
        shape, dtype = x_all.shape[1:], x_all.dtype
        key = (device, shape, dtype, cfg.batch_size, cfg.lr, cfg.momentum, cfg.weight_decay)
        if key not in self._full:
            self._full[key] = _FullBatch(model, params, shape, dtype, cfg, device)
        return self._full[key]

    def evaluate(
        self, state: State, x: torch.Tensor, y: torch.Tensor, device: torch.device
    ) -> tuple[float, float]:
        """Accuracy (fraction) and mean cross-entropy of ``state`` on ``(x, y)``.

        A plain MLP (:func:`p2pfl.learning.models.mlp_layers`) is scored as a function of
        the state's own tensors: the template's forward pass, the same ``F.linear`` and
        ``relu`` calls on the same values, so the same bits, without ``load_state_dict``'s
        copies and the modules' calls (a quarter of a 10⁴-peer DFedAvgM round's scoring,
        docs/performance.md)."""
        start = time.perf_counter()
        layers = self._plain(state, device)
        if layers is None:
            model = self.module(device)
            model.load_state_dict(state)
            result = self._score(model, x, y, device)
        else:
            result = score(functools.partial(_mlp_forward, layers), x, y, device)
        self.busy_s += time.perf_counter() - start
        return result

    def _plain(
        self, state: State, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        """The (weight, bias) of each Linear layer of ``state`` on ``device``, where the
        template is a plain MLP and ``state`` has its keys and each tensor its shape, dtype
        and contiguous layout (what ``load_state_dict`` would copy in unchanged), each
        aligned as torch aligns a parameter (64 bytes: a BLAS may sum in another order from
        another alignment; a view into a received frame need not be); else ``None`` (scored
        through the template, whose errors a bad state then raises)."""
        if device not in self._layers:
            module = self.module(device)
            layers = mlp_layers(module)
            params = {k: (v.shape, v.dtype) for k, v in module.state_dict().items()}
            self._layers[device] = None if layers is None else (layers, params)
        known = self._layers[device]
        if known is None:
            return None
        layers, params = known
        if state.keys() != params.keys():
            return None
        for k, v in state.items():
            if (v.shape, v.dtype) != params[k] or v.layout != torch.strided:
                return None
            if not v.is_contiguous():
                return None
        weights = [
            (state[w].to(device), None if b is None else state[b].to(device)) for w, b in layers
        ]
        for pair in weights:
            if any(t is not None and _address(t) % _ALIGNED for t in pair):
                return None
        return weights

    @staticmethod
    def _score(
        model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device
    ) -> tuple[float, float]:
        model.eval()
        return score(model, x, y, device)

    def compute_flops(self, train_samples: int, eval_samples: int) -> float:
        """FLOPs the compute model charges: 3x forward per trained sample, 1x per scored one."""
        return self.forward_flops * (3.0 * train_samples + eval_samples)


@torch.no_grad()
def score(
    forward: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    batch: int = 2048,
) -> tuple[float, float]:
    """Accuracy (fraction) and mean cross-entropy of ``forward`` (a model in eval mode, or
    a functional call of stacked weights) on ``(x, y)``, ``batch`` samples at a time."""
    correct, loss = 0, 0.0
    for i in range(0, len(y), batch):
        xb, yb = x[i : i + batch].to(device), y[i : i + batch].to(device)
        out = forward(xb)
        loss += _cross_entropy_sum(out, yb)
        correct += int((out.argmax(1) == yb).sum())
    return correct / max(len(y), 1), loss / max(len(y), 1)


def _mlp_forward(
    layers: list[tuple[torch.Tensor, torch.Tensor | None]], x: torch.Tensor
) -> torch.Tensor:
    """A plain MLP's forward pass (``Flatten``, then ``Linear`` + ``ReLU`` blocks, then a
    ``Linear``) with the given weights: the calls its modules make, in their order."""
    h = x.flatten(1)
    for i, (w, b) in enumerate(layers):
        h = F.linear(h, w, b)
        if i < len(layers) - 1:
            h = h.relu_()  # ReLU's values, in the product's own memory (no second copy)
    return h


def _cross_entropy_sum(out: torch.Tensor, y: torch.Tensor) -> float:
    """``F.cross_entropy(out, y, reduction="sum").item()``, bit for bit.

    That call is ``nll_loss(log_softmax(out, 1))``; on a CPU torch's kernel for a softmax
    over the last dimension pays its reductions once per row, 0.15 ms for 1,000 rows of
    10 classes, more than the rest of a small MLP's scoring but its product. Over the
    first dimension of the transposed logits it runs across rows, a vector of rows at a
    time, 5x faster; its sums run in the same order and its ``exp`` and ``log`` are the same
    vector functions where every row is in a full vector (the rows are padded to a multiple
    of 32), so the bits are the same. That is checked once per process and shape class
    (:func:`_transposed_ok`) against torch's own call; where it differs the call is kept."""
    if (
        out.device.type != "cpu"
        or out.dim() != 2
        or y.dim() != 1
        or y.dtype != torch.long
        or not _transposed_ok(out.dtype, out.shape[1])
    ):
        return F.cross_entropy(out, y, reduction="sum").item()
    return F.nll_loss(_log_softmax_rows(out), y, reduction="sum").item()


def _log_softmax_rows(out: torch.Tensor) -> torch.Tensor:
    """``log_softmax(out, 1)`` computed over the first dimension of ``out``'s transpose,
    its rows padded with zeros to a multiple of 32."""
    n, c = out.shape
    t = out.new_zeros(c, n + (-n) % 32)
    t[:, :n] = out.t()
    return F.log_softmax(t, 0)[:, :n].t()


_READ_ADDRESS: Callable[[torch.Tensor], int] = getattr(
    torch.Tensor, "const_data_ptr", torch.Tensor.data_ptr
)
"""``const_data_ptr``, else (torch 2.11, and torch's stubs) ``data_ptr``: see :func:`_address`."""


def _address(t: torch.Tensor) -> int:
    """Where ``t``'s first element lies, read without a write access: ``data_ptr`` copies a
    copy-on-write tensor (a state that a sent message shares, ``wire._private_copy``) into
    memory of its own, a second model per peer. torch 2.11 has no ``const_data_ptr``:
    there ``data_ptr`` gives the same address, at that memory's cost."""
    return int(_READ_ADDRESS(t))


_ALIGNED = 64
"""The alignment of torch's CPU allocations (and a divisor of CUDA's), so of a parameter's
bytes: a state's tensors are scored as they are only where theirs is as good."""

_TRANSPOSED: dict[tuple[torch.dtype, int], bool] = {}


def _transposed_ok(dtype: torch.dtype, classes: int) -> bool:
    """Whether :func:`_log_softmax_rows` gives ``log_softmax``'s bits for ``classes``
    classes of ``dtype`` on this CPU and torch build: checked once, on random logits of
    many scales and row counts (the kernels' order does not depend on the values)."""
    key = (dtype, classes)
    if key not in _TRANSPOSED:
        ok = dtype in (torch.float32, torch.float64) and 1 < classes <= 16
        if ok:
            gen = torch.Generator().manual_seed(0)
            for rows, scale in itertools.product((1, 15, 33, 1000, 2048), (1e-3, 1.0, 30.0, 1e3)):
                logits = torch.randn(rows, classes, generator=gen, dtype=dtype) * scale
                labels = torch.randint(classes, (rows,), generator=gen)
                fast = _log_softmax_rows(logits)
                want = F.log_softmax(logits, 1)
                loss = F.nll_loss(fast, labels, reduction="sum")
                same = F.cross_entropy(logits, labels, reduction="sum")
                if not (torch.equal(fast, want) and torch.equal(loss, same)):
                    ok = False
                    break
        _TRANSPOSED[key] = ok
    return _TRANSPOSED[key]


class _CpuOptimizer:
    """``torch.optim.SGD`` and ``Adam`` as torch runs them on a CPU (their single-tensor
    updates: the same operations in the same order, so the same bits), without
    ``torch.optim``'s per-step Python (hooks, profiler records, its compiler guards) or the
    lazy import of torch's compiler on first use (2 s and 140 MiB per process). A training
    of a few milliseconds paid as much again in that machinery (docs/performance.md)."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: TrainConfig) -> None:
        self.params, self.cfg = params, cfg
        self.state: list[list[torch.Tensor] | None] = [None] * len(params)
        self.steps = [0] * len(params)

    @torch.no_grad()
    def step(self) -> None:
        cfg = self.cfg
        for i, p in enumerate(self.params):
            if p.grad is None:  # as torch.optim: a parameter without a gradient stays
                continue
            grad = p.grad
            if cfg.optimizer == "adam":
                self._adam(i, p, grad)
                continue
            if cfg.weight_decay != 0:
                grad = grad.add(p, alpha=cfg.weight_decay)
            if cfg.momentum != 0:
                if (state := self.state[i]) is None:
                    self.state[i] = [grad.detach().clone()]
                    grad = self.state[i][0]  # type: ignore[index]
                else:
                    grad = state[0].mul_(cfg.momentum).add_(grad, alpha=1)
            p.add_(grad, alpha=-cfg.lr)

    def _adam(self, i: int, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Adam with the default betas and eps, L2 weight decay added to the gradient."""
        beta1, beta2, eps, cfg = 0.9, 0.999, 1e-8, self.cfg
        if (state := self.state[i]) is None:
            zeros = [torch.zeros_like(p, memory_format=torch.preserve_format) for _ in "ms"]
            state = self.state[i] = zeros
        exp_avg, exp_avg_sq = state
        self.steps[i] += 1
        step = float(self.steps[i])
        if cfg.weight_decay != 0:
            grad = grad.add(p, alpha=cfg.weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = cfg.lr / (1 - beta1**step)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-step_size)


def optimizer(
    params: Sequence[torch.Tensor], cfg: TrainConfig
) -> _CpuOptimizer | torch.optim.Optimizer:
    """The local optimizer of ``cfg`` (SAM's base is SGD): on a CPU :class:`_CpuOptimizer`;
    elsewhere ``torch.optim``, whose multi-tensor kernels a GPU needs."""
    if all(p.device.type == "cpu" for p in params):
        return _CpuOptimizer(params, cfg)
    return torch_optimizer(params, cfg)


def torch_optimizer(params: Sequence[torch.Tensor], cfg: TrainConfig) -> torch.optim.Optimizer:
    """``torch.optim``'s optimizer for ``cfg`` (SAM's base is SGD)."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def work(cfg: TrainConfig, data: PeerData) -> tuple[int, int]:
    """(samples trained, samples scored) by one training with ``cfg`` on ``data``.

    Known before the training runs, so a runtime can charge its simulated time up front.
    SAM makes two passes per sample; ``best_val`` scores the validation split every epoch.
    """
    passes = 2 if cfg.optimizer == "sam" else 1
    scored = len(data.val_y) * cfg.epochs if cfg.select == "best_val" else 0
    return passes * data.num_train * cfg.epochs, scored


class _FullBatch:
    """Full-size SGD steps of the template module as one :class:`Replayed` step, kept
    for every training with the same settings: the weights, the optimizer's momentum
    buffers and the batch are the same tensors in each, so the step is captured once
    per run, not once per training (a capture cost about three eager steps)."""

    def __init__(
        self,
        model: nn.Module,
        params: list[nn.Parameter],
        shape: torch.Size,
        dtype: torch.dtype,
        cfg: TrainConfig,
        device: torch.device,
    ) -> None:
        self.opt = opt = torch_optimizer(params, cfg)
        x = self.x = torch.zeros(cfg.batch_size, *shape, dtype=dtype, device=device)
        y = self.y = torch.zeros(cfg.batch_size, dtype=torch.long, device=device)

        def run() -> None:  # holds no reference to self: no cycle keeps a graph alive
            _step(model, params, opt, x, y, cfg)

        self.step = Replayed(run, device)

    def start(self) -> torch.optim.Optimizer:
        """A training begins; its optimizer. A fresh optimizer's first step sets each
        momentum buffer to the gradient; the kept buffers are zeroed, so that the step
        they take, m·0 + g, sets them to it too."""
        bufs = [s["momentum_buffer"] for s in self.opt.state.values()]
        if bufs:
            torch._foreach_zero_(bufs)
        return self.opt

    def __call__(self, x_all: torch.Tensor, y_all: torch.Tensor, idx: torch.Tensor) -> None:
        """One step on the rows ``idx`` of ``(x_all, y_all)``."""
        torch.index_select(x_all, 0, idx, out=self.x)
        torch.index_select(y_all, 0, idx, out=self.y)
        self.step()


def _step(
    model: nn.Module,
    params: list[nn.Parameter],
    opt: _CpuOptimizer | torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    regularizer: Regularizer | None = None,
) -> bool:
    """One optimizer step on the batch ``(x, y)``; False if it was skipped because the
    regularised loss was not finite (checked only with a regulariser)."""
    loss = _loss(model, x, y, regularizer)
    if regularizer is not None and not torch.isfinite(loss):
        return False
    for p in params:
        p.grad = None
    loss.backward()
    if cfg.optimizer == "sam":
        _sam_gradient(model, params, x, y, regularizer, cfg.rho)
    opt.step()
    return True


def _loss(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, regularizer: Regularizer | None
) -> torch.Tensor:
    """Cross-entropy on one batch plus the method's regulariser, if any."""
    ce = F.cross_entropy(model(x), y)
    return ce + regularizer(model, ce) if regularizer else ce


def _sam_gradient(
    model: nn.Module,
    params: list[nn.Parameter],
    x: torch.Tensor,
    y: torch.Tensor,
    regularizer: Regularizer | None,
    rho: float,
) -> None:
    """Replace the gradients g at w by the gradient at w + rho·g/‖g‖ (SAM, non-adaptive).

    The first pass (the caller's) updated the BatchNorm running statistics; this second
    pass leaves every buffer as it found it, as in the DFedSAM code. The weights go back to
    w bit for bit, so the base optimizer then steps from w.
    """
    with torch.no_grad():
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        scale = rho / (norm + 1e-12)
        saved = [p.detach().clone() for p in params]
        for p in params:
            if p.grad is not None:
                p.add_(p.grad * scale)
        buffers = [b.detach().clone() for b in model.buffers()]
    model.zero_grad(set_to_none=True)
    _loss(model, x, y, regularizer).backward()
    with torch.no_grad():
        for p, w in zip(params, saved, strict=True):
            p.copy_(w)
        for b, v in zip(model.buffers(), buffers, strict=True):
            b.copy_(v)
