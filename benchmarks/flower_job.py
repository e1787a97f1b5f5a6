"""The FedAvg job of ``vs_flower.py`` in Flower's simulation engine (run in its own venv).

It builds the job with p2pfl's own config code (the same data split, initial model and
local training loop, ``Trainer.train``), so the two frameworks run the same job: a custom
strategy picks the same peers each round as p2pfl's FedAvg, each client draws the same
batch orders, and the server weighs models by sample counts. Flower's part is everything
around that: Ray actors, client proxies, parameter serialization and aggregation. Prints
one JSON line: wall time of the simulation, final accuracy.

    benchmarks/.flwr-venv/bin/python benchmarks/flower_job.py CONFIG_JSON [--cpus 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import flwr  # noqa: E402
from flwr.client import NumPyClient  # noqa: E402
from flwr.common import Context, ndarrays_to_parameters  # noqa: E402
from flwr.server import ServerConfig  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.simulation import start_simulation  # noqa: E402

from p2pfl.app.config import resolve  # noqa: E402
from p2pfl.app.experiment import build  # noqa: E402
from p2pfl.core.seeding import derive_seed, torch_generator  # noqa: E402
from p2pfl.runtime.setup import Setup  # noqa: E402

CPU = torch.device("cpu")
CONFIG_ENV = "P2PFL_FLOWER_JOB"
_SETUP: list[Setup] = []


def job() -> Setup:
    """This process's copy of the job (Ray's actor processes build their own, once)."""
    if not _SETUP:
        config = json.loads(os.environ[CONFIG_ENV])
        _SETUP.append(build(resolve(config, ROOT / "benchmarks" / "flower.yaml")))
    return _SETUP[0]


class PeerClient(NumPyClient):
    """One p2pfl peer as a Flower client: trains with p2pfl's loop on its own split."""

    def __init__(self, peer: int) -> None:
        self.setup, self.peer = job(), peer
        self.keys = list(self.setup.trainer.init_state(0))

    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list, int, dict]:
        state = {k: torch.from_numpy(a) for k, a in zip(self.keys, parameters, strict=True)}
        rnd = int(config["round"])
        gen = torch_generator(self.setup.seed, "train", self.peer, rnd, "")
        data = self.setup.data.peers[self.peer]
        result = self.setup.trainer.train(state, data, self.setup.train, gen, CPU)
        return [t.numpy() for t in result.state.values()], data.num_train, {}


def client_fn(context: Context) -> flwr.client.Client:
    return PeerClient(int(context.node_config["partition-id"])).to_client()


class SameSample(FedAvg):
    """Flower's FedAvg, but each round trains exactly the peers p2pfl's FedAvg picks."""

    def __init__(self, setup: Setup, **kwargs) -> None:
        super().__init__(**kwargs)
        self.setup = setup

    def configure_fit(self, server_round, parameters, client_manager):
        client_manager.wait_for(self.setup.topology.num_peers)
        proxies = {int(c.partition_id): c for c in client_manager.all().values()}
        chosen = self.setup.method.sample(self.setup.topology.peers, self.setup.seed, server_round)
        fit_ins = flwr.common.FitIns(parameters, {"round": server_round})
        return [(proxies[p], fit_ins) for p in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the experiment as JSON (p2pfl config mapping)")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs Ray may use")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Ray's workers inherit the environment: they find the job and this module by it, so
    # client_fn travels to them by reference, not with the data inside it.
    os.environ[CONFIG_ENV] = args.config
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])
    import flower_job  # this file as a module, so that Ray pickles client_fn by name

    setup = flower_job.job()
    init = setup.trainer.init_state(derive_seed(setup.seed, "init"))
    keys, rounds = list(init), setup.method.rounds
    final: dict[str, float] = {}

    def evaluate(server_round: int, parameters: list[np.ndarray], config: dict):
        if server_round != rounds:
            return None
        state = {k: torch.from_numpy(a) for k, a in zip(keys, parameters, strict=True)}
        acc, loss = setup.trainer.evaluate(state, setup.data.test_x, setup.data.test_y, CPU)
        final.update(accuracy=acc, loss=loss)
        return loss, {"accuracy": acc}

    strategy = flower_job.SameSample(
        setup,
        fraction_evaluate=0.0,
        min_available_clients=setup.topology.num_peers,
        initial_parameters=ndarrays_to_parameters([t.numpy() for t in init.values()]),
        evaluate_fn=evaluate,
    )
    start = time.perf_counter()
    start_simulation(
        client_fn=flower_job.client_fn,
        num_clients=setup.topology.num_peers,
        config=ServerConfig(num_rounds=rounds),
        strategy=strategy,
        client_resources={"num_cpus": 1},
        ray_init_args={"num_cpus": args.cpus, "include_dashboard": False, "log_to_driver": False},
    )
    wall = time.perf_counter() - start
    print(json.dumps({"wall_s": wall, "flwr": flwr.__version__, "pid": os.getpid()} | final))


if __name__ == "__main__":
    main()
