"""MA-Echo (Su, Li, Xue, Neural Networks 2023): one-shot aggregation without server training.

Each peer trains its own model once, then computes one projection matrix P per layer from
its own data and sends, once, its weights (a ``model`` message) and its P's with its label
set (a ``statistics`` message). The aggregator looks for one model W whose change relative
to every local model falls in that peer's feature null space (§5.2 and Alg. 1, in the
official code's form; docs/maecho.md):

    W^l = mean_i W_i^l,  V_i^l = W_i^l;  classifier = class-aware mean, never iterated
    repeat tau times, per layer:  W ← W − η Σ_i α_i (W − V_i) P_i
                                  V_i ← V_i + η · [norm]((W − V_i)(I − P_i))

P is the *span* projector; the recursion builds the null-space projector Q = I − P with one
damped rank-1 update per mini-batch-mean feature row (§4's null-space projection, computed
"iteratively, as in OWM" like the official code). Weight matrices have output neurons as rows
(a conv kernel viewed as C_out × C_in·k_h·k_w); a bias is one more input column fed by a
constant 1 (:func:`p2pfl.learning.curvature.as_matrix`). Layers other than Linear/Conv2d
(BatchNorm) are averaged.

Placement ``star``: the centre aggregates and returns the model. ``mesh``: every peer sends
to every other and aggregates for itself, in peer order, so all end with the same model.
The aggregator reports one-shot FedAvg (plain and class-aware) and, with ``ensemble``, the
output ensembles of the same local models.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import derive_seed
from p2pfl.data.federated import FederatedData, PeerData
from p2pfl.learning.curvature import Layer, as_matrix, from_matrix, state_layer
from p2pfl.learning.state import average_states
from p2pfl.methods.base import METHODS, NodeContext
from p2pfl.methods.effects import (
    Behaviour,
    Compute,
    Effect,
    Evaluate,
    Finish,
    Recv,
    Report,
    Send,
    State,
    Train,
)
from p2pfl.methods.oneshot.payload import Part, as_received
from p2pfl.methods.oneshot.placement import UploadOnce, star_centre
from p2pfl.network.message import Message
from p2pfl.network.plan import Plan, Transfer

CONV_STRIDE = 2
"""Stride of the patches a conv layer's batch-mean input map is cut into (no padding), [C]."""


@dataclass(frozen=True)
class Statistics:
    """What a peer computes from its data: span projectors P per iterated layer (float64),
    the classifier layer's name and the label set (classes with more than one sample)."""

    projectors: dict[str, Tensor]
    classifier: str
    labels: Tensor


@dataclass(frozen=True)
class Contribution:
    """One peer's upload as the aggregator uses it: its weights and its statistics."""

    state: State
    stats: Statistics


# --- peer side: projection matrices ------------------------------------------------------


def owm_update(q: Tensor, rows: Tensor, damping: float, ridge: float) -> None:
    """Apply the damped recursive update ``Q ← Q − s·k kᵀ / (z + r k)``, ``k = Q rᵀ``, for
    each row ``r`` of ``rows`` in order, to the null-space projector ``q`` in place.

    With s = 1 the result is exactly ``I − Rᵀ(R Rᵀ + zI)⁻¹R``; with s < 1 it is a soft
    projector (eigenvalues of I − Q in [0, 1)). Every update is a symmetric outer product,
    so Q stays exactly symmetric.
    """
    for r in rows:
        k = q @ r
        q.addr_(k, k, alpha=-damping / (ridge + float(r @ k)))


def layers(module: nn.Module) -> list[tuple[str, Layer]]:
    """The weight layers MA-Echo handles (Linear and Conv2d), in module order; the last one
    is the classifier."""
    found: list[tuple[str, Layer]] = [
        (n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)
    ]
    for name, m in found:
        if isinstance(m, nn.Conv2d) and m.groups != 1:
            raise ValueError(f"MA-Echo handles ungrouped convolutions only; {name} has groups")
    return found


def input_width(layer: Layer) -> int:
    """d: the width of a layer's input rows (C_in·k_h·k_w for a conv), plus 1 for a bias."""
    return layer.weight[0].numel() + (layer.bias is not None)


def feature_rows(layer: Layer, mean_input: Tensor) -> Tensor:
    """The rows one batch adds to ``layer``'s recursion, from its batch-mean input: the
    vector itself for a Linear layer, the stride-2 patches (``unfold`` order, matching the
    kernel's ``view(C_out, -1)``) for a conv; with a trailing 1 when the layer has a bias."""
    if isinstance(layer, nn.Conv2d):
        rows = F.unfold(mean_input[None], layer.kernel_size, stride=CONV_STRIDE)[0].T
    else:
        rows = mean_input[None]
    if layer.bias is not None:
        rows = torch.cat([rows, rows.new_ones(len(rows), 1)], 1)
    return rows


