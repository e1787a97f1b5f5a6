"""2×2 max-pooling on a CPU: ``nn.MaxPool2d(2)`` against p2pfl's ``MaxPool2x2``, side by side.

The shapes are the pooling inputs of the CNNs p2pfl trains on Fashion-MNIST (28×28): LeNet-5's
two pools and cnn3's (width 32 and 128) for a training batch (forward and backward) and for an
evaluation batch of 2,048 (forward only, no gradient). ``MaxPool2x2`` leaves the small ones
(LeNet's second pool, 8×8 digits maps) to torch. Each row checks that the two give the same
bits (outputs and gradients) before it times them; times are medians over ``--repeats``
alternating rounds of a loop.

    OMP_NUM_THREADS=1 python benchmarks/maxpool.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

from p2pfl.learning.models import MaxPool2x2  # noqa: E402

CASES = {
    "LeNet pool 1, batch 32": ((32, 6, 24, 24), True),
    "LeNet pool 2, batch 32 (left to torch)": ((32, 16, 8, 8), True),
    "cnn3-32 pool 1, batch 64": ((64, 32, 26, 26), True),
    "cnn3-128 pool 1, batch 32": ((32, 128, 26, 26), True),
    "LeNet pool 1, evaluation 2,048": ((2048, 6, 24, 24), False),
    "cnn3-32 pool 1, evaluation 2,048": ((2048, 32, 26, 26), False),
    "digits LeNet pool 1, batch 32 (left to torch)": ((32, 6, 8, 8), True),
}  # fmt: skip


def timed(fn: Callable[[], object], seconds: float = 0.2) -> float:
    """Mean seconds per call of ``fn`` over a loop of about ``seconds`` (after one warm-up
    call); :func:`case` takes the median of several such loops."""
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def case(shape: tuple[int, ...], backward: bool, repeats: int) -> tuple[float, float]:
    """Seconds per call of nn.MaxPool2d(2) and of MaxPool2x2 (median of ``repeats``), after
    checking that both give the same bits."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).relu()  # as after a conv and ReLU: ties at zero
    grad = torch.randn((*shape[:2], shape[2] // 2, shape[3] // 2), generator=gen)
    pools = [nn.MaxPool2d(2), MaxPool2x2()]
    inputs = [x.clone().requires_grad_(backward) for _ in pools]
    outs = [pool(i) for pool, i in zip(pools, inputs, strict=True)]
    assert torch.equal(outs[0], outs[1])
    if backward:
        for out in outs:
            out.backward(grad)
        assert torch.equal(inputs[0].grad, inputs[1].grad)  # type: ignore[arg-type]

    def call(pool: nn.Module, inp: torch.Tensor) -> Callable[[], object]:
        if backward:
            return lambda: pool(inp).backward(grad)
        return lambda: pool(inp)

    times: list[list[float]] = [[], []]
    with torch.set_grad_enabled(backward):
        for _ in range(repeats):  # alternating, so both see the same machine
            for k, (pool, inp) in enumerate(zip(pools, inputs, strict=True)):
                times[k].append(timed(call(pool, inp)))
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for name, (shape, backward) in CASES.items():
        torch_s, ours_s = case(shape, backward, args.repeats)
        what = "forward + backward" if backward else "forward"
        rows.append([name, what, 1e3 * torch_s, 1e3 * ours_s, torch_s / ours_s])
    columns = ["input", "timed", "nn_maxpool2d_ms", "maxpool2x2_ms", "speedup"]
    report("maxpool", columns, rows, {"cases": {k: v[0] for k, v in CASES.items()}})


if __name__ == "__main__":
    main()
