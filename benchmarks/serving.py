"""Serving: the wall time of a 1,000-peer simulated run whose nodes answer arriving messages
while they train (``Serve``) against the same run done with receives (``Recv``).

Issue 39 asks that concurrent serving cost at most 10 % more wall time than the same run
without it, for 1,000 peers. What is compared, side by side in one process, in alternating
order, ``--repeats`` times each (the median is reported): two versions of one gossip-style
exchange, defined here as methods (``serving-bench``), on a random 4-regular graph of 1,000
peers, Fashion-MNIST (60 samples per peer, IID), a tiny MLP (784-8-10) with ``compute: model``
(the clock comes from FLOPs, so both runs are deterministic and neither waits on a measured
time; the tiny model makes the simulator's own work weigh as much as it can against training).
Every iteration k = 1..R, each peer sends its model x to one neighbour drawn from its seeded
stream, trains a copy of x for one local epoch, and applies the change:
x <- x + (trained - copy). Every model that arrives is merged into x, x <- (x + m) / 2:

- ``serve``: by a handler installed with ``Serve``, at the message's arrival, even while the
  peer trains (the runtime runs the handler between the behaviour's steps: the averaging
  thread of AD-PSGD, Lian et al. 2018, §4);
- ``recv``: by the behaviour itself after each training, with a ``Recv`` that takes what
  has arrived (its deadline is now); the messages wait in the inbox meanwhile.

After its last iteration each peer waits 1 s (every message is in by then) and, with
``recv``, merges what is left. Both versions train the same R x 1,000 times, send the same
R x 1,000 messages at the same simulated times (the clock depends only on FLOPs and bytes)
and merge each of them exactly once (counted here and shown in the table), with the same
tensor operations; only *when* a model is merged differs, so the models differ a little.
What the ratio measures is therefore the runtime's serving path (a handler generator driven
per arrival) against its inbox path (queue, match, return to the behaviour).

A second part times a real 10-peer AD-PSGD run over ``--transport zmq`` (ring, digits, one
peer in 10 given 10x less speed, 20 iterations), with ``transport.timeout_s`` 5 and 60 (the
default): it must finish with exit 0 and no traceback. Over sockets the drawn speeds shape
simulated time only (every peer process computes as fast as it can), so the slow peer is slow
in name; what the run shows is that serving from the receive loop while a thread trains
completes over real sockets. A passive peer that has done its own iterations goes on
answering until no request has come for ``timeout_s``, so the run's wall time is its work
plus that wait.

    OMP_NUM_THREADS=1 python benchmarks/serving.py [--repeats 5] [--peers 1000] [--rounds 5]
        [--no-zmq]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, report  # noqa: E402

import p2pfl  # noqa: E402
from p2pfl.core.seeding import numpy_rng  # noqa: E402
from p2pfl.learning.state import average_states  # noqa: E402
from p2pfl.methods.adpsgd import applied  # noqa: E402
from p2pfl.methods.base import METHODS, Method, NodeContext  # noqa: E402
from p2pfl.methods.effects import (  # noqa: E402
    Behaviour,
    Evaluate,
    Finish,
    Neighbours,
    Now,
    Recv,
    Send,
    Serve,
    State,
    Train,
    Wait,
)
from p2pfl.network.message import Message  # noqa: E402

MERGES: Counter[str] = Counter()  # merges per case, counted across a run


@dataclass
class Holder:
    """A peer's model, shared by its behaviour and its handler."""

    x: State


@dataclass(kw_only=True, eq=False)
class Exchange(Method):
    """Push to a random neighbour, train, merge what arrives: at arrival (``serve: true``)
    or after each training (``serve: false``)."""

    serverless = True

    rounds: int = 5
    serve: bool = False

    def total_rounds(self, num_peers: int) -> int:
        return self.rounds

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        node = Holder(ctx.init_state())
        case = "serve" if self.serve else "recv"

        def merge(msg: Message) -> Behaviour:
            node.x = average_states([node.x, msg.tensors])
            MERGES[case] += 1
            yield from ()

        def merge_arrived() -> Behaviour:
            now = yield Now()
            for msg in (yield Recv(count=len(ctx.peers), deadline=now)):
                yield from merge(msg)

        if self.serve:
            yield Serve(merge)
        for k in range(1, self.rounds + 1):
            neighbours = yield Neighbours(round=k)
            j = int(numpy_rng(ctx.seed, "serving-bench", ctx.node, k).choice(neighbours))
            yield Send(j, "model", k, node.x)
            stale = node.x
            trained = (yield Train(stale, k)).state  # a handler may merge meanwhile
            node.x = applied(node.x, stale, trained)
            if not self.serve:
                yield from merge_arrived()
            yield Evaluate(node.x, k)
        yield Wait(until=(yield Now()) + 1.0)  # every message is in by then
        if not self.serve:
            yield from merge_arrived()
        yield Finish(node.x)


def register() -> None:
    """Register the method (in ``main``: importing this file leaves the registry alone)."""
    if "serving-bench" not in METHODS:
        METHODS.register("serving-bench")(Exchange)


CONFIG: dict[str, Any] = {
    "name": "serving-bench",
    "seed": 0,
    "dataset": {"name": "fashion_mnist", "subset": 60000, "test_subset": 500},
    "partition": {"name": "iid"},
    "model": {"name": "mlp", "hidden": [8]},
    "topology": {"kind": "random_regular", "d": 4},
    "peers": {"count": 1000, "compute": "model"},
    "algorithm": {"name": "serving-bench", "rounds": 5},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
    "eval": {"every": 5, "per_peer": False},
}
CASES = {"recv": False, "serve": True}


