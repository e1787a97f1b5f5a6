"""GPU sharing: ten ResNet-18 peers taking turns on one GPU, or on the CPU where there is none.

FedAvg on a star, 10 peers, Fashion-MNIST split Dirichlet(0.5), ResNet-18 (BatchNorm). Every
peer's model lives on the CPU between its turns; for its turn the shared template module on
the device loads it, trains, and the trained state goes back to the CPU. The table gives
the wall time, the busy time (wall time inside training and evaluation, which ends when the
trained state is back on the CPU, so every queued GPU kernel is included) and its share of
the wall time, peer trainings per second and, where ``nvidia-smi`` is on the PATH, the
GPU's own utilization sampled every 100 ms during the run (its mean over all samples, and
over the samples where the GPU was working at all; nvidia-smi's GPU index is taken to be
torch's). On CUDA it runs with the training steps replayed from CUDA graphs and without,
alternating which goes first (the first run of a call also starts CUDA and cuDNN).
Without CUDA it runs on the CPU and says so; that run is kept small (a subset of the data,
one round) because a CPU core trains ResNet-18 slowly.

    python benchmarks/gpu.py [--rounds 3] [--subset 20000] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

from p2pfl.app.config import resolve  # noqa: E402
from p2pfl.app.experiment import build, run  # noqa: E402


def config(device: str, rounds: int, subset: int) -> dict:
    return {
        "name": "gpu",
        "seed": 0,
        "dataset": {"name": "fashion_mnist", "subset": subset, "test_subset": 1000},
        "partition": {"name": "dirichlet", "alpha": 0.5},
        "model": {"name": "resnet18"},
        "topology": {"kind": "star"},
        "peers": {"count": 10, "device": device},
        "algorithm": {"name": "fedavg", "rounds": rounds},
        "train": {"epochs": 1, "batch_size": 64, "lr": 0.05, "momentum": 0.9},
        "eval": {"every": rounds, "per_peer": False},
    }


class Utilization:
    """``nvidia-smi``'s utilization.gpu (percent of time a kernel ran), sampled every
    100 ms from entering to leaving; empty where there is no ``nvidia-smi``."""

    def __enter__(self) -> Utilization:
        self.samples: list[float] = []
        self.proc = None
        if torch.cuda.is_available() and (smi := shutil.which("nvidia-smi")):
            query = [smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
            index = str(torch.cuda.current_device())
            command = [*query, "-i", index, "-lms", "100"]
            self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            self.samples = [float(v) for v in out.split() if v.replace(".", "").isdigit()]

    def means(self) -> tuple[float, float]:
        """Mean utilization over all samples, and over those above zero (nan if none)."""
        working = [v for v in self.samples if v > 0]
        return (
            statistics.fmean(self.samples) if self.samples else float("nan"),
            statistics.fmean(working) if working else float("nan"),
        )


def one_run(cfg: dict, graphs: bool) -> list:
    """One run of ``cfg``, CUDA graphs on or off: its row of the table."""
    setup = build(resolve(cfg, Path("gpu.yaml")))
    setup.trainer.graphs = graphs
    cuda = cfg["peers"]["device"] == "cuda"
    with tempfile.TemporaryDirectory() as out, Utilization() as smi:
        summary = run(setup, Path(out))
    wall, busy = summary["wall_time_s"], summary["compute_wall_s"]
    trainings = cfg["algorithm"]["rounds"] * setup.topology.num_peers
    name = torch.cuda.get_device_name() if cuda else "cpu (no CUDA)"
    steps = ("graphs" if graphs else "eager") if cuda else "eager"
    return [name, steps, setup.topology.num_peers, cfg["algorithm"]["rounds"], wall, busy,
            busy / wall, trainings / wall, summary["final"]["accuracy"], *smi.means()]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="default: 3 on a GPU, 1 on the CPU")
    parser.add_argument("--subset", type=int, help="training samples; default 20000 / 500")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        print("no CUDA device: running the small CPU version instead (not a GPU figure)")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rounds = args.rounds or (3 if cuda else 1)
    subset = args.subset or (20000 if cuda else 500)
    cfg = config(device, rounds, subset)
    orders = [(True, False), (False, True)] if cuda else [(True,)]  # each goes first in turn
    rows = [one_run(cfg, graphs) for i in range(args.repeats) for graphs in orders[i % len(orders)]]
    columns = ["device", "steps", "peers", "rounds", "wall_s", "busy_s", "busy_share",
               "peer_trainings_per_s", "accuracy", "gpu_util_mean", "gpu_util_working"]  # fmt: skip
    extra = {"config": cfg, "cuda": cuda, "load": os.getloadavg()}
    if cuda:
        extra["max_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
    report("gpu", columns, rows, extra)
    print(f"load average {extra['load']}")


if __name__ == "__main__":
    main()