def local_statistics(
    module: nn.Module,
    data: PeerData,
    device: torch.device,
    *,
    seed: int,
    batch_size: int,
    damping: float,
    ridge: float,
    ridge_conv: float,
) -> Statistics:
    """One pass (eval mode, seeded shuffle) over the peer's train set; each mini-batch adds
    the mean input of every layer but the classifier to that layer's recursion (as the
    official code does; docs/maecho.md).

    Runs as a ``Compute`` effect, with the trained state loaded into ``module``.
    """
    *iterated, (classifier, head) = layers(module)
    means: dict[str, Tensor] = {}

    def keep_mean(name: str, layer: nn.Module, inputs: tuple[Tensor, ...]) -> None:
        x = inputs[0].double()
        means[name] = x.mean(0) if isinstance(layer, nn.Conv2d) else x.flatten(0, -2).mean(0)

    eye = partial(torch.eye, dtype=torch.float64, device=device)
    nulls = {name: eye(input_width(m)) for name, m in iterated}
    hooks = [m.register_forward_pre_hook(partial(keep_mean, name)) for name, m in iterated]
    module.eval()
    order = torch.randperm(data.num_train, generator=torch.Generator().manual_seed(seed))
    try:
        with torch.no_grad():
            for i in range(0, data.num_train, batch_size):
                module(data.train_x[order[i : i + batch_size]].to(device))
                for name, m in iterated:
                    z = ridge_conv if isinstance(m, nn.Conv2d) else ridge
                    owm_update(nulls[name], feature_rows(m, means[name]), damping, z)
    finally:
        for hook in hooks:
            hook.remove()
    projectors = {name: (eye(len(q)) - q).cpu() for name, q in nulls.items()}
    labels = torch.bincount(data.train_y, minlength=head.weight.shape[0]) > 1
    return Statistics(projectors, classifier, labels)


# --- the wire format of the statistics ---------------------------------------------------


def pack(stats: Statistics, rank: int | None) -> State:
    """The ``statistics`` message's tensors: ``P/<layer>`` in float32, or with ``rank`` k the
    top-k eigenpairs ``U/<layer>`` (d×k) and ``S/<layer>`` (k); and the ``labels`` mask."""
    tensors: State = {}
    for layer, p in stats.projectors.items():
        if rank is None:
            tensors[f"P/{layer}"] = p.float()
        else:
            values, vectors = torch.linalg.eigh(p)
            k = min(rank, len(values))
            tensors[f"U/{layer}"] = vectors[:, -k:].float()
            tensors[f"S/{layer}"] = values[-k:].float()
    tensors["labels"] = stats.labels
    return tensors


def unpack(tensors: State, classifier: str) -> Statistics:
    """Statistics from a ``statistics`` message (rank-k factors rebuilt as U diag(S) Uᵀ)."""
    projectors = {}
    for name, t in tensors.items():
        kind, _, layer = name.partition("/")
        if kind == "P":
            projectors[layer] = t.double()
        elif kind == "U":
            u = t.double()
            projectors[layer] = (u * tensors[f"S/{layer}"].double()) @ u.T
    return Statistics(projectors, classifier, tensors["labels"])


# --- aggregator side ---------------------------------------------------------------------


def class_weights(labels: list[Tensor]) -> Tensor:
    """[N, C] weights of the class-aware average: class c is averaged over the peers that
    own it, or over all peers when none does (the code leaves a zero row there)."""
    owners = torch.stack(labels).to(torch.float64)
    owners[:, owners.sum(0) == 0] = 1.0
    return owners / owners.sum(0)


def class_aware_mean(states: list[State], layer: str, weights: Tensor) -> State:
    """The classifier ``layer`` (weight and bias) averaged row by row with ``weights``."""
    out = {}
    for key in (f"{layer}.weight", f"{layer}.bias"):
        if key in states[0]:
            ref = states[0][key]
            shape = (-1,) + (1,) * (ref.dim() - 1)
            acc = sum(w.view(shape) * s[key].double() for w, s in zip(weights, states, strict=True))
            out[key] = acc.to(ref.dtype)
    return out


