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
actors, p2pfl one thread per process.

Two ratios, measured side by side in one loop (each repeat runs every case once, Flower
first; each figure is the least of its repeats, the machine being shared):

- *the runs alone*: p2pfl's runs' ``wall_time_s`` (the run itself: not importing torch,
  loading the data or, for ``--workers``, starting the ranks), in this process or in a
  ``p2pfl run`` command; Flower's ``start_simulation`` call, which includes starting Ray and
  its actors loading their data;
- *the whole commands* as a user types them, timed from outside from start to exit:
  ``p2pfl run EXPERIMENT --workers N`` (the console script) against ``python
  flower_job.py CONFIG`` (in the Flower environment); with the CPU seconds (user + system)
  of each command and the children it waited for (Ray's workers, children of Ray's own
  daemons, are not all counted). ``python -c "import torch"`` is timed alongside: the floor
  of any command that trains with torch.

    OMP_NUM_THREADS=1 python benchmarks/vs_flower.py [--rounds 20] [--peers 100] [--workers 2]
        [--repeats 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

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


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """Run ``cmd`` as a user would, timed from outside: its wall time from start to exit, the
    CPU seconds (user + system) of it and the children it waited for, and its stdout. A
    command that fails ends the benchmark with its error output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed:\n{done.stderr[-3000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, done.stdout


def p2pfl_run(config: dict, batched: bool) -> tuple[float, float]:
    """One run in this process through the Python API: its wall time and final accuracy."""
    with tempfile.TemporaryDirectory() as tmp:
        result = p2pfl.run(config, out=Path(tmp) / "run", peers__batched=batched)
        return result.summary["wall_time_s"], result.summary["final"]["accuracy"]


def p2pfl_program() -> list[str]:
    """The ``p2pfl`` command as a user types it: this environment's console script (``python
    -m p2pfl`` where it has none)."""
    script = Path(sys.executable).parent / "p2pfl"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "p2pfl"]


def p2pfl_command(config: dict, workers: int) -> dict[str, Any]:
    """``p2pfl run EXPERIMENT --workers N`` with ``peers.batched``, as a user runs it: the
    run's wall time (``wall_time_s``: from when every rank is up), the whole command's wall
    time and CPU seconds, and the final accuracy."""
    config = copy.deepcopy(config)
    config["peers"]["batched"] = True
    with tempfile.TemporaryDirectory() as tmp:
        exp, out = Path(tmp) / "vs_flower.yaml", Path(tmp, "out")
        exp.write_text(json.dumps(config))  # JSON is YAML
        args = ["run", str(exp), "--workers", str(workers), "--out", str(out), "--quiet"]
        wall, cpu, _ = timed([*p2pfl_program(), *args], os.environ | {"OMP_NUM_THREADS": "1"})
        summary = json.loads((out / "summary.json").read_text())
    return {
        "run_s": summary["wall_time_s"], "command_s": wall, "command_cpu_s": cpu,
        "accuracy": summary["final"]["accuracy"],
    }  # fmt: skip


def flower_command(python: Path, config: dict, cpus: int) -> dict[str, Any]:
    """``python flower_job.py CONFIG --cpus N`` as a user runs it: the simulation's wall time
    (what the job measures), the whole command's wall time and CPU seconds, the accuracy."""
    cmd = [str(python), str(HERE / "flower_job.py"), json.dumps(config), "--cpus", str(cpus)]
    wall, cpu, stdout = timed(cmd)
    job = json.loads(stdout.strip().splitlines()[-1])
    return {
        "run_s": job["wall_s"], "command_s": wall, "command_cpu_s": cpu,
        "accuracy": job["accuracy"], "flwr": job["flwr"],
    }  # fmt: skip


def torch_floor() -> dict[str, Any]:
    """``python -c "import torch"``: what any command that trains with torch costs at least."""
    wall, cpu, _ = timed([sys.executable, "-c", "import torch"])
    return {"run_s": None, "command_s": wall, "command_cpu_s": cpu, "accuracy": None}


def least(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's least over the repeats (the accuracy: the same in every one)."""
    out = dict(samples[0])
    for key in ("run_s", "command_s", "command_cpu_s"):
        values = [s[key] for s in samples if s[key] is not None]
        out[key] = min(values) if values else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--flower-cpus", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--workers", type=int, default=2, help="ranks of the --workers row")
    parser.add_argument("--repeats", type=int, default=2, help="times each case runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = copy.deepcopy(CONFIG)
    config["algorithm"]["rounds"] = config["eval"]["every"] = args.rounds
    config["peers"]["count"] = args.peers
    python = flower_python()
    load_before = os.getloadavg()
    command = f"p2pfl run (batched, --workers {args.workers})"
    samples: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        cases = {
            "flower": lambda: flower_command(python, config, args.flower_cpus),
            "python -c 'import torch'": torch_floor,
            "p2pfl run (batched, --workers 1)": lambda: p2pfl_command(config, 1),
            command: lambda: p2pfl_command(config, args.workers),
        }
        for name, case in cases.items():
            samples.setdefault(name, []).append(case())
    for name, batched in (("p2pfl.run (batched)", True), ("p2pfl.run (one by one)", False)):
        for _ in range(args.repeats):  # in this process: a run, no command around it
            wall, acc = p2pfl_run(config, batched)
            samples.setdefault(name, []).append(
                {"run_s": wall, "command_s": None, "command_cpu_s": None, "accuracy": acc}
            )
    best = {name: least(s) for name, s in samples.items()}
    flower = best.pop("flower")
    flower_name = f"flower {flower['flwr']} ({args.flower_cpus} cpus)"

    def ratio(ours: float | None, theirs: float) -> float | None:
        return None if ours is None else theirs / ours

    rows = [[flower_name, flower["run_s"], flower["command_s"], flower["command_cpu_s"],
             flower["accuracy"], 1.0, 1.0]]  # fmt: skip
    for name, b in best.items():
        rows.append([
            name, b["run_s"], b["command_s"], b["command_cpu_s"], b["accuracy"],
            ratio(b["run_s"], flower["run_s"]), ratio(b["command_s"], flower["command_s"]),
        ])  # fmt: skip
    ours = best[command]
    extra = {
        "config": config, "repeats": args.repeats, "samples": samples,
        "load_before": load_before, "load_after": os.getloadavg(),
        "goal_speedup": 10.0, "goal_accuracy_gap": 0.01,
        "speedup_runs": flower["run_s"] / ours["run_s"],
        "speedup_commands": flower["command_s"] / ours["command_s"],
        "command_floor_s": best["python -c 'import torch'"]["command_s"],
    }  # fmt: skip
    columns = ["case", "run_s", "command_s", "command_cpu_s", "final_accuracy",
               "run_speedup", "command_speedup"]  # fmt: skip
    report("vs_flower", columns, rows, extra)
    print(
        f"{command} against Flower: {extra['speedup_runs']:.1f}x for the runs, "
        f"{extra['speedup_commands']:.1f}x for the whole commands (least of {args.repeats}); "
        f"load average before {extra['load_before']}, after {extra['load_after']}"
    )


if __name__ == "__main__":
    main()
