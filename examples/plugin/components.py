"""More p2pfl plug-in components: a model, a dataset, a graph, a codec, a reporter, an attack
and an aggregation rule (docs/extending.md).

``components.yaml`` beside this file runs the first five together with ``push_gossip.py``'s
method and partitioner; ``adversary.yaml`` runs the attack against the rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import torch
from torch import Tensor, nn

from p2pfl.api import (
    AGGREGATORS,
    ATTACKS,
    CODECS,
    DATASETS,
    GRAPHS,
    MODELS,
    REPORTERS,
    Aggregator,
    Attack,
    Codec,
    ConfigError,
    Dataset,
    Reporter,
    State,
    View,
    average_states,
)


@MODELS.register("tiny_cnn")
def tiny_cnn(
    input_shape: tuple[int, int, int], num_classes: int, *, channels: int = 8
) -> nn.Module:
    """One 3×3 convolution (padding 1) with ReLU and 2×2 max-pooling, then a linear layer."""
    if channels < 1:
        raise ConfigError("channels", f"must be >= 1, got {channels}")
    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(channels * (h // 2) * (w // 2), num_classes),
    )


@DATASETS.register("blobs")
def blobs(
    *, classes: int = 4, side: int = 4, train: int = 800, test: int = 200, noise: float = 1.0
) -> Dataset:
    """Synthetic ``side``×``side`` images, no files needed: class k is a fixed random
    prototype image plus Gaussian noise of std ``noise``. Always the same data (seed 0);
    the run's seed still draws the partition, the model and the batches."""
    if classes < 2:
        raise ConfigError("classes", f"must be >= 2, got {classes}")
    if noise < 0:
        raise ConfigError("noise", f"must be >= 0, got {noise}")
    gen = torch.Generator().manual_seed(0)
    prototypes = torch.randn(classes, 1, side, side, generator=gen)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(classes, (n,), generator=gen)
        return prototypes[y] + noise * torch.randn(n, 1, side, side, generator=gen), y

    (train_x, train_y), (test_x, test_y) = draw(train), draw(test)
    return Dataset("blobs", train_x, train_y, test_x, test_y, classes)


@GRAPHS.register("torus")
def torus(n: int, seed: int, *, rows: int = 3) -> nx.Graph:
    """Peers on a ``rows`` × (n / rows) grid whose edges wrap around: four neighbours each."""
    if rows < 3 or n % rows or n // rows < 3:
        raise ConfigError("rows", f"must divide the {n} peers into rows and columns of >= 3")
    grid = nx.grid_2d_graph(rows, n // rows, periodic=True)
    return nx.convert_node_labels_to_integers(grid, ordering="sorted")


@CODECS.register("bf16")
class BFloat16(Codec):
    """bfloat16 (Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training", 2019):
    float32's exponent range with an 8-bit significand, so no clamping and
    |x̂ − x| ≤ 2⁻⁸·|x| for normal numbers; 2 bytes an entry."""

    def packed_size(self, entry: dict, numel: int, dtype: torch.dtype) -> int:
        return 2 * numel

    def pack(self, flat: Tensor, entry: dict) -> Tensor:
        return flat.to(torch.bfloat16).view(torch.uint8)

    def unpack(self, raw: Tensor, entry: dict, numel: int, dtype: torch.dtype) -> Tensor:
        return raw.clone().view(torch.bfloat16).to(dtype)  # a copy: an even offset


@REPORTERS.register("jsonl")
class JsonLines(Reporter):
    """``metrics.jsonl`` in the run directory: every metric row as one JSON object."""

    def __init__(self, out: Path) -> None:
        self._file = (out / "metrics.jsonl").open("w")

    def log(self, time: float, round: int, peer: str, metric: str, value: float) -> None:
        row = {"time": time, "round": round, "peer": peer, "metric": metric, "value": value}
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


@ATTACKS.register("stale")
@dataclass(kw_only=True, frozen=True)
class Stale(Attack):
    """Send the model training started from: the update vanishes."""

    def corrupt(self, honest: State, view: View) -> State:
        return {k: v.clone() for k, v in view.start.items()}


@AGGREGATORS.register("near_mean")
@dataclass(kw_only=True, frozen=True)
class NearMean(Aggregator):
    """The mean of the center and the models within ``radius`` of it (L2 over all tensors)."""

    radius: float = 1.0

    def __call__(self, center, others, weights, center_weight) -> State:
        def distance(state: State) -> float:
            return sum(float((state[k] - v).square().sum()) for k, v in center.items()) ** 0.5

        near = [s for s in others if distance(s) <= self.radius]
        return average_states([center, *near])
