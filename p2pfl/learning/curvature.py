"""Local curvature statistics of a classifier: true Fisher (diagonal and K-FAC) and Grams.

Everything is computed exactly over the classes (FedFisher §2, eq. 3, computed as nngeometry
does, §5.1): for each class c the logit-space vector u_c = √p_c·(e_c − p), with p detached,
is back-propagated, so that F = (1/n) Σ_x Σ_c J^T u_c u_c^T J is the *true* Fisher, not the
empirical one.

Only ``nn.Linear`` and ``nn.Conv2d`` layers are covered (as nngeometry does); a layer
with a bias is treated as one matrix [W | b] whose input gets a constant 1 appended. With
a_l the layer input (unfolded patches ā_t for a conv, T output locations) and δ_{c,t} the
backprop of u_c at the layer output:

- ``diag``: Σ_c of the squared per-example gradients Σ_t δ_{c,t} ā_t^T, averaged over x;
- ``kfac``: A = (1/n) Σ_x Σ_t ā_t ā_t^T and G = (1/n) Σ_x Σ_c (1/T) Σ_t δ_{c,t} δ_{c,t}^T;
- ``gram``: X^T X / n of the inputs of each ``nn.Linear`` layer (RegMean; no 1 appended).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KINDS = ("diag", "kfac", "gram")


@dataclass(frozen=True)
class LayerInfo:
    """A covered layer: its module name, weight shape, bias and matrix shape g × a."""

    name: str
    weight_shape: tuple[int, ...]
    bias: bool
    rows: int  # g: output features / channels
    cols: int  # a: input features (C_in·k_h·k_w for a conv), +1 with a bias

    @classmethod
    def of(cls, name: str, weight_shape: tuple[int, ...], bias: bool) -> LayerInfo:
        """The layer with this weight shape, with or without a bias."""
        return cls(name, weight_shape, bias, weight_shape[0], math.prod(weight_shape[1:]) + bias)


Layer = nn.Linear | nn.Conv2d
"""A layer whose curvature the statistics cover."""


def covered_layers(model: nn.Module) -> dict[str, Layer]:
    """The Linear and Conv2d layers by module name; any other trainable parameter is an
    error, since its curvature would need a block of its own."""
    layers: dict[str, Layer] = {}
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if isinstance(module, nn.Linear | nn.Conv2d):
            if isinstance(module, nn.Conv2d) and (
                module.groups != 1 or isinstance(module.padding, str)
                or module.padding_mode != "zeros"
            ):  # fmt: skip
                raise ValueError(f"conv layer {name!r}: only groups=1 and zero padding")
            layers[name] = module
        elif own:
            raise ValueError(
                f"layer {name!r} ({type(module).__name__}) has parameters; Fisher and K-FAC "
                "statistics cover Linear and Conv2d layers only"
            )
    return layers


def layer_info(name: str, module: Layer) -> LayerInfo:
    """A Linear or Conv2d module as a :class:`LayerInfo`."""
    return LayerInfo.of(name, tuple(module.weight.shape), module.bias is not None)


def state_layer(state: dict[str, Tensor], name: str) -> LayerInfo:
    """The layer ``name`` as a model state holds it (``NAME.weight``, ``NAME.bias`` if any)."""
    return LayerInfo.of(name, tuple(state[f"{name}.weight"].shape), f"{name}.bias" in state)


def as_matrix(state: dict[str, Tensor], layer: LayerInfo) -> Tensor:
    """The layer's parameters in ``state`` as one g × a matrix [W | b]."""
    w = state[f"{layer.name}.weight"].reshape(layer.rows, -1)
    if layer.bias:
        w = torch.cat([w, state[f"{layer.name}.bias"].reshape(-1, 1)], dim=1)
    return w


def from_matrix(matrix: Tensor, layer: LayerInfo) -> dict[str, Tensor]:
    """The state entries of a g × a matrix [W | b] (inverse of :func:`as_matrix`)."""
    out = {f"{layer.name}.weight": matrix[:, : layer.cols - layer.bias].reshape(layer.weight_shape)}
    if layer.bias:
        out[f"{layer.name}.bias"] = matrix[:, -1].clone()
    return out


def _inputs(module: nn.Module, x: Tensor) -> Tensor:
    """Layer inputs as [B, T, a]: unfolded patches for a conv, T = 1 for a linear layer."""
    if isinstance(module, nn.Conv2d):
        padding = module.padding
        assert not isinstance(padding, str)  # covered_layers admits zero padding only
        x = F.unfold(x, module.kernel_size, module.dilation, padding, module.stride)
        x = x.transpose(1, 2)
    else:
        x = x.reshape(x.shape[0], -1, x.shape[-1])
    if module.bias is not None:
        x = torch.cat([x, x.new_ones(*x.shape[:2], 1)], dim=2)
    return x


