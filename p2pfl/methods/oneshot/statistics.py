"""What a one-shot peer computes on its own data, as ``Compute`` functions.

- :func:`local_statistics`: the curvature statistics its merges need (diagonal Fisher,
  K-FAC factors, input Grams; :mod:`p2pfl.learning.curvature`), each with the layers it covers;
- :func:`shaped_statistics`: zeros of the same shapes, for the analytic cost;
- :func:`count_correct`: each candidate model's correct answers on the validation split
  (model selection, ``select: val``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from p2pfl.data.federated import PeerData
from p2pfl.learning.curvature import LayerInfo, covered_layers, curvature, layer_info
from p2pfl.methods.effects import State

StatisticsByKind = dict[str, tuple[dict[str, Tensor], dict[str, LayerInfo]]]
"""Per statistic kind: its tensors by name, and the layers it covers by name."""


def factors(kind: str) -> tuple[str, ...]:
    """Key suffixes of the matrices of a layer: K-FAC's A and G, or the one Gram."""
    return (".A", ".G") if kind == "kfac" else ("",)


def factor_dims(kind: str, info: LayerInfo) -> list[int]:
    """Side of each square matrix of a layer: (a, g) for K-FAC, the inputs for a Gram."""
    return [info.cols, info.rows] if kind == "kfac" else [info.cols - info.bias]


def _layers(module: nn.Module, kind: str) -> dict[str, LayerInfo]:
    """The layers statistic ``kind`` covers: Linear layers for a Gram, else Linear and Conv2d."""
    layers = {n: layer_info(n, m) for n, m in covered_layers(module).items()}
    if kind != "gram":
        return layers
    return {n: i for n, i in layers.items() if isinstance(module.get_submodule(n), nn.Linear)}


def local_statistics(
    module: nn.Module, data: PeerData, device: torch.device, kinds: tuple[str, ...]
) -> StatisticsByKind:
    """The statistics ``kinds`` of the loaded model on the peer's training data, each with
    the layers it covers (runs as a ``Compute`` effect)."""
    stats = curvature(module, data.train_x.to(device), kinds)
    return {k: (stats[k], _layers(module, k)) for k in kinds}


def shaped_statistics(module: nn.Module, kinds: tuple[str, ...]) -> StatisticsByKind:
    """Zero statistics of the shapes :func:`local_statistics` returns (for size analysis)."""
    out: StatisticsByKind = {}
    for kind in kinds:
        infos = _layers(module, kind)
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