def qp_weights(diffs: Tensor, c: float) -> Tensor:
    """α minimising ‖Σ_i α_i D_i‖²_F subject to Σα = 1, 0 ≤ α ≤ C: the dual QP of the
    paper's w-step, solved with CVXOPT on the Gram matrix scaled to max |G| = 1.

    ``diffs`` stacks the N matrices D_i. C below 1/N is raised to 1/N (the only feasible
    point is then uniform). Falls back to uniform α when G = 0 or the solver fails.
    """
    n = len(diffs)
    uniform = torch.full((n,), 1.0 / n, dtype=torch.float64)
    flat = diffs.reshape(n, -1)
    gram = (flat @ flat.T).cpu().numpy()
    scale = float(np.abs(gram).max())
    if n == 1 or c <= 1.0 / n or scale == 0 or not math.isfinite(scale):
        return uniform
    from cvxopt import matrix, solvers  # imported here: only the QP option needs it

    try:
        sol = solvers.qp(
            matrix(gram / scale),
            matrix(np.zeros(n)),
            matrix(np.vstack([-np.eye(n), np.eye(n)])),
            matrix(np.concatenate([np.zeros(n), np.full(n, c)])),
            matrix(np.ones((1, n))),
            matrix(1.0),
            options={"show_progress": False},
        )
    except (ValueError, ArithmeticError):
        return uniform
    if sol["status"] != "optimal":
        return uniform
    return torch.from_numpy(np.clip(np.array(sol["x"]).ravel(), 0.0, c))


EIG_TOL = 1e-6
"""Eigenvalues of a received P at or below this are dropped: the float32 wire format leaves
noise eigenvalues of about 1e-8 in P's null space (float32 eps is 1.2e-7)."""


def eigenbasis(p: Tensor) -> tuple[Tensor, Tensor]:
    """(U, λ): P ≈ U diag(λ) Uᵀ over the eigenvalues above :data:`EIG_TOL` (U is d × r)."""
    values, vectors = torch.linalg.eigh(p)
    keep = values > EIG_TOL
    return vectors[:, keep], values[keep]


def echo(
    ws: Tensor,
    ps: Tensor,
    *,
    tau: int,
    eta: float,
    norm: bool = False,
    qp_c: float | None = None,
    output: Literal["W", "mean_V"] = "W",
) -> Tensor:
    """The iterative W / V updates of one layer (§5.2, Alg. 1); returns W, or the mean of the V_i.

    ``ws`` stacks the N local C_out × d matrices and ``ps`` their d × d span projectors, all
    float64. α is uniform, or the QP's solution each step when ``qp_c`` is set.

    It works in each P_i's eigenbasis, P_i = U_i diag(λ_i) U_iᵀ with r_i ≤ d columns (a
    batch-mean P has rank at most the peer's number of mini-batches: 90-280 for 5
    Fashion-MNIST peers against d = 784). The W-step needs only Y_i = (W − V_i) U_i, and
    without ``norm`` the V-step acts on it elementwise, (W − V_i')U_i = (W − V_i)U_i ∘
    (1 − η + η λ_i), since P_i U_i = U_i λ_i. So an iteration costs two C_out × d × r_i
    products per peer; the V_i themselves are kept only for ``norm`` or ``mean_V``.
    """
    n = len(ws)
    bases = [eigenbasis(p) for p in ps]
    w = ws.mean(0)
    vs = ws.clone() if norm or output == "mean_V" else None
    ys = [(w - x) @ u for x, (u, _) in zip(ws, bases, strict=True)]
    alpha = torch.full((n, 1, 1), 1.0 / n, dtype=ws.dtype, device=ws.device)
    for _ in range(tau):
        diffs = torch.stack([(y * lam) @ u.T for y, (u, lam) in zip(ys, bases, strict=True)])
        if qp_c is not None:  # diffs are the (W − V_i) P_i
            alpha = qp_weights(diffs, qp_c).to(ws.device).view(n, 1, 1)
        step = eta * (alpha * diffs).sum(0)
        w = w - step
        for i, (u, lam) in enumerate(bases):
            z = ys[i] - step @ u  # (W − V_i) U_i with the new W
            if vs is not None:
                delta = (w - vs[i]) - (z * lam) @ u.T  # (W − V_i)(I − P_i): within the null space
                if norm:
                    delta = delta / delta.norm(dim=1, keepdim=True).clamp_min(1e-12)
                vs[i].add_(delta, alpha=eta)
            ys[i] = (w - vs[i]) @ u if norm and vs is not None else z * (1 - eta + eta * lam)
    return w if vs is None or output == "W" else vs.mean(0)


