"""Batched peer training against the one-by-one loop, side by side in one process.

100 peers, Fashion-MNIST split Dirichlet(0.5), MLPs 784-200-10 and 784-32-10, one local
epoch of SGD (batch 32, lr 0.05, with and without momentum 0.9) on the hand-written MLP
path, then the same MLPs and LeNet-5 on the ``torch.func`` (vmap) path, with SGD and Adam.
"loop" trains the peers one after the other with ``Trainer.train``; "batched" trains them
in one ``train_batched`` call. Both start from the same state and draw the same batch
orders; the table gives each one's wall time, trainings per second and the ratio, and how
far the results are apart.
The last row times a whole simulated run (DFedAvgM on a ring, every peer training each
round) with ``peers.batched`` off and on. Repeats alternate the two, so load hits both alike.
``--device cuda`` runs both sides on the GPU, where both replay their SGD steps from CUDA
graphs (the loop each peer's full-size steps, batched each group's); two more LeNet rows
turn them off in the loop alone, and on both sides. ``--models lenet`` runs the LeNet rows alone.
On a CPU the LeNet row is followed by a bound: the loop's time against its steps' matrix
products alone, batched over the peers with ``torch.bmm`` (:func:`gemm_bound`), the most any
batching could gain on this CPU, and by the gain of each convolution run for all the peers as
one grouped convolution (:func:`grouped_conv_gains`).

    OMP_NUM_THREADS=1 python benchmarks/batched.py [--peers 100] [--repeats 3]
        [--device cpu|cuda] [--models mlp lenet run]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

import p2pfl  # noqa: E402
from p2pfl.app.config import resolve  # noqa: E402
from p2pfl.app.experiment import build  # noqa: E402
from p2pfl.core.seeding import torch_generator  # noqa: E402
from p2pfl.learning import batched  # noqa: E402
from p2pfl.learning.state import average_states  # noqa: E402
from p2pfl.learning.training import TrainConfig  # noqa: E402
from p2pfl.runtime.setup import Setup  # noqa: E402

CPU = torch.device("cpu")
MODELS = ("mlp", "lenet", "run")
CONFIG = {
    "name": "batched",
    "seed": 0,
    "dataset": {"name": "fashion_mnist", "test_subset": 2000},
    "partition": {"name": "dirichlet", "alpha": 0.5},
    "model": {"name": "mlp", "hidden": [200]},
    "topology": {"kind": "ring"},
    "peers": {"count": 100},
    "algorithm": {"name": "dfedavgm", "rounds": 2},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
    "eval": {"every": 2, "per_peer": False},
}


def loop(setup: Setup, cfg: TrainConfig, device: torch.device) -> tuple[float, list]:
    init, peers = setup.trainer.init_state(0), setup.data.peers
    start = time.perf_counter()
    states = [
        setup.trainer.train(init, peers[p], cfg, torch_generator(0, "bench", p), device).state
        for p in range(len(peers))
    ]
    return time.perf_counter() - start, states


def together(
    setup: Setup,
    pool: batched.DataPool,
    cfg: TrainConfig,
    device: torch.device,
    generic: bool,
    fixed: bool | None = None,
) -> tuple[float, list]:
    init, module = setup.trainer.init_state(0), setup.trainer.module(device)
    jobs = [batched.Job(init, p, torch_generator(0, "bench", p)) for p in range(len(pool.peers))]
    start = time.perf_counter()
    results = batched.train_batched(module, pool, jobs, cfg, device, generic, fixed)
    return time.perf_counter() - start, [r.state for r in results]


def side_by_side(
    setup: Setup,
    pool: batched.DataPool,
    cfg: TrainConfig,
    repeats: int,
    device: torch.device,
    generic: bool = False,
    graphs: tuple[bool, bool] = (True, True),
) -> list[float]:
    """Loop and batched times (medians of alternating repeats, after a warm-up of each),
    their ratio, trainings per second, and how far the results are apart. ``graphs``: does
    the loop, does batched training replay its CUDA steps from graphs (the default)."""
    setup.trainer.graphs, fixed = graphs[0], None if graphs[1] else False
    loop(setup, cfg, device), together(setup, pool, cfg, device, generic, fixed)
    times: dict[str, list[float]] = {"loop": [], "batched": []}
    for _ in range(repeats):
        t_loop, one = loop(setup, cfg, device)
        t_batched, other = together(setup, pool, cfg, device, generic, fixed)
        times["loop"].append(t_loop)
        times["batched"].append(t_batched)
    setup.trainer.graphs = True
    diff = max((a[k] - b[k]).abs().max().item() for a, b in zip(one, other, strict=True) for k in a)
    x, y = setup.data.test_x, setup.data.test_y
    acc_loop = setup.trainer.evaluate(average_states(one), x, y, CPU)[0]
    acc_batched = setup.trainer.evaluate(average_states(other), x, y, CPU)[0]
    t_loop, t_batched = (statistics.median(times[k]) for k in ("loop", "batched"))
    n = len(pool.peers)
    return [t_loop, t_batched, t_loop / t_batched, n / t_loop, n / t_batched, diff,
            acc_loop - acc_batched]  # fmt: skip


def gemm_bound(setup: Setup, loop_s: float, peers: int, cfg: TrainConfig) -> dict[str, Any]:
    """The most any batching can gain on this CPU for the LeNet loop: a training step's
    matrix products (each layer's forward, weight and input gradients, none for the input
    itself, convolutions as im2col products) for ``peers`` peers as ``torch.bmm`` calls,
    each in its faster orientation, timed; nothing else of a step (im2col itself, pooling,
    activations, the loss, the update) is counted. Scaled to the loop's samples."""
    module, batch = setup.trainer.module(CPU), cfg.batch_size
    shapes: list[tuple[int, int, int, bool]] = []  # (rows, inner, cols, first layer)

    def hook(m: torch.nn.Module, _: tuple, out: torch.Tensor) -> None:
        if isinstance(m, torch.nn.Conv2d):
            kh, kw = m.kernel_size
            rows, inner = batch * out.shape[-2] * out.shape[-1], m.in_channels * kh * kw
        else:
            assert isinstance(m, torch.nn.Linear)
            rows, inner = batch, m.in_features
        shapes.append((rows, inner, out.shape[1], not shapes))

    layers = [m for m in module.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    hooks = [m.register_forward_hook(hook) for m in layers]
    with torch.no_grad():
        module(torch.zeros(1, *setup.data.peers[0].train_x.shape[1:]))
    for h in hooks:
        h.remove()
    products = []  # (m, k, n) of each product of a step: out[m, n] = a[m, k] @ b[k, n]
    for rows, inner, cols, first in shapes:
        products += [(rows, inner, cols), (cols, rows, inner)] + [(rows, cols, inner)] * (not first)
    step_s, flop, each = 0.0, 0.0, []
    for m, k, n in products:
        seconds = min(_bmm_s(peers, m, k, n), _bmm_s(peers, n, k, m))  # a@b or (b^T a^T)^T
        step_s, flop = step_s + seconds, flop + 2.0 * peers * m * k * n
        each.append({"m": m, "k": k, "n": n, "gflops": 2.0 * peers * m * k * n / seconds / 1e9})
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    mm_rate = 2 * 2048**3 / _median_s(lambda: torch.mm(a, b))
    samples = cfg.epochs * sum(p.num_train for p in setup.data.peers)
    steps = samples / batch / peers  # the loop's work, in steps of the whole group
    return {"loop_s": loop_s, "gemm_s": step_s * steps, "gemm_gflops": flop / step_s / 1e9,
            "mm_gflops": mm_rate / 1e9, "most_speedup": loop_s / (step_s * steps),
            "products": each}  # fmt: skip


def grouped_conv_gains(
    setup: Setup, peers: int, cfg: TrainConfig
) -> list[dict[str, float | list[int]]]:
    """The other way to batch a convolution on a CPU: the peers as the groups of one grouped
    convolution (oneDNN, channels-last input). For each of the model's convolutions, its
    forward and backward (the input's gradient too, but the first layer's) for ``peers``
    peers: one call per peer, as the loop makes them, against one grouped call."""
    module, batch = setup.trainer.module(CPU), cfg.batch_size
    inputs: list[tuple[torch.nn.Conv2d, tuple[int, ...]]] = []
    convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    hooks = [
        m.register_forward_hook(lambda m, args, _: inputs.append((m, tuple(args[0].shape[1:]))))
        for m in convs
    ]
    with torch.no_grad():
        module(torch.zeros(1, *setup.data.peers[0].train_x.shape[1:]))
    for h in hooks:
        h.remove()
    return [
        _grouped_gain(conv, shape, peers, batch, grad_in=i > 0)
        for i, (conv, shape) in enumerate(inputs)
    ]


def _grouped_gain(
    conv: torch.nn.Conv2d, shape: tuple[int, ...], peers: int, batch: int, grad_in: bool
) -> dict[str, float | list[int]]:
    """One convolution of ``peers`` peers (input ``shape`` per sample), one by one against
    grouped; ``grad_in``: the input's gradient is computed too (every layer but the first)."""
    c, h, w = shape
    o, (kh, kw), pad = conv.out_channels, conv.kernel_size, conv.padding
    xs = [torch.randn(batch, c, h, w, requires_grad=grad_in) for _ in range(peers)]
    ws = [torch.randn(o, c, kh, kw, requires_grad=True) for _ in range(peers)]
    x = torch.cat([xi.detach() for xi in xs], 1).to(memory_format=torch.channels_last)
    x.requires_grad_(grad_in)
    weight = torch.cat([wi.detach() for wi in ws], 0).requires_grad_()

    def one_by_one() -> None:
        for xi, wi in zip(xs, ws, strict=True):
            torch.nn.functional.conv2d(xi, wi, padding=pad).sum().backward()

    def grouped() -> None:
        torch.nn.functional.conv2d(x, weight, padding=pad, groups=peers).sum().backward()

    loop_s, grouped_s = _median_s(one_by_one), _median_s(grouped)
    return {"input": [c, h, w], "out_channels": o, "loop_s": loop_s, "grouped_s": grouped_s,
            "speedup": loop_s / grouped_s}  # fmt: skip


def _bmm_s(peers: int, m: int, k: int, n: int) -> float:
    a, b = torch.randn(peers, m, k), torch.randn(peers, k, n)
    return _median_s(lambda: torch.bmm(a, b))


def _median_s(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def whole_run(config: dict, flag: bool, device: str) -> tuple[float, float]:
    cfg = copy.deepcopy(config)
    cfg["peers"]["batched"] = flag
    cfg["peers"]["device"] = device
    with tempfile.TemporaryDirectory() as out:
        summary = p2pfl.run(cfg, out=out).summary
    return summary["wall_time_s"], summary["final"]["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device on this host")
    device = torch.device(args.device)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    config = copy.deepcopy(CONFIG)
    config["peers"]["count"] = args.peers
    rows, extra = [], {"config": copy.deepcopy(config), "load_before": os.getloadavg()}
    extra["device"] = args.device
    sgd = TrainConfig(batch_size=32, lr=0.05, momentum=0.9)
    adam = TrainConfig(batch_size=32, lr=0.001, optimizer="adam")
    for hidden in ([200], [32]) if "mlp" in args.models else ():
        config["model"]["hidden"] = hidden
        setup = build(resolve(config, Path("batched.yaml")))
        pool = batched.DataPool(setup.data.peers)
        for momentum in (0.0, 0.9):
            cfg = TrainConfig(batch_size=32, lr=0.05, momentum=momentum)
            rows.append([f"mlp {hidden}, momentum {momentum}", args.peers,
                         *side_by_side(setup, pool, cfg, args.repeats, device)])  # fmt: skip
        rows.append([f"mlp {hidden}, momentum 0.9, torch.func", args.peers,
                     *side_by_side(setup, pool, sgd, args.repeats, device, True)])  # fmt: skip
        rows.append([f"mlp {hidden}, adam, torch.func", args.peers,
                     *side_by_side(setup, pool, adam, args.repeats, device)])  # fmt: skip
    if "lenet" in args.models:
        lenet = copy.deepcopy(config) | {"model": {"name": "lenet"}}
        setup = build(resolve(lenet, Path("batched.yaml")))
        pool = batched.DataPool(setup.data.peers)
        rows.append(["lenet, momentum 0.9, torch.func", args.peers,
                     *side_by_side(setup, pool, sgd, args.repeats, device)])  # fmt: skip
        if device == CPU:
            extra["lenet_bound"] = gemm_bound(setup, rows[-1][2], args.peers, sgd)
            extra["lenet_bound"]["grouped_convs"] = grouped_conv_gains(setup, args.peers, sgd)
        on_gpu = {"batched alone": (False, True), "neither": (False, False)}
        for side, graphs in on_gpu.items() if device.type == "cuda" else ():
            row = side_by_side(setup, pool, sgd, args.repeats, device, False, graphs)
            rows.append([f"lenet, momentum 0.9, torch.func, CUDA graphs: {side}", args.peers, *row])
    if "run" in args.models:
        rows.append(run_row(config, args.peers, args.repeats, args.device))
    extra["load_after"] = os.getloadavg()
    columns = ["what", "peers", "loop_s", "batched_s", "speedup", "loop_trainings_per_s",
               "batched_trainings_per_s", "max_abs_weight_diff", "accuracy_diff"]  # fmt: skip
    goal = 3.0 if device == CPU else 20.0
    report("batched", columns, rows, extra | {"goal_speedup": goal})
    if "lenet_bound" in extra:
        b = extra["lenet_bound"]
        print(
            f"LeNet bound: the loop took {b['loop_s']:.3f} s; its steps' matrix products alone, "
            f"batched with bmm, take {b['gemm_s']:.3f} s ({b['gemm_gflops']:.1f} GFLOP/s; one "
            f"large mm: {b['mm_gflops']:.1f}): batching can gain at most "
            f"{b['most_speedup']:.2f}x here"
        )
        for g in b["grouped_convs"]:
            print(
                f"  conv {g['input']} -> {g['out_channels']} channels, forward and backward, "
                f"the peers as one grouped conv: {g['speedup']:.2f}x the per-peer calls "
                f"({g['loop_s'] * 1e3:.1f} -> {g['grouped_s'] * 1e3:.1f} ms)"
            )
    print(f"load average before {extra['load_before']}, after {extra['load_after']}")


def run_row(config: dict, peers: int, repeats: int, device: str) -> list:
    """The whole simulated run with ``peers.batched`` off and on, alternating."""
    config = copy.deepcopy(config)
    config["model"] = {"name": "mlp", "hidden": [200]}
    walls: dict[bool, list[float]] = {False: [], True: []}
    accs = {}
    for _ in range(repeats):
        for flag in (False, True):
            wall, accs[flag] = whole_run(config, flag, device)
            walls[flag].append(wall)
    t_off, t_on = statistics.median(walls[False]), statistics.median(walls[True])
    rounds = config["algorithm"]["rounds"]
    return [f"dfedavgm run, {rounds} rounds", peers, t_off, t_on, t_off / t_on,
            peers * rounds / t_off, peers * rounds / t_on, float("nan"),
            accs[False] - accs[True]]  # fmt: skip


if __name__ == "__main__":
    main()