def _outputs(grad: Tensor) -> Tensor:
    """Backprops at a layer output as [B, T, g] (locations of a conv map flattened)."""
    if grad.dim() == 4:
        return grad.flatten(2).transpose(1, 2)
    return grad.reshape(grad.shape[0], -1, grad.shape[-1])


@torch.no_grad()
def curvature(
    model: nn.Module, x: Tensor, kinds: tuple[str, ...], batch_size: int = 64
) -> dict[str, dict[str, Tensor]]:
    """The statistics named in ``kinds`` of ``model`` on inputs ``x``, averaged over x.

    Returns ``{"diag": {param name: tensor}, "kfac": {layer: A and G as "NAME.A"/"NAME.G"},
    "gram": {layer: Gram}}`` restricted to ``kinds``, in float32 on the CPU. The model is
    put in eval mode (no dropout or batch statistics).
    """
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown statistics {sorted(unknown)}; choose from {KINDS}")
    model.eval()
    layers = covered_layers(model)
    infos = {name: layer_info(name, m) for name, m in layers.items()}
    acc: dict[str, dict[str, Tensor]] = {k: {} for k in kinds}
    seen: dict[str, tuple[Tensor, Tensor]] = {}

    def hook(name: str):
        def fn(module: nn.Module, inp: tuple[Tensor, ...], out: Tensor) -> None:
            if name in seen:
                raise ValueError(f"layer {name!r} is used twice in one forward pass")
            seen[name] = (inp[0].detach(), out)

        return fn

    handles = [m.register_forward_hook(hook(name)) for name, m in layers.items()]
    try:
        for i in range(0, len(x), batch_size):
            seen.clear()
            with torch.enable_grad():
                logits = model(x[i : i + batch_size])
            _accumulate(acc, kinds, layers, infos, seen, logits)
    finally:
        for h in handles:
            h.remove()
    out: dict[str, dict[str, Tensor]] = {}
    for kind, stats in acc.items():
        out[kind] = {}
        for key, value in stats.items():
            value = (value / len(x)).float().cpu()
            if kind == "diag":  # stored per layer as g × a, returned per parameter
                out[kind] |= from_matrix(value, infos[key])
            else:
                out[kind][key] = value
    return out


def _accumulate(
    acc: dict[str, dict[str, Tensor]],
    kinds: tuple[str, ...],
    layers: dict[str, Layer],
    infos: dict[str, LayerInfo],
    seen: dict[str, tuple[Tensor, Tensor]],
    logits: Tensor,
) -> None:
    """Add one batch's sums to ``acc`` (in float64)."""

    def add(kind: str, key: str, value: Tensor) -> None:
        value = value.double()
        acc[kind][key] = acc[kind][key] + value if key in acc[kind] else value

    inputs = {name: _inputs(layers[name], seen[name][0]) for name in layers}
    if "gram" in kinds:
        for name, m in layers.items():
            if isinstance(m, nn.Linear):
                xi = seen[name][0].reshape(-1, m.in_features)
                add("gram", name, xi.T @ xi * (len(logits) / len(xi)))
    if "kfac" in kinds:
        for name, a in inputs.items():
            add("kfac", f"{name}.A", torch.einsum("bti,btj->ij", a, a))
    if "diag" not in kinds and "kfac" not in kinds:
        return
    p = torch.softmax(logits.detach().double(), dim=1).to(logits.dtype)
    outs = [seen[name][1] for name in layers]
    for c in range(p.shape[1]):
        u = -p * p[:, c : c + 1].sqrt()
        u[:, c] += p[:, c].sqrt()
        with torch.enable_grad():
            grads = torch.autograd.grad(logits, outs, grad_outputs=u, retain_graph=True)
        for name, grad in zip(layers, grads, strict=True):
            d, a = _outputs(grad), inputs[name]
            if "kfac" in kinds:
                add("kfac", f"{name}.G", torch.einsum("bti,btj->ij", d, d) / d.shape[1])
            if "diag" in kinds:
                if d.shape[1] == 1:  # per-example gradient δ a^T: square = δ² (a²)^T
                    add("diag", name, torch.einsum("bg,ba->ga", d[:, 0] ** 2, a[:, 0] ** 2))
                else:
                    add("diag", name, (torch.einsum("btg,bta->bga", d, a) ** 2).sum(0))
