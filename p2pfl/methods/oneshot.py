"""One-shot aggregation from uploaded models and curvature statistics (FedFisher spec §1–3).

Every peer trains once from the shared init, computes the statistics its aggregator needs
(:mod:`p2pfl.learning.curvature`) on its own training data, and sends, once, its model (a ``model``
message with its sample count) and one ``statistics`` message per kind of statistic
(``diag``, ``kfac``, ``gram``). A method is a *merge*: what it needs and the candidate
models it builds from the uploads. This base class is itself the one-shot FedAvg merge
(Σ p_i w_i, p_i = n_i / N); FedFisher, Fisher merging and RegMean subclass it.

Placement ``star``: the centre merges and sends the result back. ``mesh``: every peer sends
to every other and merges for itself, with its own upload decoded from exactly the bytes it
sent, in peer order, so all peers end with the same model.

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

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from p2pfl.core.errors import ConfigError
from p2pfl.data.federated import PeerData
from p2pfl.learning.curvature import LayerInfo, covered_layers, curvature, layer_info
from p2pfl.learning.state import average_states
from p2pfl.methods.base import METHODS, Method, NodeContext
from p2pfl.methods.effects import (
    Behaviour,
    Compute,
    Evaluate,
    Finish,
    Log,
    Recv,
    Report,
    Send,
    State,
    Train,
)
from p2pfl.network import quantize as cz
from p2pfl.network.message import Message, Meta
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import Topology

BASELINES = ("fedavg", "fisher_merge", "regmean", "fedfisher_diag", "fedfisher_kfac")
MODEL_BITS = 16
UPLOAD, VALIDATION, RESULT = 1, 2, 3


@dataclass
class Upload:
    """One peer's upload as an aggregator sees it (decompressed)."""

    src: int
    num_samples: int
    state: State
    stats: dict[str, dict[str, Tensor]]
    layers: dict[str, dict[str, LayerInfo]]  # per statistic kind: covered layers by name


def shares(uploads: list[Upload]) -> list[float]:
    """p_i = n_i / N."""
    total = sum(u.num_samples for u in uploads)
    return [u.num_samples / total for u in uploads]


def fedavg(uploads: list[Upload]) -> State:
    """Σ p_i w_i (accumulated in float64)."""
    return average_states([u.state for u in uploads], [float(u.num_samples) for u in uploads])