def config(case: str, peers: int, rounds: int) -> dict[str, Any]:
    c = copy.deepcopy(CONFIG)
    c["peers"]["count"] = peers
    c["algorithm"] |= {"rounds": rounds, "serve": CASES[case]}
    c["eval"]["every"] = rounds
    return c


def once(case: str, peers: int, rounds: int) -> dict[str, Any]:
    """One run of ``case``: its row (``wall_time_s`` is the run alone: no build)."""
    MERGES.clear()
    with tempfile.TemporaryDirectory() as out:
        result = p2pfl.run(config(case, peers, rounds), out=out)
        comm = result.comm
    s = result.summary
    return {
        "case": case,
        "wall_s": s["wall_time_s"],
        "train_eval_s": s["compute_wall_s"],
        "sim_overhead_s": s["wall_time_s"] - s["compute_wall_s"],
        "messages": int(len(comm)),
        "merges": MERGES[case],
        "sim_time_s": s["sim_time_s"],
        "accuracy": s["final"]["accuracy"],
    }


ZMQ_RUN: dict[str, Any] = {
    "name": "serving-zmq-adpsgd",
    "seed": 0,
    "dataset": {"name": "digits"},
    "partition": {"name": "iid"},
    "model": {"name": "mlp", "hidden": [64]},
    "topology": {"kind": "ring"},
    "peers": {"count": 10, "flops_per_s": 3.0e8, "slow_fraction": 0.1, "slow_factor": 0.1},
    "algorithm": {"name": "adpsgd", "rounds": 20, "reply_timeout_s": 1.0},
    "train": {"epochs": 1, "batch_size": 32, "lr": 0.05},
    "eval": {"every": 5, "per_peer": False},
}


ZMQ_TIMEOUTS = [5.0, 60.0]
"""``transport.timeout_s`` of the ZeroMQ runs: a passive AD-PSGD peer, done with its own
iterations, answers requests until no message has come for that long (its ``Recv`` with no
deadline), so the run ends about that long after the last request; 60 s is the default."""


def zmq_run(timeout_s: float) -> dict[str, Any]:
    """The 10-peer AD-PSGD run over ZeroMQ, as a user starts it: wall time (from outside),
    exit code, whether stderr holds a traceback, and the run's summary."""
    with tempfile.TemporaryDirectory() as tmp:
        exp, out = Path(tmp) / "exp.yaml", Path(tmp) / "out"
        exp.write_text(yaml.safe_dump(ZMQ_RUN | {"transport": {"timeout_s": timeout_s}}))
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "p2pfl", "run", str(exp), "--transport", "zmq",
             "--out", str(out), "--quiet"],
            cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip
        wall = time.perf_counter() - start
        summary = (out / "summary.json").read_text() if (out / "summary.json").exists() else "{}"
    s = yaml.safe_load(summary) or {}
    return {
        "timeout_s": timeout_s,
        "exit": done.returncode,
        "traceback": "Traceback" in done.stderr,
        "command_wall_s": wall,
        "run_wall_s": s.get("wall_time_s"),
        "messages": s.get("comm", {}).get("messages"),
        "accuracy": s.get("final", {}).get("accuracy"),
        "status": s.get("status"),
        "stderr_tail": done.stderr[-2000:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-zmq", action="store_true", help="skip the ZeroMQ AD-PSGD run")
    args = parser.parse_args()
    register()
    once("recv", args.peers, args.rounds)  # warm-up: torch, the data cache
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    for i in range(args.repeats):
        order = list(CASES) if i % 2 == 0 else list(reversed(CASES))  # alternate: fair to load
        for case in order:
            runs[case].append(once(case, args.peers, args.rounds))
    columns = list(runs["recv"][0])
    rows = [[r[k] for k in columns] for case in CASES for r in runs[case]]
    median = {
        case: {k: statistics.median(r[k] for r in runs[case]) for k in columns if k != "case"}
        for case in CASES
    }
    recv, serve = median["recv"], median["serve"]
    ratio = serve["wall_s"] / recv["wall_s"]
    extra: dict[str, Any] = {
        "config": CONFIG,
        "peers": args.peers,
        "rounds": args.rounds,
        "median": median,
        "ratio": ratio,
        "sim_overhead_ratio": serve["sim_overhead_s"] / recv["sim_overhead_s"],
        "goal": 1.10,
        "load": os.getloadavg(),
    }
    if not args.no_zmq:
        extra["zmq_adpsgd"] = [zmq_run(t) for t in ZMQ_TIMEOUTS]
        extra["zmq_config"] = ZMQ_RUN
    report("serving", columns, rows, extra)
    print(
        f"{args.peers} peers, {args.rounds} iterations: median wall {recv['wall_s']:.2f} s "
        f"with Recv, {serve['wall_s']:.2f} s with Serve: ratio {ratio:.3f} (goal <= 1.10); "
        f"simulator's own time {recv['sim_overhead_s']:.2f} s vs {serve['sim_overhead_s']:.2f} s; "
        f"{serve['messages']:.0f} messages, merges {recv['merges']:.0f} / {serve['merges']:.0f}; "
        f"load average {extra['load']}"
    )
    for z in extra.get("zmq_adpsgd", []):
        print(
            f"10-peer AD-PSGD over --transport zmq, one slow peer, transport.timeout_s "
            f"{z['timeout_s']:g}: exit {z['exit']}, traceback {'yes' if z['traceback'] else 'no'}, "
            f"{z['command_wall_s']:.1f} s for the command ({z['run_wall_s']:.2f} s run), "
            f"{z['messages']} messages, accuracy {z['accuracy']:.4f}, status {z['status']}"
        )
        if z["exit"] or z["traceback"]:
            raise SystemExit(f"the ZeroMQ run failed:\n{z['stderr_tail']}")


if __name__ == "__main__":
    main()
