"""GPU sharing: ten ResNet-18 peers taking turns on one GPU, or on the CPU where there is none.

FedAvg on a star, 10 peers, Fashion-MNIST split Dirichlet(0.5), ResNet-18 (BatchNorm). Every
peer's model lives on the CPU between its turns; for its turn the shared template module on
the device loads it, trains, and the trained state goes back to the CPU. The table gives
the wall time, the busy time (wall time inside training and evaluation, which ends when the
trained state is back on the CPU, so every queued GPU kernel is included) and its share of
the wall time, and peer trainings per second. Without CUDA it runs on the CPU and says so;
that run is kept small (a subset of the data, one round) because a CPU core trains
ResNet-18 slowly.

    python benchmarks/gpu.py [--rounds 3] [--subset 20000]
"""

from __future__ import annotations

import argparse
import os
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="default: 3 on a GPU, 1 on the CPU")
    parser.add_argument("--subset", type=int, help="training samples; default 20000 / 500")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        print("no CUDA device: running the small CPU version instead (not a GPU figure)")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rounds = args.rounds or (3 if cuda else 1)
    subset = args.subset or (20000 if cuda else 500)
    cfg = config(device, rounds, subset)
    setup = build(resolve(cfg, Path("gpu.yaml")))
    with tempfile.TemporaryDirectory() as out:
        summary = run(setup, Path(out))
    wall, busy = summary["wall_time_s"], summary["compute_wall_s"]
    trainings = rounds * setup.topology.num_peers
    name = torch.cuda.get_device_name() if cuda else "cpu (no CUDA)"
    accuracy = summary["final"]["accuracy"]
    rows = [[name, setup.topology.num_peers, rounds, wall, busy, busy / wall, trainings / wall,
             accuracy]]  # fmt: skip
    columns = ["device", "peers", "rounds", "wall_s", "busy_s", "busy_share",
               "peer_trainings_per_s", "accuracy"]  # fmt: skip
    extra = {"config": cfg, "cuda": cuda, "load": os.getloadavg()}
    if cuda:
        extra["max_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
    report("gpu", columns, rows, extra)
    print(f"load average {extra['load']}")


if __name__ == "__main__":
    main()