def aggregate(
    contributions: list[Contribution],
    *,
    tau: int,
    eta: float,
    norm: bool = False,
    qp_c: float | None = None,
    output: Literal["W", "mean_V"] = "W",
) -> State:
    """MA-Echo's global model from the peers' contributions (in a fixed peer order).

    Layers with projectors are iterated; the classifier is the class-aware mean; every other
    tensor is the plain mean. ``tau = 0`` gives one-shot FedAvg with a class-aware classifier.
    """
    states = [c.state for c in contributions]
    first = contributions[0].stats
    out = average_states(states)
    weights = class_weights([c.stats.labels for c in contributions])
    out.update(class_aware_mean(states, first.classifier, weights))
    for layer in first.projectors:
        info = state_layer(out, layer)
        ws = torch.stack([as_matrix(s, info).double() for s in states])
        ps = torch.stack([c.stats.projectors[layer] for c in contributions])
        m = echo(ws, ps, tau=tau, eta=eta, norm=norm, qp_c=qp_c, output=output)
        out.update({k: v.to(out[k].dtype) for k, v in from_matrix(m, info).items()})
    return out


# --- the method --------------------------------------------------------------------------


@METHODS.register("maecho")
@dataclass(kw_only=True, eq=False)
class MAEcho(UploadOnce):
    """One-shot aggregation with null-space projection matrices (star or full mesh).

    Args:
        tau: τ, the aggregation iterations.
        eta: η, the step of both updates (without the factor 2 of the paper's w-step).
        norm: normalise each row of the V-step's update to unit length (the code does for CNNs).
        damping: s, the damping of the projector recursion (1: the exact closed form).
        ridge: z, the ridge of the projectors of Linear layers.
        ridge_conv: z, the ridge of the projectors of Conv2d layers.
        batch_size: the mini-batch whose mean is one row of the recursion (independent of
            ``train.batch_size``).
        output: ``W`` (the paper) or ``mean_V`` (the official code: the mean of the V_i).
        qp: weight the peers by the paper's dual QP each iteration and layer (CVXOPT) instead of
            uniformly.
        qp_c: C, the QP's box, in (0, 1]; below 1/N it is raised to 1/N.
        rank: k: send the top-k eigenpairs of each projector instead of the full matrix (null:
            full).
        ensemble: also score the output ensembles on the test set (N extra forward passes).
    """

    tau: int = 60
    eta: float = 1.6
    norm: bool = False
    damping: float = 0.5
    ridge: float = 0.01**0.8
    ridge_conv: float = 1e-4
    batch_size: int = 64
    output: Literal["W", "mean_V"] = "W"
    qp: bool = False
    qp_c: float = 1.0
    rank: int | None = None
    ensemble: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau < 0:
            raise ConfigError("tau", "must be >= 0")
        if self.eta <= 0:
            raise ConfigError("eta", "must be > 0")
        if not 0 < self.damping <= 1:
            raise ConfigError("damping", "must be in (0, 1]")
        for key, value in (("ridge", self.ridge), ("ridge_conv", self.ridge_conv)):
            if value <= 0:
                raise ConfigError(key, "must be > 0")
        if self.batch_size < 1:
            raise ConfigError("batch_size", "must be >= 1")
        if not 0 < self.qp_c <= 1:
            raise ConfigError("qp_c", "must be in (0, 1]")
        if self.rank is not None and self.rank < 1:
            raise ConfigError("rank", "must be >= 1 (or null for the full matrices)")

    def check_data(self, model: nn.Module, data: FederatedData) -> None:
        """Every iterated conv layer is cut into kernel-sized patches of its input map,
        without padding (:func:`feature_rows`): each kernel must fit its map, which one
        blank sample through ``model`` measures. Token models (``char_lstm``,
        ``char_transformer``) are refused: their embeddings, recurrences and attention are
        no Linear or Conv2d layers whose inputs MA-Echo could project."""
        if not getattr(model, "input_dtype", torch.float32).is_floating_point:
            raise ConfigError(
                "model.name",
                "maecho projects the inputs of Linear and Conv2d layers; a token model's "
                "embedding, recurrent and attention layers are not such layers",
            )
        try:
            *iterated, _ = layers(model)
        except ValueError as e:
            raise ConfigError("model.name", str(e)) from None
        sizes: dict[str, tuple[int, ...]] = {}
        convs = [(n, m) for n, m in iterated if isinstance(m, nn.Conv2d)]
        hooks = [
            m.register_forward_pre_hook(lambda _, x, n=n: sizes.update({n: x[0].shape[-2:]}))
            for n, m in convs
        ]
        try:
            with torch.no_grad():
                model.eval()(torch.zeros(1, *data.input_shape))
        finally:
            for hook in hooks:
                hook.remove()
        for name, m in convs:
            if any(k > s for k, s in zip(m.kernel_size, sizes[name], strict=True)):
                raise ConfigError(
                    "model.name",
                    f"maecho cuts each conv layer's input into unpadded kernel-sized patches; "
                    f"{name}'s kernel {tuple(m.kernel_size)} does not fit its "
                    f"{'x'.join(map(str, sizes[name]))} input",
                )

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Phase 1: every peer uploads its model M and its statistics S (per iterated layer a
        d×d float32 span projector, or d×k + k with ``rank`` k; a bool mask of the C labels).
        Phase 2 (star): the centre returns the model. Star N·(M + S) + N·M, mesh
        N(N − 1)·(M + S)."""
        *iterated, (classifier, head) = layers(plan.module)
        zeros = {
            n: torch.zeros(input_width(m), input_width(m), dtype=torch.float64) for n, m in iterated
        }
        labels = torch.zeros(head.weight.shape[0], dtype=torch.bool)
        stats = pack(Statistics(zeros, classifier, labels), self.rank)
        meta = {"classifier": classifier}
        for p in plan.topology.peers:
            for dst in self.targets(plan.topology, p):
                yield plan.send(p, dst, "model", 1, 1, plan.state)
                yield plan.send(p, dst, "statistics", 1, 1, stats, meta)
        if self.placement == "star":
            for p in plan.topology.peers:
                yield plan.send(star_centre(plan.topology), p, "model", 1, 2, plan.state)

    def peer(self, ctx: NodeContext) -> Behaviour:
        """Train, compute the statistics, upload once; then aggregate (mesh) or wait (star)."""
        local = (yield Train(ctx.init_state(), 1)).state
        yield Evaluate(local, 0)
        fn = partial(
            local_statistics,
            seed=derive_seed(ctx.seed, "maecho-projection", ctx.node),
            batch_size=self.batch_size,
            damping=self.damping,
            ridge=self.ridge,
            ridge_conv=self.ridge_conv,
        )
        stats: Statistics = yield Compute(local, fn, passes=1 / 3)  # one forward pass
        tensors, meta = pack(stats, self.rank), {"classifier": stats.classifier}
        targets = self.targets(ctx.topology, ctx.node)
        own = [Part("model", local, {}, None), Part("statistics", tensors, meta, None)]
        for dst in targets:
            for kind, sent, sent_meta, codec in own:
                yield Send(dst, kind, 1, sent, sent_meta, codec)
        if self.placement == "star":
            if self.deadline_s is not None:  # the result may never come: keep the own model
                got = yield Recv(kinds=("model",), round=1, src=ctx.server, deadline=math.inf)
                yield Finish(got[0].tensors if got else local)
                return
            (msg,) = yield Recv(kinds=("model",), round=1, src=ctx.server)
            yield Finish(msg.tensors)
            return
        msgs = yield from self.uploads(2 * len(targets), 2)
        received = contributions(msgs + as_received(own, ctx.node, 1, ctx.compression))
        model = yield from self.combine(received, report=ctx.node == min(ctx.peers))
        yield Evaluate(model, 1)
        yield Finish(model)

    def centre(self, ctx: NodeContext) -> Behaviour:
        """The star's centre: aggregate every upload, report baselines, send the model back."""
        msgs = yield from self.uploads(2 * len(ctx.peers), 2)
        model = yield from self.combine(contributions(msgs), report=True)
        yield Evaluate(model, 1)
        for p in ctx.peers:
            yield Send(p, "model", 1, model)
        yield Finish(model, output=True)

    def combine(
        self, received: dict[int, Contribution], report: bool
    ) -> Generator[Effect, Any, State]:
        """Aggregate in peer order; with ``report``, also record the one-shot baselines."""
        ordered = [received[p] for p in sorted(received)]
        if report:
            states = [c.state for c in ordered]
            yield Report("fedavg", average_states(states))
            yield Report("fedavg_classaware", aggregate(ordered, tau=0, eta=self.eta))
            if self.ensemble:
                yield Report("ensemble", states)
                masks = [c.stats.labels for c in ordered]
                yield Report("ensemble_masked", states, class_weights(masks))
        qp_c = self.qp_c if self.qp else None
        return aggregate(
            ordered, tau=self.tau, eta=self.eta, norm=self.norm, qp_c=qp_c, output=self.output
        )


def contributions(msgs: list[Message]) -> dict[int, Contribution]:
    """Pair each sender's ``model`` and ``statistics`` messages."""
    models = {m.src: m.tensors for m in msgs if m.kind == "model"}
    return {
        m.src: Contribution(models[m.src], unpack(m.tensors, m.meta["classifier"]))
        for m in msgs
        if m.kind == "statistics"
    }
