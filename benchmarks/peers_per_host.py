"""Peers per host: a real ZeroMQ run of N peers on this machine, its memory and start-up.

DFedAvgM on a ring, Fashion-MNIST split Dirichlet(0.5), MLP 784-200-10, ``--rounds``
rounds, run by ``p2pfl run --transport zmq`` (one process per peer, forked from the
launcher once it has imported torch and loaded the data). While it runs, twice a second,
the benchmark reads ``/proc/PID/smaps_rollup`` of 8 of the launcher's children drawn at
random (a read takes up to 0.1 s under load): their private memory (USS: private clean +
dirty pages) and proportional share (PSS); each sampled peer's largest is kept. The table
gives the median and the largest USS of the sampled peers, and the PSS of all peers
(their mean PSS times N) with the launcher's USS beside it. A peer's model states (its model,
its momentum, the two neighbours' models it averages: 4 model sizes) are what it must hold;
the goal is at most 60 MB of private memory per peer beyond them.

Side by side, in the same run: one ``p2pfl peer`` process started fresh (the path of a
single node on a host of a multi-host run), its USS and PSS once it is up and waiting.

Start-up is the time from the command's start until every node has said hello and the
launcher has sent the start signal (then the first trainings begin): the launcher's own
set-up (import, data, model) plus ``startup_wall_s`` of ``summary.json`` (forks, binds,
hellos). The goal for 200 peers is 30 s.

    OMP_NUM_THREADS=1 python benchmarks/peers_per_host.py [--peers 10 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL_BYTES = 4 * (784 * 200 + 200 + 200 * 10 + 10)  # float32 MLP 784-200-10
STATES = 4  # model, momentum, two neighbours' models
MiB = 1 << 20
SAMPLE = 8  # peers whose memory is read per pass (a read takes up to 0.1 s under load)


def config(peers: int, rounds: int) -> dict:
    return {
        "name": f"peers-per-host-{peers}",
        "seed": 0,
        "dataset": {"name": "fashion_mnist"},
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 2},
        "model": {"name": "mlp", "hidden": [200]},
        "topology": {"kind": "ring"},
        "peers": {"count": peers},
        "algorithm": {"name": "dfedavgm", "rounds": rounds},
        "train": {"epochs": 1, "batch_size": 64, "lr": 0.05, "momentum": 0.9},
        "eval": {"every": rounds},
        "transport": {"timeout_s": 600, "startup_timeout_s": 600},
    }


def memory(pid: int) -> tuple[int, int] | None:
    """(USS, PSS) of a process in bytes, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = {}
    for line in text.splitlines()[1:]:
        key, value, *_ = line.split()
        kb[key.rstrip(":")] = int(value)
    return (kb["Private_Clean"] + kb["Private_Dirty"]) * 1024, kb["Pss"] * 1024


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def real_run(peers: int, rounds: int, tmp: Path) -> dict:
    """Run N peers over ZeroMQ; sample the peers' memory every second."""
    exp = tmp / f"exp-{peers}.yaml"
    exp.write_text(yaml.safe_dump(config(peers, rounds)))
    out = tmp / f"run-{peers}"
    cmd = [sys.executable, "-m", "p2pfl", "run", str(exp), "--out", str(out), "--quiet"]
    started = time.monotonic()
    proc = subprocess.Popen([*cmd, "--transport", "zmq"], cwd=ROOT, stderr=subprocess.PIPE)
    rng = random.Random(0)
    peak: dict[int, tuple[int, int]] = {}  # sampled peer -> its largest (USS, PSS)
    launcher = 0
    while proc.poll() is None:
        time.sleep(0.5)
        kids = children(proc.pid)
        for pid in rng.sample(kids, min(SAMPLE, len(kids))):
            if (m := memory(pid)) is not None and m[0] > peak.get(pid, (0, 0))[0]:
                peak[pid] = m
        if kids:
            launcher = max(launcher, (memory(proc.pid) or (0, 0))[0])
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"the {peers}-peer run failed: {proc.stderr.read().decode()[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    setup_s = wall - summary["wall_time_s"]  # import, data and model, before the run starts
    uss = [u for u, _ in peak.values()]
    pss = [p for _, p in peak.values()]
    return {
        "peers": peers,
        "startup_s": setup_s + summary["startup_wall_s"],
        "setup_s": setup_s,
        "forks_hellos_s": summary["startup_wall_s"],
        "wall_s": wall,
        "sampled_peers": len(peak),
        "uss_per_peer_mib": statistics.median(uss) / MiB,
        "uss_max_peer_mib": max(uss) / MiB,
        "beyond_states_mib": (statistics.median(uss) - STATES * MODEL_BYTES) / MiB,
        "pss_total_mib": peers * statistics.mean(pss) / MiB,
        "launcher_uss_mib": launcher / MiB,
        "final_accuracy": summary["final"]["accuracy"],
    }


def fresh_peer(tmp: Path) -> dict:
    """One ``p2pfl peer`` process in a fresh interpreter, up and waiting for its neighbour."""
    exp = tmp / "exp-fresh.yaml"
    exp.write_text(
        yaml.safe_dump(config(2, 1) | {"topology": {"kind": "edges", "edges": [[0, 1]]}})
    )
    addresses = tmp / "addresses.yaml"
    addresses.write_text(yaml.safe_dump({0: "tcp://127.0.0.1:47301", 1: "tcp://127.0.0.1:47302"}))
    cmd = [sys.executable, "-m", "p2pfl", "peer", str(exp), "--peer", "0"]
    cmd += ["--addresses", str(addresses), "--out", str(tmp / "fresh")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        metrics = tmp / "fresh" / "peers" / "0" / "comm.csv"
        deadline = time.monotonic() + 120
        while not metrics.is_file() and time.monotonic() < deadline:  # made once it is up
            time.sleep(0.5)
        time.sleep(5.0)  # its first training is done (then it waits for peer 1)
        uss, pss = memory(proc.pid) or (0, 0)
    finally:
        proc.kill()
        proc.wait()
    return {"uss_mib": uss / MiB, "pss_mib": pss / MiB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[10, 200])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="p2pfl-pph") as tmp:
        fresh = fresh_peer(Path(tmp))
        for n in args.peers:
            r = real_run(n, args.rounds, Path(tmp))
            runs.append(r)
            rows.append([
                n, r["startup_s"], r["setup_s"], r["forks_hellos_s"], r["wall_s"],
                r["sampled_peers"], r["uss_per_peer_mib"], r["uss_max_peer_mib"],
                r["beyond_states_mib"], r["pss_total_mib"], r["launcher_uss_mib"],
                r["final_accuracy"],
            ])  # fmt: skip
    print(
        f"a fresh p2pfl peer process: USS {fresh['uss_mib']:.0f} MiB, "
        f"PSS {fresh['pss_mib']:.0f} MiB"
    )
    columns = [
        "peers", "startup_s", "setup_s", "forks+hellos_s", "wall_s", "sampled", "uss/peer MiB",
        "max uss MiB", "beyond states MiB", "pss total MiB", "launcher uss MiB", "final acc",
    ]  # fmt: skip
    report(
        "peers_per_host",
        columns,
        rows,
        {"fresh_peer": fresh, "rounds": args.rounds, "model_bytes": MODEL_BYTES, "runs": runs},
    )


if __name__ == "__main__":
    main()