class OneShot(Method):
    """One-shot FedAvg; the base of the one-shot merges (see the module docstring)."""

    name: ClassVar[str] = "fedavg"
    topologies = ("star", "mesh")
    #: statistics the merge needs from every peer
    needs: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        placement: Literal["star", "mesh"] = "star",
        compress: bool = False,
        triangle: bool = True,
        select: Literal["val", "final"] = "val",
        baselines: tuple[str, ...] = ("fedavg",),
    ) -> None:
        for b in baselines:
            if b not in BASELINES:
                raise ConfigError("baselines", f"unknown baseline {b!r}; choose from {BASELINES}")
            if b == self.label:
                raise ConfigError("baselines", f"{b!r} is the method itself")
        self.placement = placement
        self.compress = compress
        self.triangle = triangle
        self.select = select
        self.baselines = tuple(dict.fromkeys(baselines))

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
        """The upload and selection settings a baseline shares with this method."""
        return dict(
            placement=self.placement, compress=self.compress, triangle=self.triangle,
            select=self.select, baselines=(),
        )  # fmt: skip

    def baseline(self, name: str) -> OneShot:
        """The merge a baseline name stands for, with this method's :meth:`common` settings."""
        if name == "fedavg":
            return OneShot(**self.common())
        if name.startswith("fedfisher_"):
            fisher = name.removeprefix("fedfisher_")
            return METHODS.get("fedfisher")(fisher=fisher, **self.common())
        return METHODS.get(name)(**self.common())

    # --- topology and plan ----------------------------------------------------------------

    def check(self, topology: Topology, seed: int) -> None:
        if self.placement == "star" and topology.server is None:
            raise ConfigError(
                "kind", f"{self.name} with placement: star needs kind: star, not {topology.kind!r}"
            )
        complete = all(
            len(topology.neighbours(p)) == topology.num_peers - 1 for p in topology.peers
        )
        if self.placement == "mesh" and (topology.server is not None or not complete):
            raise ConfigError(
                "kind",
                f"{self.name} with placement: mesh needs a complete graph of peers (kind: mesh), "
                f"not {topology.kind!r}",
            )

    def rounds(self, num_peers: int) -> int:
        return 1

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

    def targets(self, topology: Topology, node: int) -> list[int]:
        """Where a peer uploads: the star's centre, or every other peer (mesh)."""
        if self.placement == "star":
            return [topology.server]
        return [p for p in topology.peers if p != node]

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Phase 1: every peer uploads its model (with its sample count) and one message per
        statistic its merges need, to the centre (star) or to every other peer (mesh). With
        ``select: val`` and K candidates in all: star, the centre sends the K stacked models
        to every peer (phase 2) and each returns its correct counts (phase 3); mesh, every
        peer sends its counts to every other (phase 2). Star: the centre returns the model."""
        topology = plan.topology
        stats = shaped_statistics(plan.module, self.kinds())
        for p in topology.peers:
            payload = self.encode(plan.state, stats, plan.num_train[p])
            for dst in self.targets(topology, p):
                for kind, tensors, meta in payload:
                    yield plan.send(p, dst, kind, UPLOAD, 1, tensors, meta)
        phase = 2
        if self.voting():
            count = sum(m.count() for m in self.merges if m.count() > 1)
            correct = {"correct": torch.zeros(count, dtype=torch.int64)}
            if self.placement == "star":
                stacked, server = stack([plan.state] * count), topology.server
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
                yield plan.send(topology.server, p, "model", RESULT, phase, plan.state)

    # --- behaviour --------------------------------------------------------------------------

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        return self.centre(ctx) if ctx.is_server else self.peer(ctx)

    def peer(self, ctx: NodeContext) -> Behaviour:
        trained = (yield Train(ctx.init_state(), UPLOAD)).state
        kinds = self.kinds()
        stats = {}
        if kinds:
            classes = next(reversed(trained.values())).shape[0]  # the output layer's rows
            passes = (1 + 2 * classes) / 3 if {"diag", "kfac"} & set(kinds) else 1 / 3
            stats = yield Compute(trained, partial(local_statistics, kinds=kinds), passes)
        payload = self.encode(trained, stats, ctx.num_samples)
        others = [p for p in ctx.peers if p != ctx.node]
        for dst in self.targets(ctx.topology, ctx.node):
            for kind, tensors, meta in payload:
                yield Send(dst, kind, UPLOAD, tensors, meta)
        if self.placement == "star":
            if self.voting():
                (msg,) = yield Recv(kinds=("model",), round=VALIDATION)
                yield from self.vote(ctx, unstack(msg.tensors, msg.meta["count"]), [msg.src])
            (msg,) = yield Recv(kinds=("model",), round=RESULT)
            yield Finish(msg.tensors)
            return
        own = [Message(k, ctx.node, ctx.node, UPLOAD, t, m) for k, t, m in payload]
        msgs = yield Recv(
            kinds=("model", "statistics"), count=len(others) * len(payload), round=UPLOAD
        )
        uploads = self.decode(own + msgs, ctx.init_state())
        state = yield from self.aggregate(ctx, uploads, report=ctx.node == ctx.peers[0])
        yield Finish(state)

    def centre(self, ctx: NodeContext) -> Behaviour:
        per_peer = 1 + len(self.kinds())
        msgs = yield Recv(
            kinds=("model", "statistics"), count=len(ctx.peers) * per_peer, round=UPLOAD
        )
        uploads = self.decode(msgs, ctx.init_state())
        state = yield from self.aggregate(ctx, uploads, report=True)
        for p in ctx.peers:
            yield Send(p, "model", RESULT, state)
        yield Finish(state, output=True)

    def aggregate(self, ctx: NodeContext, uploads: list[Upload], report: bool) -> Behaviour:
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
            if seen == 0:
                raise ValueError("select: val needs validation data: partition.val_fraction > 0")
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
            for m, c, best in zip(self.merges, lists, chosen, strict=True):
                if m is not self:
                    yield Report(m.label, best)
                if self.voting() and len(c) > 1:
                    yield Report(f"{m.label}@last", c[-1])
            yield Evaluate(chosen[0], UPLOAD)
        return chosen[0]

    def vote(self, ctx: NodeContext, cands: list[State], to: list[int]) -> Behaviour:
        """Score ``cands`` on this peer's validation split and send the correct-answer counts
        to ``to``; returns (counts, validation size)."""
        counts, n_val = yield Compute(cands[0], partial(count_correct, cands=cands), 0)
        for dst in to:
            yield Send(dst, "control", VALIDATION, {"correct": counts}, {"samples": n_val})
        return counts, n_val

    def collect(self, voters: list[int]) -> Behaviour:
        """Sum the counts ``voters`` send; returns (counts, pooled validation size)."""
        msgs = yield Recv(kinds=("control",), count=len(voters), round=VALIDATION)
        correct = sum(m.tensors["correct"] for m in msgs)
        return correct, sum(m.meta["samples"] for m in msgs)

    # --- what travels -----------------------------------------------------------------------

    def encode(
        self, state: State, stats: dict[str, dict[str, Any]], num_samples: int
    ) -> list[tuple[str, State, Meta]]:
        """The upload as (kind, tensors, meta) messages: the model, then one per statistic."""
        out = [("model", self.encode_tensors(state), {"num_samples": num_samples})]
        for kind in self.kinds():
            values, infos = stats[kind]
            meta: Meta = {"stat": kind, "layers": {n: info_meta(i) for n, i in infos.items()}}
            if kind == "diag":
                out.append(("statistics", self.encode_tensors(values), meta))
                continue
            dims = [n for i in infos.values() for n in factor_dims(kind, i)]
            mats = {n + f: values[n + f] for n in infos for f in factors(kind)}
            if self.compress:
                rank = cz.lowrank_rank(model_size(state), dims)
                meta["rank"] = rank
                out.append(("statistics", encode_lowrank(mats, rank), meta))
            elif self.triangle:
                out.append(("statistics", {k: upper(v) for k, v in mats.items()}, meta))
            else:
                out.append(("statistics", mats, meta))
        return out

    def encode_tensors(self, tensors: State) -> State:
        """Floating tensors as 16-bit codes and a scale each when compressing."""
        if not self.compress:
            return dict(tensors)
        out: State = {}
        for name, t in tensors.items():
            if not t.is_floating_point():
                out[name] = t
                continue
            codes, scale = cz.quantize(t, MODEL_BITS)
            out[name] = cz.int16_bytes(codes)
            out[f"{name}#scale"] = scale
        return out

    def decode_tensors(self, tensors: State, like: State) -> State:
        if not self.compress:
            return dict(tensors)
        out: State = {}
        for name, ref in like.items():
            if name not in tensors:
                continue
            t = tensors[name]
            if ref.is_floating_point():
                codes = cz.int16_from_bytes(t, ref.shape)
                t = cz.dequantize(codes, tensors[f"{name}#scale"], MODEL_BITS).to(ref.dtype)
            out[name] = t
        return out

    def decode(self, msgs: list[Message], like: State) -> list[Upload]:
        """The uploads in peer order, decompressed. ``like`` gives names, shapes, dtypes."""
        uploads: dict[int, Upload] = {}
        for msg in sorted(msgs, key=lambda m: (m.src, m.kind != "model")):
            if msg.kind == "model":
                state = self.decode_tensors(msg.tensors, like)
                uploads[msg.src] = Upload(msg.src, msg.meta["num_samples"], state, {}, {})
                continue
            kind = msg.meta["stat"]
            infos = {n: info_from_meta(n, m) for n, m in msg.meta["layers"].items()}
            up = uploads[msg.src]
            up.layers[kind] = infos
            if kind == "diag":
                up.stats[kind] = self.decode_tensors(msg.tensors, like)
            elif self.compress:
                up.stats[kind] = decode_lowrank(msg.tensors, kind, infos, msg.meta["rank"])
            elif self.triangle:
                up.stats[kind] = {k: symmetric(v) for k, v in msg.tensors.items()}
            else:
                up.stats[kind] = dict(msg.tensors)
        return [uploads[s] for s in sorted(uploads)]


# --- local statistics ------------------------------------------------------------------------


def local_statistics(
    module: nn.Module, data: PeerData, device: torch.device, kinds: tuple[str, ...]
) -> dict[str, tuple[dict[str, Tensor], dict[str, LayerInfo]]]:
    """The statistics ``kinds`` of the loaded model on the peer's training data, each with
    the layers it covers (runs as a ``Compute`` effect)."""
    stats = curvature(module, data.train_x.to(device), kinds)
    layers = {n: layer_info(n, m) for n, m in covered_layers(module).items()}
    linear = {n: i for n, i in layers.items() if isinstance(module.get_submodule(n), nn.Linear)}
    return {k: (stats[k], linear if k == "gram" else layers) for k in kinds}


def shaped_statistics(module: nn.Module, kinds: tuple[str, ...]) -> dict[str, Any]:
    """Zero statistics of the shapes :func:`local_statistics` returns (for size analysis)."""
    layers = {n: layer_info(n, m) for n, m in covered_layers(module).items()}
    linear = {n: i for n, i in layers.items() if isinstance(module.get_submodule(n), nn.Linear)}
    out: dict[str, Any] = {}
    for kind in kinds:
        infos = linear if kind == "gram" else layers
        if kind == "diag":
            values = {k: torch.zeros(v.shape) for k, v in module.state_dict().items()}
        else:
            values = {
                n + f: torch.zeros(side, side)
                for n, i in infos.items()
                for f, side in zip(factors(kind), factor_dims(kind, i), strict=True)
            }
        out[kind] = (values, infos)
    return out


@torch.no_grad()
def count_correct(
    module: nn.Module, data: PeerData, device: torch.device, cands: list[State]
) -> tuple[Tensor, int]:
    """Correct answers of each candidate on the peer's validation split, and its size."""
    x, y = data.val_x.to(device), data.val_y.to(device)
    module.eval()
    counts = []
    for state in cands:
        module.load_state_dict(state)
        counts.append(int((module(x).argmax(1) == y).sum()) if len(y) else 0)
    return torch.tensor(counts, dtype=torch.int64), len(y)


