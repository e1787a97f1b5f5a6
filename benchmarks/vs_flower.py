"""Race: the same FedAvg job in p2pfl and in Flower's simulation engine, side by side.

100 peers (Fashion-MNIST, Dirichlet(0.5)), 10 per round, 20 rounds, MLP 784-200-10, SGD
(batch 32, lr 0.05), seed 0. Flower runs it through ``benchmarks/flower_job.py`` in its own
virtual environment (``benchmarks/.flwr-venv``, made on first use: ``venv
--system-site-packages`` plus a path file onto this environment, so it reuses this torch,
then ``pip install "flwr[simulation]"``; the script checks that pip brought no torch of its
own). Both use p2pfl's data split, initial model, peer sampling and local training loop, so
they compute the same models; what differs is the engine around them. p2pfl runs with
``peers.batched`` (and, for reference, without), and with ``peers.batched`` over
``--workers 2`` ranks (one thread each); Flower gets every CPU of the machine for its Ray
actors, p2pfl one thread per process. p2pfl's wall times are its runs' ``wall_time_s``
(the run itself: not loading the data, drawing ``partition.png`` or, for ``--workers``,
starting the ranks), in this process or in a ``p2pfl run`` command; Flower's include
starting Ray and its actors loading their data.

    OMP_NUM_THREADS=1 python benchmarks/vs_flower.py [--rounds 20] [--peers 100] [--workers 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import p2pfl_command, report  # noqa: E402

import p2pfl  # noqa: E402

HERE = Path(__file__).resolve().parent
VENV = HERE / ".flwr-venv"
FLOWER = "flwr[simulation]"
CONFIG = {
    "name": "vs_flower",
    "seed": 0,
    "dataset": {"name": "fashion_mnist"},
    "partition": {"name": "dirichlet", "alpha": 0.5},
    "model": {"name": "mlp", "hidden": [200]},
    "topology": {"kind": "star"},
    # a 10 Gbit/s server link: only the simulated clock sees it; it lets the round's
    # trainings overlap in simulated time, so p2pfl can batch them
    "peers": {"count": 100, "link": {"bandwidth_bps": 1e10}},
    "algorithm": {"name": "fedavg", "rounds": 20, "participation": 0.1},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.05},
    "eval": {"every": 20, "per_peer": False},
}


def flower_python() -> Path:
    """The Flower environment's python, installing Flower there first if needed."""
    python = VENV / "bin" / "python"
    if not python.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
        ours = site.getsitepackages()[0]
        (VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
         / "site-packages" / "p2pfl_parent_env.pth").write_text(
            f"import site; site.addsitedir({ours!r})\n"
        )  # fmt: skip
        pip = subprocess.run(
            [str(python), "-m", "pip", "install", FLOWER], capture_output=True, text=True
        )
        if pip.returncode:
            raise SystemExit(f"pip install {FLOWER} failed:\n{pip.stdout[-3000:]}{pip.stderr}")
    own = list(VENV.glob("lib/python*/site-packages/torch"))
    if own:
        raise SystemExit(f"pip installed its own torch into {own[0]}; remove {VENV}")
    where = subprocess.run(
        [str(python), "-c", "import torch, flwr; print(torch.__file__, flwr.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    if Path(where[0]).resolve() != Path(torch.__file__).resolve():
        raise SystemExit(f"the Flower environment imports another torch: {where[0]}")
    return python


def p2pfl_run(config: dict, batched: bool) -> tuple[float, float]:
    """One run in this process through the Python API: its wall time and final accuracy."""
    with tempfile.TemporaryDirectory() as tmp:
        result = p2pfl.run(config, out=Path(tmp) / "run", peers__batched=batched)
        return result.summary["wall_time_s"], result.summary["final"]["accuracy"]


def p2pfl_workers(config: dict, workers: int) -> tuple[float, float]:
    """``p2pfl run --workers N`` with ``peers.batched``, as a user runs it: the run's wall
    time (``wall_time_s``: from when every rank is up) and its final accuracy."""
    config = copy.deepcopy(config)
    config["peers"]["batched"] = True
    with tempfile.TemporaryDirectory() as tmp:
        exp = Path(tmp) / "vs_flower.yaml"
        exp.write_text(json.dumps(config))  # JSON is YAML
        args = ["run", str(exp), "--workers", str(workers)]
        _, summary = p2pfl_command(args, os.environ | {"OMP_NUM_THREADS": "1"}, Path(tmp, "out"))
    assert summary is not None
    return summary["wall_time_s"], summary["final"]["accuracy"]


def flower_run(python: Path, config: dict, cpus: int) -> dict:
    out = subprocess.run(
        [str(python), str(HERE / "flower_job.py"), json.dumps(config), "--cpus", str(cpus)],
        capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode:
        raise SystemExit(f"the Flower job failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--flower-cpus", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workers", type=int, default=2, help="ranks of the --workers row")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = copy.deepcopy(CONFIG)
    config["algorithm"]["rounds"] = config["eval"]["every"] = args.rounds
    config["peers"]["count"] = args.peers
    python = flower_python()
    load_before = os.getloadavg()
    flower = flower_run(python, config, args.flower_cpus)
    runs = {
        "p2pfl (batched)": p2pfl_run(config, True),
        "p2pfl (one by one)": p2pfl_run(config, False),
        "p2pfl (batched, command, --workers 1)": p2pfl_workers(config, 1),
        f"p2pfl (batched, command, --workers {args.workers})": p2pfl_workers(config, args.workers),
    }
    rows = [[f"flower {flower['flwr']} ({args.flower_cpus} cpus)", flower["wall_s"],
             flower["accuracy"], 1.0]]  # fmt: skip
    for name, (wall, acc) in runs.items():
        rows.append([name, wall, acc, flower["wall_s"] / wall])
    extra = {"config": config, "load_before": load_before, "load_after": os.getloadavg()}
    report("vs_flower", ["framework", "wall_s", "final_accuracy", "speedup_vs_flower"], rows,
           extra | {"goal_speedup": 10.0, "goal_accuracy_gap": 0.01})  # fmt: skip
    print(f"load average before {extra['load_before']}, after {extra['load_after']}")


if __name__ == "__main__":
    main()
