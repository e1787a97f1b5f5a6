"""One run of an experiment: build every part from the resolved config, run it, write results.

Outputs (all in the run directory): ``config.yaml`` (resolved), ``partition.csv`` and
``partition.png``, ``metrics.csv`` and ``comm.csv`` (written as the run goes) and
``summary.json`` (at the end, strict JSON: NaN becomes null; also when the run fails,
``status: failed``, or is interrupted by SIGINT or SIGTERM, ``status: interrupted`` with the
signal and the ``comm`` totals of what ``comm.csv`` holds).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from p2pfl.app.config import Resolved
from p2pfl.core.errors import ConfigError, RankFailed, RunError, TopologyMisfit
from p2pfl.core.json_io import write_json
from p2pfl.core.seeding import derive_seed
from p2pfl.data.datasets import load_dataset
from p2pfl.data.federated import make_federated_data
from p2pfl.learning.batched import unbatchable
from p2pfl.learning.state import average_states, is_ghost
from p2pfl.learning.training import Trainer, resolve_device
from p2pfl.methods.attacks import build_adversary
from p2pfl.methods.effects import Finish, State
from p2pfl.network.dynamics import Network
from p2pfl.network.ledger import Ledger, summarize_csv
from p2pfl.network.peers import save_peers
from p2pfl.network.topology import Topology, build_topology
from p2pfl.reporting import matching
from p2pfl.reporting.partition import save_counts, save_partition
from p2pfl.reporting.progress import time_to_accuracy
from p2pfl.reporting.reporters import Reporter, open_reporters
from p2pfl.runtime import children
from p2pfl.runtime.children import Forked, take_standby
from p2pfl.runtime.interpreter import ProgressBar
from p2pfl.runtime.launcher import NodeFiles, gather, launch
from p2pfl.runtime.ranks import Ranks
from p2pfl.runtime.setup import Setup
from p2pfl.runtime.shards import Shards
from p2pfl.runtime.sim import SimRuntime
from p2pfl.runtime.sockets import check_curve_keys
from p2pfl.runtime.windows import KeptLedger, KeptRows, Windows
from p2pfl.runtime.worker import Worker


def _within(prefix: str, fn: Any, *args: Any) -> Any:
    """Call ``fn``; a ConfigError it raises gets the section ``prefix`` in its key."""
    try:
        return fn(*args)
    except ConfigError as e:
        raise e.within(prefix) from None


def reason(e: BaseException) -> str:
    """``e``'s text, or its type's name where it has none (a ``MemoryError``): no failure
    is ever told with an empty reason."""
    return str(e) or type(e).__name__


def build(experiment: Resolved, transport: str = "sim") -> Setup:
    """Build what a resolved experiment needs the data or the graph for: the topology, the
    model, the federated data, the network and the adversary.

    With :func:`~p2pfl.app.config.resolve` this is the validation phase: every check that
    needs no training runs here, before a run writes anything, and raises ``ConfigError``;
    the methods' own checks on the model
    and data come last (``Method.check_data``), then whether the method fits the topology
    (``Method.check``, as a ``TopologyMisfit``: a sweep skips such a cell only when nothing
    else is wrong with it). ``transport: zmq`` also checks the CURVE keys of every node.
    """
    config, seed = experiment.config, experiment.seed
    method, population = experiment.method, experiment.population
    _within("peers", resolve_device, population.profiles[0].device)
    topo_seed = derive_seed(seed, "topology")
    topology = _within(
        "topology", build_topology, config["topology"], len(population.profiles), topo_seed,
        population.link, population.rates, children.available_memory(),
    )  # fmt: skip
    dataset = _within("dataset", load_dataset, config["dataset"], seed)
    trainer = _within(
        "model", Trainer, config["model"], dataset.input_shape, dataset.num_classes,
        dataset.train_x.dtype,
    )  # fmt: skip
    if population.batched and (why := unbatchable(trainer.module(torch.device("cpu")))):
        raise ConfigError("batched", why).within("peers")
    evaluation = experiment.eval
    if evaluation.peers is not None and evaluation.peers > topology.num_peers:
        raise ConfigError(
            "peers", f"{evaluation.peers} peers to score, but the run has {topology.num_peers}"
        ).within("eval")
    if evaluation.matching is not None:
        _within(
            "eval.matching", matching.check, matching.MatchingConfig(**evaluation.matching),
            trainer.module(torch.device("cpu")), topology.num_peers,
        )  # fmt: skip
    try:
        data = make_federated_data(dataset, config["partition"], topology.num_peers, seed)
    except ConfigError as e:
        raise e.within("peers" if e.key == "count" else "partition") from None
    adversary = None
    if "adversary" in config:
        adversary = _within("adversary", build_adversary, config["adversary"], topology, seed)
    if adversary is not None:
        if adversary.attack.corrupts and method.unattackable:
            raise ConfigError("attack", method.unattackable).within("adversary")
        for p in adversary.peers:  # a data attack changes what the attackers train on
            data.peers[p] = adversary.attack.poison(data.peers[p], data.num_classes)
    train = experiment.train
    train.check_data(data.peers)
    method.check_data(copy.deepcopy(trainer.module(torch.device("cpu"))), data)
    if transport == "zmq":
        check_curve_keys(experiment.transport, topology, topology.graph.nodes)
        if evaluation.every_s is not None:
            raise ConfigError(
                "every_s", "needs the simulation: over sockets no process holds every model"
            ).within("eval")
    network = None
    if "network" in config:
        network = _within("network", Network, config["network"], topology, seed)
        if not network.misbehaves:
            network = None  # reliable and static: the run is exactly one without the section
    if network is not None:
        _within("algorithm", method.check_network, network)
    try:
        method.check(topology, seed)
    except TopologyMisfit as e:  # keyed by the method's own key (its aggregator's)
        raise e.within("algorithm") from None
    except ConfigError as e:
        raise TopologyMisfit(e.key, e.message).within("topology") from None
    return Setup(
        config, method, population, topology, trainer, data, train, evaluation,
        experiment.transport, network, adversary, experiment.stop,
    )  # fmt: skip


def empty(out: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove what a run directory holds but ``keep`` (``--force``; a sweep cell that runs
    again: nothing of its last run may stay)."""
    for p in out.iterdir():
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def run(
    setup: Setup,
    out: Path,
    progress: bool = False,
    transport: str = "sim",
    ranks: Ranks | None = None,
    gathered: NodeFiles | None = None,
) -> dict[str, Any]:
    """Run ``setup`` simulated (``sim``; over several ``ranks`` if given) or as real
    processes (``zmq``); write to ``out``. ``gathered``: the real run happened elsewhere
    (``p2pfl peer`` on several hosts); its nodes' files, read from ``out``: merge them."""
    out.mkdir(parents=True, exist_ok=True)
    config_file = out / "config.yaml"
    config_file.write_text(yaml.safe_dump(setup.config, sort_keys=False))
    if setup.population.heterogeneous:  # each peer's drawn compute and bandwidths
        save_peers(setup.population, out / "peers.csv")
    figure = _draw_partition(setup, out, ranks)
    summary = _summary_head(setup) | {"transport": transport}
    start = time.perf_counter()
    clock = 0.0
    comm: dict[str, Any] = {}
    reporters = open_reporters(out, setup.eval.reporters)
    try:
        if transport == "sim":
            finals, baselines, clock, comm, stopped = _simulate(
                setup, out, progress, reporters, ranks
            )
            if setup.stop is not None:
                summary["stop"] = stopped
        else:
            outcome = (
                launch(setup, out, reporters) if gathered is None
                else gather(setup, out, gathered, reporters)
            )  # fmt: skip
            finals, baselines, clock, comm = (
                outcome.finals, outcome.baselines, outcome.elapsed_s, outcome.comm
            )  # fmt: skip
            if outcome.startup_s is not None:
                summary["startup_wall_s"] = outcome.startup_s
            if outcome.start_spread_s is not None:
                summary["start_spread_s"] = outcome.start_spread_s
            if setup.network is not None:
                save_availability(setup.network, clock, out)
        summary |= _results(setup, finals, clock, reporters, ranks)
        if setup.eval.targets:  # read back from metrics.csv and comm.csv, as written
            summary["time_to_accuracy"] = time_to_accuracy(out, setup.eval.targets)
        if baselines:
            summary["baselines"] = baselines
        summary["status"] = "ok"
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (the command line raises it)
        summary |= {"status": "interrupted", "signal": str(e) or "SIGINT"}
        raise
    except Exception as e:
        summary |= {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        if isinstance(e, RankFailed):  # another rank's whole message
            raise
        raise RunError(f"run failed: {reason(e)}") from e
    finally:
        reporters.close()
        if not comm and (out / "comm.csv").is_file():  # cut short: count what is on disk
            comm = summarize_csv(out / "comm.csv")
        summary |= {
            "comm": comm,
            "sim_time_s": clock,
            "wall_time_s": time.perf_counter() - start,
            "compute_wall_s": setup.trainer.busy_s,
        }
        write_json(out / "summary.json", summary)
        drawn = _wait(figure)
    if drawn:
        raise RunError(f"{out / 'partition.png'}: drawing it failed (exit status {drawn})")
    return summary


FIGURE_TIMEOUT_S = 300.0
"""How long a run waits at its end for its partition figure (1,000 peers: under 2 s)."""


_FIGURES = itertools.count()
"""How many partition figures this process was asked for."""


def _draw_partition(setup: Setup, out: Path, ranks: Ranks | None) -> Forked | None:
    """``partition.csv`` and ``partition.png``. A command that runs one experiment in one
    process draws them in a forked child while the run goes on: importing matplotlib and
    drawing take 1-1.5 s, most of a small run's command. ``p2pfl run`` forked that child
    as it started (a :class:`~p2pfl.runtime.children.Standby`), so matplotlib is imported
    by the time the counts are known; elsewhere it is forked here. Rank 0 of several draws
    so too: at nice 19 the child takes the cycles the ranks leave idle while they wait on
    each other, instead of holding every rank up by that long before the run. Ranks above
    0 draw nothing (rank 0 writes what is kept)."""
    if ranks is not None and ranks.rank > 0:
        return None
    if _in_process():
        save_partition(setup.data, out)
        return None
    if (ahead := take_standby("figure")) is not None:  # forked by p2pfl run as it started
        return ahead.give(save_counts, setup.data.counts, out)

    def draw() -> int:
        os.nice(19)  # only the cycles the run leaves idle: its threads keep their cores
        save_partition(setup.data, out)
        return 0

    return Forked(draw, "p2pfl-figure")


def _in_process() -> bool:
    """Whether to draw in this process: matplotlib is imported already, or this process
    runs several experiments (a sweep) and had better import it once than in each child
    (a child also makes the run's writes copy-on-write while it lives)."""
    return "matplotlib.figure" in sys.modules or next(_FIGURES) > 0


def _wait(figure: Forked | None) -> int:
    """The figure child's exit status (0 when there is none); one that hangs is killed."""
    if figure is None:
        return 0
    try:
        return figure.wait(FIGURE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        figure.kill()
        return figure.wait()


def _simulate(
    setup: Setup, out: Path, progress: bool, metrics: Reporter, ranks: Ranks | None = None
) -> tuple[dict[int, Finish], dict[str, float], float, dict[str, Any], dict[str, Any]]:
    """Run every node on one SimPy clock; return finals, baselines, end time, ledger and
    what ended the run (``stop:``: which condition, or ``rounds``; the samples trained)."""
    shards = windows = None
    if ranks is not None:
        sharded = b"events" if ranks.events else b"sharded" if ranks.sharded else b""
        ranks.agree(_fingerprint(setup.config) + setup.data.counts.tobytes() + sharded)
        ranks.take_gpu(setup.devices)
        if ranks.events:  # each rank runs its own peers, like one process of fewer peers
            windows = Windows(ranks, setup.topology, setup.network, setup.init_state())
        elif ranks.sharded:
            shards = Shards(ranks, setup.topology.num_peers)
    ledger = Ledger(out / "comm.csv", fates=setup.network is not None)
    rows = metrics if windows is None else KeptRows(windows, metrics)
    worker = Worker(setup, rows, out, None if windows else ranks, shards)
    if windows is not None:  # rank 0 keeps the baselines and writes the artifacts, in order
        worker.baseline = windows.writer(worker.baseline)
        worker.save_artifact = windows.writer(worker.save_artifact)
    runtime = SimRuntime(
        setup.topology, worker, ledger if windows is None else KeptLedger(windows, ledger),
        setup.compression, setup.network, setup.population.uplink, setup.stop,
        setup.eval.every_s, shards, windows,
    )  # fmt: skip
    rounds = worker.total_rounds if setup.stop is None else None  # a stop: may come any time
    runtime.bar = ProgressBar(rounds, progress)
    try:
        contexts = setup.contexts(shards.mine if shards else None)
        behaviours = {
            n: setup.behaviour(ctx)
            for n, ctx in contexts.items()
            if windows is None or windows.mine(n)
        }
        finals = runtime.run(behaviours)
        if windows is not None:
            finals = windows.finals(finals)
        worker.settle()
    except Exception as e:
        if shards is not None and "meta" in str(e):  # an operation read a ghost's values
            raise RunError(
                f"at t={runtime.now:.3f}s: {setup.config['algorithm']['name']} cannot run "
                f"sharded (--shard): it reads another rank's model ({str(e).splitlines()[0]})"
            ) from e
        if ranks is not None and ranks.rank == 0:  # keep the rows held behind deferred scores
            with contextlib.suppress(Exception):  # the run's own error is the one to report
                worker.settle(alone=True)
        if isinstance(e, RankFailed):
            raise
        raise RunError(f"at t={runtime.now:.3f}s: {reason(e)}") from e
    finally:
        runtime.bar.close()
        ledger.close()
        if setup.network is not None:
            save_availability(setup.network, runtime.now, out)
    stopped = {"by": runtime.halted or "rounds", "samples": runtime.samples}
    return finals, worker.baselines, runtime.now, ledger.summary(), stopped


_PATHS = frozenset({"root", "file", "trace", "plugins", "curve_keys", "devices"})
"""Keys that name files, which may lie elsewhere on each host of a run."""


def _fingerprint(config: Any) -> bytes:
    """``config`` as bytes, but the files it names: what every rank of a run must share."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _PATHS}
        return [strip(v) for v in value] if isinstance(value, list) else value

    return yaml.safe_dump(strip(config), sort_keys=True).encode()


def save_availability(network: Network, end: float, out: Path) -> None:
    """``availability.csv``: one row per online interval of each peer (peer, from, to)."""
    with open(out / "availability.csv", "w") as f:
        f.write("peer,online_from,online_to\n")
        for peer in network.topology.peers:
            for start, stop in network.availability(peer, end):
                f.write(f"{peer},{start:.9g},{stop:.9g}\n")


def _summary_head(setup: Setup) -> dict[str, Any]:
    c = setup.config
    return {
        "experiment": c["name"],
        "algorithm": c["algorithm"]["name"],
        "topology": setup.topology.kind,
        "num_peers": setup.topology.num_peers,
        "seed": setup.seed,
        "status": "running",
    }


def final_state(
    finals: dict[int, Finish],
    topology: Topology,
    start: State | None = None,
    shards: Shards | None = None,
) -> State:
    """The run's output model: the ``output`` Finish (their mean if several agree to be
    outputs), else the uniform mean of the peers' final models (over ``shards``, each
    rank's from its own peers); ``start`` if none has one (a run stopped before any node
    finished an iteration), else an error."""
    outputs = [s for f in finals.values() if f.output and (s := f.state) is not None]
    if not outputs:  # a peer that crashed has no Finish
        held = [
            (p, s) for p in topology.peers if p in finals and (s := finals[p].state) is not None
        ]
        if held and shards is not None:
            return shards.average(held)
        outputs = [s for _, s in held]
    if not outputs and start is not None:
        return start
    if not outputs:
        raise RunError("no node finished with a model")
    return outputs[0] if len(outputs) == 1 else average_states(outputs)


def _results(
    setup: Setup, finals: dict[int, Finish], now: float, metrics: Reporter, ranks: Ranks | None
) -> dict[str, Any]:
    """Score the output model and every peer's final model (split across ``ranks``); log
    the output's rows."""
    device = resolve_device(setup.population.profiles[0].device)

    def score(state: State) -> tuple[float, float]:
        return setup.trainer.evaluate(state, setup.data.test_x, setup.data.test_y, device)

    start = setup.init_state() if setup.stop else None
    shards = Shards(ranks, setup.topology.num_peers) if ranks and ranks.sharded else None
    output = final_state(finals, setup.topology, start, shards)
    acc, loss = (math.nan, math.nan) if is_ghost(output) else score(output)  # rank 0 holds it
    last_round = setup.method.total_rounds(setup.topology.num_peers)
    metrics.log(now, last_round, "final", "accuracy", acc)
    metrics.log(now, last_round, "final", "loss", loss)
    results: dict[str, Any] = {}
    if setup.eval.matching is not None:
        results["matching"] = matching.measure(
            setup.trainer, output, setup.data, setup.train,
            matching.MatchingConfig(**setup.eval.matching), setup.seed, device,
        )  # fmt: skip
        for against, ratios in results["matching"].items():
            for layer, ratio in ratios.items():
                metrics.log(now, last_round, "final", f"match_{against}/{layer}", ratio)
    per_peer = []
    if setup.eval.per_peer:
        peers = setup.topology.peers
        scored = [(p, s) for p in peers if p in finals and (s := finals[p].state) is not None]
        if ranks is None:
            accs = [score(s)[0] for _, s in scored]
        else:
            owner = [shards.owner(p) for p, _ in scored] if shards else None
            job = lambda i: score(scored[i][1])[:1]  # noqa: E731
            accs = [a[0] for a in ranks.spread(len(scored), 1, job, owner)]
        acc_of = dict(zip([p for p, _ in scored], accs, strict=True))
        per_peer = [{"peer": p, "accuracy": acc_of.get(p)} for p in peers]
    if setup.adversary is not None:
        bad = set(setup.adversary.peers)
        honest = [
            r["accuracy"] for r in per_peer if r["peer"] not in bad and r["accuracy"] is not None
        ]
        results["adversary"] = {
            "attack": setup.adversary.name,
            "peers": list(setup.adversary.peers),
            "honest_accuracy": sum(honest) / len(honest) if honest else None,
        }
    return results | {"final": {"accuracy": acc, "loss": loss}, "per_peer": per_peer}