# --- encodings -----------------------------------------------------------------------------


def factors(kind: str) -> tuple[str, ...]:
    """Key suffixes of the matrices sent per layer: K-FAC's A and G, or the one Gram."""
    return (".A", ".G") if kind == "kfac" else ("",)


def factor_dims(kind: str, info: LayerInfo) -> list[int]:
    """Side of each square matrix sent for a layer: (a, g) for K-FAC, the inputs for a Gram."""
    return [info.cols, info.rows] if kind == "kfac" else [info.cols - info.bias]


def model_size(state: State) -> int:
    """d: the number of floating entries of a model state."""
    return sum(t.numel() for t in state.values() if t.is_floating_point())


def info_meta(info: LayerInfo) -> list[Any]:
    return [list(info.weight_shape), info.bias]


def info_from_meta(name: str, meta: list[Any]) -> LayerInfo:
    shape, bias = tuple(meta[0]), bool(meta[1])
    cols = 1
    for n in shape[1:]:
        cols *= n
    return LayerInfo(name, shape, bias, shape[0], cols + int(bias))


def upper(m: Tensor) -> Tensor:
    """The upper triangle (diagonal included) of a square matrix, row by row."""
    i, j = torch.triu_indices(m.shape[0], m.shape[0])
    return m[i, j].contiguous()


