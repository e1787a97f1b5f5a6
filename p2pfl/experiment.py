"""One run of an experiment: build every part from the resolved config, run it, write results.

Outputs (all in the run directory): ``config.yaml`` (resolved), ``partition.csv`` and
``partition.png``, ``metrics.csv`` and ``comm.csv`` (written as the run goes) and
``summary.json`` (at the end, also when the run fails, with ``status: failed``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from p2pfl.config import EvalConfig
from p2pfl.data.datasets import load_dataset
from p2pfl.data.federated import FederatedData, make_federated_data, save_partition
from p2pfl.effects import Finish, State
from p2pfl.errors import ConfigError, RunError
from p2pfl.ledger import Ledger
from p2pfl.methods import METHODS
from p2pfl.methods.base import Method, NodeContext
from p2pfl.metrics import MetricsLog
from p2pfl.models import average_states
from p2pfl.peers import Population, build_peers
from p2pfl.runtime.sim import SimRuntime
from p2pfl.runtime.worker import Worker
from p2pfl.seeding import derive_seed
from p2pfl.topology import Topology, build_topology
from p2pfl.training import TrainConfig, Trainer


def _within(prefix: str, fn: Any, *args: Any) -> Any:
    """Call ``fn``; a ConfigError it raises gets the section ``prefix`` in its key."""
    try:
        return fn(*args)
    except ConfigError as e:
        raise e.within(prefix) from None


@dataclass
class Setup:
    """Everything a runtime needs, built from a resolved config."""

    config: dict[str, Any]
    method: Method
    population: Population
    topology: Topology
    trainer: Trainer
    data: FederatedData
    train: TrainConfig
    eval: EvalConfig

    @property
    def seed(self) -> int:
        return self.config["seed"]

    def contexts(self) -> dict[int, NodeContext]:
        init_seed = derive_seed(self.seed, "init")
        return {
            node: NodeContext(
                node=node,
                topology=self.topology,
                num_samples=self.data.peers[node].num_train
                if node < self.topology.num_peers
                else 0,
                seed=self.seed,
                init_state=lambda: self.trainer.init_state(init_seed),
            )
            for node in self.topology.graph.nodes
        }


def build(config: dict[str, Any]) -> Setup:
    """Build the method, peers, topology, model and data (cheap checks first)."""
    seed = config["seed"]
    algo = {k: v for k, v in config["algorithm"].items() if k != "name"}
    method = _within("algorithm", lambda: METHODS.get(config["algorithm"]["name"])(**algo))
    population = _within("peers", build_peers, config["peers"], seed)
    topo_seed = derive_seed(seed, "topology")
    topology = _within(
        "topology", build_topology, config["topology"], len(population.profiles), topo_seed,
        population.link,
    )  # fmt: skip
    _within("topology", method.check, topology, seed)
    dataset = _within("dataset", load_dataset, config["dataset"], seed)
    trainer = _within("model", Trainer, config["model"], dataset.input_shape, dataset.num_classes)
    try:
        data = make_federated_data(dataset, config["partition"], topology.num_peers, seed)
    except ConfigError as e:
        raise e.within("peers" if e.key == "count" else "partition") from None
    return Setup(
        config, method, population, topology, trainer, data,
        TrainConfig(**config["train"]), EvalConfig(**config["eval"]),
    )  # fmt: skip


def run(setup: Setup, out: Path, progress: bool = False) -> dict[str, Any]:
    """Run ``setup`` in simulation, writing every output file under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(setup.config, sort_keys=False))
    save_partition(setup.data, out)
    summary = _summary_head(setup)
    ledger, metrics = Ledger(out / "comm.csv"), MetricsLog(out / "metrics.csv")
    worker = Worker(
        setup.trainer, setup.data, setup.train, setup.population, setup.topology, setup.seed,
        metrics, setup.eval.every, setup.method.rounds(setup.topology.num_peers), out, progress,
    )  # fmt: skip
    runtime = SimRuntime(setup.topology, worker, ledger)
    start = time.perf_counter()
    try:
        behaviours = {n: setup.method.behaviour(ctx) for n, ctx in setup.contexts().items()}
        finals = runtime.run(behaviours)
        summary |= _results(setup, worker, finals, runtime.now, metrics)
        if worker.baselines:
            summary["baselines"] = worker.baselines
        summary["status"] = "ok"
    except Exception as e:
        summary |= {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        raise RunError(f"run failed at t={runtime.now:.3f}s: {e}") from e
    finally:
        worker.close()
        ledger.close()
        metrics.close()
        summary |= {
            "comm": ledger.summary(),
            "sim_time_s": runtime.now,
            "wall_time_s": time.perf_counter() - start,
            "compute_wall_s": setup.trainer.busy_s,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _summary_head(setup: Setup) -> dict[str, Any]:
    c = setup.config
    return {
        "experiment": c["name"],
        "algorithm": c["algorithm"]["name"],
        "topology": setup.topology.kind,
        "num_peers": setup.topology.num_peers,
        "seed": setup.seed,
        "transport": "sim",
        "status": "running",
    }


def final_state(finals: dict[int, Finish], topology: Topology) -> State:
    """The run's output model: the ``output`` Finish (their mean if several agree to be
    outputs), else the uniform mean of the peers' final models."""
    outputs = [f.state for f in finals.values() if f.output and f.state is not None]
    if not outputs:
        outputs = [finals[p].state for p in topology.peers if finals[p].state is not None]
    if not outputs:
        raise RunError("no node finished with a model")
    return outputs[0] if len(outputs) == 1 else average_states(outputs)


def _results(
    setup: Setup, worker: Worker, finals: dict[int, Finish], now: float, metrics: MetricsLog
) -> dict[str, Any]:
    test_x, test_y = setup.data.test_x, setup.data.test_y
    final = final_state(finals, setup.topology)
    acc, loss = setup.trainer.evaluate(final, test_x, test_y, worker.device(0))
    last_round = setup.method.rounds(setup.topology.num_peers)
    metrics.log(now, last_round, "final", "accuracy", acc)
    metrics.log(now, last_round, "final", "loss", loss)
    per_peer = []
    if setup.eval.per_peer:
        for p in setup.topology.peers:
            state = finals[p].state
            peer_acc = (
                setup.trainer.evaluate(state, test_x, test_y, worker.device(p))[0]
                if state is not None
                else None
            )
            per_peer.append({"peer": p, "accuracy": peer_acc})
    return {"final": {"accuracy": acc, "loss": loss}, "per_peer": per_peer}