def symmetric(tri: Tensor) -> Tensor:
    """The symmetric matrix whose upper triangle is ``tri`` (inverse of :func:`upper`)."""
    n = int((8 * tri.numel() + 1) ** 0.5 - 1) // 2
    i, j = torch.triu_indices(n, n)
    m = tri.new_zeros(n, n)
    m[i, j] = tri
    m[j, i] = tri
    return m


def encode_lowrank(mats: dict[str, Tensor], rank: int) -> State:
    """All matrices as one 9-bit stream ``codes`` plus three scales per matrix."""
    codes, out = [], {}
    for name, m in mats.items():
        c, scales = cz.lowrank_encode(m, rank)
        codes.append(c)
        out[f"{name}#scale"] = scales
    return {"codes": cz.pack_bits(torch.cat(codes), cz.FACTOR_BITS)} | out


def decode_lowrank(
    tensors: State, kind: str, infos: dict[str, LayerInfo], rank: int
) -> dict[str, Tensor]:
    sides = [
        (n + f, side)
        for n, i in infos.items()
        for f, side in zip(factors(kind), factor_dims(kind, i), strict=True)
    ]
    counts = [cz.lowrank_count(side, rank) for _, side in sides]
    codes = cz.unpack_bits(tensors["codes"], cz.FACTOR_BITS, sum(counts)).split(counts)
    return {
        name: cz.lowrank_decode(c, tensors[f"{name}#scale"], side, rank)
        for (name, side), c in zip(sides, codes, strict=True)
    }


def stack(states: list[State]) -> State:
    """Several states in one message: ``"i/name"`` for candidate i."""
    return {f"{i}/{k}": v for i, s in enumerate(states) for k, v in s.items()}


def unstack(tensors: State, count: int) -> list[State]:
    out: list[State] = [{} for _ in range(count)]
    for key, v in tensors.items():
        i, name = key.split("/", 1)
        out[int(i)][name] = v
    return out
