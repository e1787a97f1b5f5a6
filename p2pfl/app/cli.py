"""The ``p2pfl`` command line: ``run`` an experiment (or a sweep), run one ``peer`` of a real
run, ``keys``, ``cost`` (analytic communication cost), ``plot`` (pictures of runs) and
``report`` (one HTML page of runs).

Exit codes: 0 success; 2 bad config or arguments (one line ``error: FILE: key: reason``);
1 a run that started and failed (its outputs so far stay on disk); 130 interrupted (SIGINT
or SIGTERM: both end a run the same way, with ``summary.json`` saying ``interrupted``).

A run owns its ``--out`` directory: one that holds anything is refused unless ``--force``
(which empties it first, and only if it holds a p2pfl run or sweep and nothing else), and a
directory another run is writing to (it holds the lock ``.p2pfl.lock``) is refused, both
before anything is loaded. A sweep may reuse a directory that holds a sweep and nothing else
(finished cells are kept) but not share it with another.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import datetime
import fcntl
import gc
import math
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from p2pfl.core.errors import ConfigError, RunError

if TYPE_CHECKING:
    from p2pfl.runtime.children import Workers
    from p2pfl.runtime.ranks import Ranks
    from p2pfl.runtime.setup import Setup


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one ``error:`` line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _error(message)
        sys.exit(2)


def _error(message: str) -> None:
    """One ``error:`` line in one write: peers and ranks share the launcher's stderr."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="p2pfl", description="Peer-to-peer federated-learning simulator.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="run an experiment file")
    _experiment_args(r)
    r.add_argument("--out", help="output directory (default runs/NAME-seedN)")
    r.add_argument(
        "--force", action="store_true", help="replace what an existing run directory holds"
    )
    r.add_argument(
        "--transport",
        choices=["sim", "zmq"],
        default="sim",
        help="sim: simulated network (default); zmq: one process per peer over ZeroMQ",
    )
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument(
        "--workers",
        type=int,
        default=1,
        help="train on N local processes (torch.distributed), or run N cells of a sweep at a "
        "time; same results as one",
    )
    r.add_argument(
        "--shard",
        action="store_true",
        help="with --workers N or torchrun: each rank holds only its own share of the peers' "
        "models (memory per rank ~ 1/N); same results as one process",
    )
    r.add_argument(
        "--shard-events",
        action="store_true",
        help="as --shard, and each rank also runs only its own peers' events, the ranks "
        "advancing in windows of the smallest link latency; same results as one process",
    )

    peer = sub.add_parser("peer", help="run one node of a real (ZeroMQ) run, e.g. on another host")
    _experiment_args(peer)
    peer.add_argument(
        "--peer",
        required=True,
        help="node(s) to run: peer numbers, ranges and 'server', e.g. 0-49 or server,0,1 "
        "(several: one process each, forked from this one)",
    )
    peer.add_argument(
        "--addresses", required=True, help="YAML file mapping node names to tcp://host:port"
    )
    peer.add_argument("--out", required=True, help="output directory (writes peers/NAME/)")
    peer.add_argument(
        "--start-at",
        metavar="TIME",
        help="start every node's clock at this wall-clock time, the same on every host: Unix "
        "seconds or ISO 8601 with a time zone (2026-11-26T09:30:00Z); within the next 24 h",
    )

    keys = sub.add_parser("keys", help="make CURVE key pairs for transport.curve_keys")
    keys.add_argument("directory", help="where to write NAME.key and NAME.key_secret")
    keys.add_argument("--peers", type=int, required=True, help="number of peers")
    keys.add_argument("--server", action="store_true", help="also a key pair for the server")

    cost = sub.add_parser("cost", help="analytic communication cost of methods x topologies")
    _experiment_args(cost)
    cost.add_argument("--methods", help="NAME[:KEY=VALUE...],... (default: the experiment's)")
    cost.add_argument("--topologies", default="ring,mesh,star", help="topology kinds, a,b,c")
    cost.add_argument("--peers", type=int, help="number of peers (default: the experiment's)")
    cost.add_argument("--model-bytes", type=int, help="M: count tensor bytes, a model as M")
    cost.add_argument("--out", help="output directory (default runs/NAME-cost)")

    merge = sub.add_parser(
        "merge", help="outputs of a real run whose peers ran on several hosts (p2pfl peer)"
    )
    merge.add_argument("run", metavar="RUN_DIR", help="holds every node's peers/NAME/ directory")
    merge.add_argument("--force", action="store_true", help="merge an already merged run again")

    plot = sub.add_parser("plot", help="pictures of finished runs and sweeps")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run or sweep directories")
    plot.add_argument("--out", help="output directory (default RUN_DIR/plots, the first one)")
    plot.add_argument(
        "--x", action="append", choices=("time", "bytes"),
        help="only the time-to-accuracy figure: each run's accuracy against simulated time "
        "or bytes sent, with its eval.targets (repeatable)",
    )  # fmt: skip
    report = sub.add_parser("report", help="one self-contained HTML page of runs and sweeps")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run or sweep directories")
    report.add_argument(
        "--out", metavar="FILE.html",
        help="the page (default RUN_DIR/report.html for one directory; required for several)",
    )  # fmt: skip
    return p


def _experiment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment YAML file")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override any key, e.g. --set partition.alpha=0.1 (repeatable)",
    )
    p.add_argument("--seed", type=int, help="override the experiment's seed")
    p.set_defaults(given=None)  # the file's contents, where Python gives them (p2pfl.app.library)


def _setup(args: argparse.Namespace, transport: str = "sim"):
    """Load, override and build the experiment: every check before anything is written
    (config errors name the file)."""
    from p2pfl.app.experiment import build
    from p2pfl.app.sweep import load_experiment

    experiment = load_experiment(args.experiment, args.sets, args.seed, args.given)
    try:
        return build(experiment, transport)
    except ConfigError as e:
        e.file = e.file or args.experiment
        raise


def output_dir(path: str) -> Path:
    """``--out`` checked before anything is written: every existing part of it must be a
    directory, and the deepest existing one writable."""
    out = Path(path)
    try:
        existing = next(p for p in (out, *out.parents) if p.exists())
    except OSError as e:  # a name too long, a loop of links
        raise ConfigError("--out", f"cannot use {path[:80]}: {e.strerror}") from None
    if not existing.is_dir():
        raise ConfigError("--out", f"{existing} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        raise ConfigError("--out", f"cannot write in {existing}")
    return out


LOCK = ".p2pfl.lock"
RUN_FILES = frozenset(
    {"config.yaml", "summary.json", "summary.json.tmp", "metrics.csv", "comm.csv",
     "availability.csv", "partition.csv", "partition.png", "tensorboard", "peers", "plots",
     "report.html"}
)  # fmt: skip
"""What a run writes in its directory (``peers/``: a real run's nodes; ``plots/``: ``p2pfl
plot``; ``report.html``: ``p2pfl report``): ``--force`` empties a directory only if it holds
nothing else."""
ARTIFACTS = re.compile(r"[\w.-]+\.(csv|png|svg)")
"""The tables and pictures a method's ``Artifact`` writes in its run's directory."""
SWEEP_FILES = re.compile(
    r"cells\.csv|sweep\.csv|plots|report\.html|"
    r"(accuracy|accuracy-time|accuracy-bytes|traffic|availability|sweep|partition-\d+)\.(png|svg)"
)
"""What a sweep writes in its directory besides its cells' directories (``KEY=LABEL,...``)."""


def check_fresh(out: Path, force: bool, sweep: bool = False) -> None:
    """Refuse an ``--out`` that another run is writing to; one that holds anything, unless
    ``--force`` or it holds a ``sweep`` to resume; and, with ``--force``, one that holds
    anything but a p2pfl run or sweep (a directory of yours is never emptied). Writes
    nothing."""
    if not out.is_dir():
        return
    with _locked(out, create=False):
        pass
    held = sorted(p.name for p in out.iterdir() if p.name != LOCK)
    if not held or (sweep and not force and _is_sweep(out)):
        return
    shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
    if not force:
        raise ConfigError(
            "--out", f"{out} is not empty ({shown}); pass --force to replace it, or another --out"
        )
    if not (_is_run(out) or _is_sweep(out)):
        raise ConfigError(
            "--out",
            f"{out} holds no p2pfl run, or files p2pfl did not write beside it ({shown}); "
            "--force only replaces a p2pfl run or sweep",
        )


def _is_run(path: Path) -> bool:
    """Whether ``path`` holds a p2pfl run and nothing else: a run's files, among them the
    ``config.yaml`` of an experiment (a file of that name alone is not enough), and tables
    and pictures beside them (a method's artifacts, such as FedELMY's ``pool_distances``)."""
    from p2pfl.core.yaml_io import read_yaml

    entries = [p for p in path.iterdir() if p.name != LOCK]
    if "config.yaml" not in {p.name for p in entries} or not all(map(_run_file, entries)):
        return False
    try:
        return {"seed", "topology", "peers", "algorithm"} <= read_yaml(path / "config.yaml").keys()
    except ConfigError:
        return False


def _run_file(path: Path) -> bool:
    """Whether ``path``, in a run's directory, is one that a run writes (:data:`RUN_FILES`,
    or a method's table or picture)."""
    return path.name in RUN_FILES or bool(ARTIFACTS.fullmatch(path.name) and path.is_file())


def _is_sweep(path: Path) -> bool:
    """Whether ``path`` holds a p2pfl sweep and nothing else: its tables and figures, and
    cell directories, each a run (or empty: a cell stopped before it wrote); at least one
    cell or a ``cells.csv`` with a sweep's header (every cell skipped)."""
    held = [p for p in path.iterdir() if p.name != LOCK]
    cells = [p for p in held if "=" in p.name and p.is_dir() and not p.is_symlink()]
    return (
        (bool(cells) or _is_cells_table(path / "cells.csv"))
        and all(_is_run(p) or not any(p.iterdir()) for p in cells)
        and all(p in cells or SWEEP_FILES.fullmatch(p.name) for p in held)
    )


def _is_cells_table(path: Path) -> bool:
    """Whether ``path`` is a sweep's ``cells.csv``: its header holds the cell columns."""
    from p2pfl.app.sweep import CELL_COLUMNS  # imported already by the commands that ask

    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f",{','.join(CELL_COLUMNS[:3])}," in f.readline(4096)
    except OSError:
        return False


@contextmanager
def _locked(out: Path, create: bool = True) -> Iterator[None]:
    """Hold ``out``'s run lock (``ConfigError`` if another process holds it)."""
    path = out / LOCK
    if not create and not path.exists():
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError("--out", f"{out} is in use by another p2pfl run") from None
        try:
            yield
        finally:
            if create:
                path.unlink(missing_ok=True)
    finally:
        os.close(fd)


@contextmanager
def _claimed(out: Path, force: bool) -> Iterator[None]:
    """``out`` locked for this run (and emptied first with ``--force``)."""
    from p2pfl.app.experiment import empty

    with _locked(out):
        if force:
            empty(out, keep=(LOCK,))
        yield


def cmd_run(args: argparse.Namespace) -> int:
    world, rank = _world()
    if world > 1 and rank > 0:
        return _helper_rank(args)
    from p2pfl.runtime.children import STANDBY, Standby

    with suppress(OSError):  # no fork here: the figure is forked when it is drawn, as before
        STANDBY["figure"] = Standby(_prepare_figure, "p2pfl-figure")
    try:
        done = execute(args)
    finally:
        if (ahead := STANDBY.pop("figure", None)) is not None:  # not needed after all
            ahead.dismiss()
    if done.summary is not None:
        _say(done.summary, done.out)
    return done.code


def _prepare_figure() -> None:
    """What the child that draws a run's ``partition.png`` does while this process imports
    torch and builds the run (on another core, before it has the counts to draw): import
    matplotlib, which would take 0.3-1 s once the run had begun."""
    from p2pfl.reporting.partition import prepare

    prepare()


@dataclasses.dataclass(frozen=True)
class Done:
    """What ``p2pfl run`` did: where it wrote, a run's summary (``None`` for a sweep), and
    the exit code."""

    out: Path
    summary: dict[str, Any] | None
    code: int


def execute(args: argparse.Namespace, sweep: bool | None = None) -> Done:
    """``p2pfl run`` (this process alone, or rank 0): one experiment or a sweep, checked
    before anything is written. The command line and :func:`p2pfl.app.library.run` both run
    this. ``sweep``: refuse an experiment that is not (``True``) or is (``False``) a sweep."""
    with _fork_safe(args.workers) as threads:  # first: it must see whether torch is imported
        from p2pfl.app.experiment import run
        from p2pfl.app.sweep import load, run_sweep

        raw, grid = load(args.experiment, args.sets, args.seed, args.given)
        if sweep is not None and sweep != bool(grid):
            use = "p2pfl.sweep" if grid else "p2pfl.run, or add a sweep: section"
            raise ConfigError(
                "sweep", f"this is {'' if grid else 'not '}a sweep: use {use}", args.experiment
            )
        spread = _check_workers(args, bool(grid))
        shard = _shard(args)
        if shard and not spread:
            why = "a sweep's --workers runs cells side by side" if grid else "add --workers N"
            raise ConfigError(f"--{shard}", f"shards one experiment over ranks: {why}")
        if grid:
            out = output_dir(args.out or f"runs/{raw.get('name', Path(args.experiment).stem)}")
            check_fresh(out, args.force, sweep=True)
            file = Path(args.experiment)
            claim = lambda: _claimed(out, args.force)  # noqa: E731 - taken once every cell is checked
            code = run_sweep(
                file, raw, grid, out, not args.quiet, args.transport, claim, args.workers, threads
            )
            return Done(out, None, code)
        name = raw.get("name", Path(args.experiment).stem)
        out = output_dir(args.out or f"runs/{name}-seed{raw.get('seed', 0)}")
        check_fresh(out, args.force)
        setup = _setup(args, args.transport)
        if spread:
            _check_spread(setup, max(args.workers, _world()[0]), shard)
        elif args.transport == "sim":
            _check_memory(setup, 1)
        else:
            _check_nodes(setup, setup.topology.graph.number_of_nodes())
        with _ranks(args.workers, threads, setup, shard) as ranks, _claimed(out, args.force):
            summary = run(setup, out, not args.quiet, args.transport, ranks)
    return Done(out, summary, 0)


def _say(summary: dict, out: Path) -> None:
    """The one line a finished run prints."""
    comm = summary["comm"]
    print(
        f"{summary['experiment']}: {summary['algorithm']} on {summary['num_peers']} peers "
        f"({summary['topology']}), final accuracy {summary['final']['accuracy']:.4f}, "
        f"{comm['total_bytes']:,} bytes in {comm['messages']} messages, "
        f"simulated {summary['sim_time_s']:.2f} s, wall {summary['wall_time_s']:.1f} s -> {out}"
    )


def cmd_merge(args: argparse.Namespace) -> int:
    """A real run's nodes ran on several hosts (``p2pfl peer``) and their ``peers/NAME/``
    directories were copied into RUN_DIR: write the outputs a launcher run has."""
    from p2pfl.app.config import resolve
    from p2pfl.app.experiment import build, run
    from p2pfl.core.yaml_io import read_yaml
    from p2pfl.runtime.launcher import read_nodes

    out = output_dir(args.run)
    peers = out / "peers"
    configs = sorted(peers.glob("*/config.yaml")) if peers.is_dir() else []
    if not configs:
        raise ConfigError(
            "RUN_DIR", f"no peers/NAME/config.yaml in {out}: copy every node's peers/NAME/ there"
        )
    config = read_yaml(configs[0], "node configuration")
    for other in configs[1:]:
        if read_yaml(other, "node configuration") != config:
            first, second = configs[0].parent.name, other.parent.name
            raise ConfigError("RUN_DIR", f"nodes {first} and {second} ran different experiments")
    try:
        setup = build(resolve(config, configs[0]), "sim")  # CURVE keys stay on their hosts
    except ConfigError as e:
        e.file = e.file or str(configs[0])
        raise
    names = [setup.topology.name(n) for n in sorted(setup.topology.graph.nodes)]
    missing = [n for n in names if not (peers / n / "result.json").is_file()]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ConfigError("RUN_DIR", f"no peers/NAME/result.json for node(s) {shown} in {out}")
    try:
        files = read_nodes(out, setup)
    except RunError as e:
        raise ConfigError("RUN_DIR", str(e)) from None
    held = sorted(out.iterdir())
    foreign = [p.name for p in held if p.name not in (LOCK, "peers") and not _run_file(p)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ConfigError(
            "RUN_DIR", f"{out} holds files p2pfl did not write beside peers/ ({shown}); "
            "move them out: merge never deletes them",
        )  # fmt: skip
    merged = [p.name for p in held if p.name not in (LOCK, "peers")]
    if merged and not args.force:
        raise ConfigError(
            "RUN_DIR", f"{out} already holds {merged[0]}; pass --force to merge it again"
        )
    from p2pfl.app.experiment import empty

    with _locked(out):
        empty(out, keep=(LOCK, "peers"))
        summary = run(setup, out, transport="zmq", gathered=files)
    _say(summary, out)
    return 0


MAX_WORKERS = 1024
"""The most ranks one run may have (``--workers``, torchrun's ``WORLD_SIZE``)."""
RANKS_PER_CORE = 4
"""``--workers`` at most per usable core: more only share the cores (no faster), each
costing a process's memory; 4 lets a laptop check results on several ranks."""
RANK_MEMORY = 64 << 20
"""The least memory a forked rank (or sweep cell) takes of its own: the quick-start's rank
takes 25 MB; a larger model or data takes more (a floor that stops the absurd, not a promise)."""


def _world() -> tuple[int, int]:
    """``(WORLD_SIZE, RANK)`` as ``torchrun`` sets them, checked (a rank that cannot exist
    would wait for the others for ever); ``(1, 0)`` for one process."""
    env = os.environ
    try:
        world, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    except ValueError:
        shown = ", ".join(f"{k}={env.get(k, '')[:24]!r}" for k in ("WORLD_SIZE", "RANK"))
        raise ConfigError(
            "WORLD_SIZE, RANK", f"must be integers (torchrun sets them), got {shown}"
        ) from None
    if not 1 <= world <= MAX_WORKERS:
        raise ConfigError("WORLD_SIZE", f"must be in 1..{MAX_WORKERS}, got {_shown(world)}")
    if not 0 <= rank < world:
        raise ConfigError(
            "RANK", f"must be in 0..{world - 1} (WORLD_SIZE={world}), got {_shown(rank)}"
        )
    return world, rank


def _check_rendezvous(world: int) -> None:
    """The rest of torchrun's variables, where a rank is about to join ``world`` ranks."""
    if not os.environ.get("MASTER_ADDR"):
        raise ConfigError(
            "MASTER_ADDR", "is not set: the address of rank 0's host (torchrun sets it)"
        )
    _env_int("MASTER_PORT", 1, 65_535)
    local_world = _env_int("LOCAL_WORLD_SIZE", 1, world, default=world)
    _env_int("LOCAL_RANK", 0, local_world - 1, default=0)


def _env_int(name: str, low: int, high: int, default: int | None = None) -> int:
    """The environment variable ``name``, an integer in ``low..high`` (or ``default`` where
    it is unset; required where there is none)."""
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    try:
        value = int(text or "")
    except ValueError:
        raise ConfigError(
            name, f"must be an integer in {low}..{high}, got {str(text)[:24]!r}"
        ) from None
    if not low <= value <= high:
        raise ConfigError(name, f"must be in {low}..{high}, got {_shown(value)}")
    return value


def _shown(n: int) -> str:
    """An integer for an error line, cut short if it is huge."""
    text = str(n)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"


def _check_workers(args: argparse.Namespace, sweep: bool) -> bool:
    """Whether this run is spread over ranks (``--workers``, or started by ``torchrun``);
    a sweep's ``--workers`` runs that many of its cells at a time instead. Either way
    ``--workers`` processes must fit this host's cores and memory."""
    if not 1 <= args.workers <= MAX_WORKERS:
        raise ConfigError("--workers", f"must be in 1..{MAX_WORKERS}, got {args.workers}")
    world = _world()[0]
    under_torchrun = world > 1
    if args.workers > 1 and under_torchrun:
        raise ConfigError("--workers", "torchrun already starts the ranks; leave --workers out")
    if under_torchrun and sweep:
        raise ConfigError("torchrun", "spreads one experiment, not a sweep: use --workers")
    spread = args.workers > 1 or under_torchrun
    if spread and args.transport != "sim":
        raise ConfigError("--workers", "spreads a simulation (--transport sim)")
    if args.workers > 1:
        _check_host(args.workers)
    if spread and not sweep:  # checked before anything is loaded
        from p2pfl.runtime.children import join_timeout

        if under_torchrun:
            _check_rendezvous(world)
        join_timeout()
    return spread and not sweep


def _check_host(workers: int) -> None:
    """``--workers`` processes that this host's cores and free memory can run."""
    from p2pfl.runtime.children import available_memory, usable_cores

    cores = usable_cores()
    if workers > RANKS_PER_CORE * cores:
        raise ConfigError(
            "--workers",
            f"{workers} processes on {cores} usable core(s): at most {RANKS_PER_CORE * cores} "
            f"({RANKS_PER_CORE} per core; more only share the cores)",
        )
    free = available_memory()
    if free is not None and workers * RANK_MEMORY > free:
        raise ConfigError(
            "--workers",
            f"{workers} processes need at least {workers * RANK_MEMORY >> 20:,} MiB "
            f"({RANK_MEMORY >> 20} MiB each); {free >> 20:,} MiB are free: at most "
            f"{max(1, free // RANK_MEMORY)}",
        )


def _shard(args: argparse.Namespace) -> str | None:
    """How the ranks share the population: ``shard-events`` (``--shard-events``),
    ``shard`` (``--shard``: the models only), or ``None``."""
    return "shard-events" if args.shard_events else "shard" if args.shard else None


def _check_spread(setup: Setup, ranks: int, shard: str | None = None) -> None:
    """A run spread over ``ranks`` needs simulated compute times that every rank agrees on,
    and a peer for each rank to train (a rank beyond them would only cost memory). A
    sharded one (``shard``) also needs every model it reads on the rank that reads it, and
    each rank's share of the models within this host's free memory."""
    if setup.population.compute != "model":  # wall-clock compute differs by rank
        raise ConfigError("--workers", "needs peers.compute: model")
    peers = setup.topology.num_peers
    if ranks > peers:
        key = "--workers" if _world()[0] == 1 else "WORLD_SIZE"
        raise ConfigError(key, f"{ranks} ranks for {peers} peers: at most one rank per peer")
    if not shard:
        _check_memory(setup, ranks)
        return
    every = {  # the run's model every so often (--shard-events: a collective at each probe)
        "eval.every_s": setup.eval.every_s is not None and shard == "shard",
        "eval.matching": setup.eval.matching is not None,
    }
    for key, used in every.items():
        if used:
            raise ConfigError(
                f"--{shard}", f"{key} needs every peer's model in one process: leave out --{shard}"
            )
    if shard == "shard-events":
        _check_events(setup, ranks)
    import torch

    from p2pfl.learning import batched
    from p2pfl.learning.training import resolve_device

    device = resolve_device(setup.population.profiles[0].device)
    cpu_module = setup.trainer.module(torch.device("cpu"))  # CUDA stays untouched (forks)
    if setup.population.batched and not batched.divisible(cpu_module, setup.train, device):
        raise ConfigError(
            f"--{shard}",
            f"peers.batched on {device.type}: a batched group trains to bits that depend on "
            f"the whole group, whose peers the ranks split; leave out peers.batched or --{shard}",
        )

    _check_memory(setup, ranks, shard)


def _check_events(setup: Setup, ranks: int) -> None:
    """``--shard-events``: the ranks need a lookahead, a latency on every link between two
    ranks' peers (:func:`p2pfl.runtime.windows.lookahead`)."""
    from p2pfl.runtime.ranks import Ranks
    from p2pfl.runtime.windows import lookahead

    lookahead(setup.topology, Ranks(0, ranks), setup.network)


def _check_memory(setup: Setup, ranks: int, shard: str | None = None) -> None:
    """Each simulating process on this host holds its peers' models (sharded, ``shard``
    naming the flag: its share of them; else all), up to :data:`SHARD_MODELS` per peer at
    once: a population that this host's free memory cannot hold is refused before anything
    is written, not killed by the kernel halfway."""
    from p2pfl.learning.state import state_bytes
    from p2pfl.runtime.children import available_memory

    free = available_memory()
    if free is None:
        return
    peers = setup.topology.num_peers
    share = -(-peers // ranks) if shard else peers  # the largest share: ceil(peers / ranks)
    need = SHARD_MODELS * share * state_bytes(setup.init_state())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    if need * local <= free:
        return
    if shard:
        raise ConfigError(
            f"--{shard}",
            f"each of {local} rank(s) on this host holds up to {share:,} peers' models, about "
            f"{need / 2**30:.2f} GiB at {SHARD_MODELS} models per peer; {free / 2**30:.2f} GiB "
            "are free: use more ranks or hosts, or fewer peers",
        )
    each = f"each of {local} processes" if local > 1 else "this run"
    raise ConfigError(
        "peers.count",
        f"{each} holds {peers:,} peers' models, about {need / 2**30:.2f} GiB at "
        f"{SHARD_MODELS} models per peer; {free / 2**30:.2f} GiB are free: shard them over "
        "ranks (--workers N --shard-events, or torchrun on several hosts) or use fewer peers",
    )


def _check_nodes(setup: Setup, nodes: int) -> None:
    """``nodes`` processes of a real run on this host (``--transport zmq``, ``p2pfl peer``),
    each about :data:`NODE_MEMORY` and :data:`SHARD_MODELS` models of its own: more than
    the free memory holds is refused before any is forked, not killed by the kernel."""
    from p2pfl.learning.state import state_bytes
    from p2pfl.runtime.children import available_memory

    free = available_memory()
    if free is None:
        return
    need = nodes * (NODE_MEMORY + SHARD_MODELS * state_bytes(setup.init_state()))
    if need <= free:
        return
    raise ConfigError(
        "peers.count",
        f"{nodes:,} node processes on this host need about {need / 2**30:.2f} GiB "
        f"({NODE_MEMORY >> 20} MiB and {SHARD_MODELS} models each); {free / 2**30:.2f} GiB are "
        "free: spread the nodes over hosts (p2pfl peer --peer A-B) or simulate them",
    )


NODE_MEMORY = 8 << 20
"""Private memory of a forked node besides its models (benchmarks/peers_per_host.py: 8.0-8.1
MiB the median at 200-1,000 nodes; docs/performance.md)."""


SHARD_MODELS = 3
"""Models a simulating process may hold per peer at once, for the memory check before a
run: the peer's own, a message's and a training's (``benchmarks/population.py``, under the
command's :data:`ALLOCATOR`: 1.4 × the states above the process at the peak of 10⁴
DFedAvgM peers, 1.8 × for 10⁵ gossip peers, whose states are small beside their data and
objects; docs/performance.md)."""


NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


@contextmanager
def _fork_safe(workers: int) -> Iterator[int]:
    """While a command builds its run, keep this process fit to fork ranks (``--workers N``)
    or nodes (``--transport zmq``, ``p2pfl peer``) from, and give each rank's thread count.
    CUDA, once initialized, does not survive a fork: its availability is asked of NVML,
    which torch offers for this. GNU OpenMP's thread pool does not survive one either (a
    child that computes on several threads hangs), so with ``--workers`` this process
    computes on one thread until the fork, and one that had already imported torch (a test,
    a notebook: it may have used several) runs every rank on one thread (ranks on different
    thread counts would not give one process's answer)."""
    from p2pfl.runtime.children import rank_threads

    fresh = "torch" not in sys.modules
    import torch

    threads, nvml = torch.get_num_threads(), os.environ.get(NVML_CHECK)
    if workers > 1:
        torch.set_num_threads(1)
    os.environ[NVML_CHECK] = "1"
    try:
        yield 0 if workers <= 1 else rank_threads(workers) if fresh else 1
    finally:
        torch.set_num_threads(threads)
        if nvml is None:
            os.environ.pop(NVML_CHECK)
        else:
            os.environ[NVML_CHECK] = nvml


@contextmanager
def _ranks(
    workers: int, threads: int, setup: Setup, shard: str | None = None
) -> Iterator[Ranks | None]:
    """This process's place among the ranks: alone (``None``); a rank that ``torchrun``
    started; or rank 0 of ``--workers N``, which forks the other ranks from the built run
    (they share its torch and data copy-on-write, and start at once), waits for them at the
    end and stops them on error."""
    from p2pfl.runtime.ranks import Ranks

    ranks: Ranks | None = None
    workers_: Workers | None = None
    try:
        if _world()[0] > 1:
            ranks = Ranks.from_env(shard=shard)
        elif workers > 1:
            from p2pfl.runtime.children import Workers, free_port

            setup.check_forkable("ranks of --workers")
            env = {"WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1"}
            env["MASTER_PORT"] = str(free_port())
            workers_ = Workers(
                workers, lambda r, scratch: _forked_rank(setup, env, r, scratch, threads, shard)
            )
            ranks = Ranks.from_env(env | {"RANK": "0"}, threads, shard)  # as many as the others
            ranks = dataclasses.replace(ranks, death=workers_.died) if ranks else None
        yield ranks
        if workers_ is not None:
            workers_.join()
    except RunError:  # a rank that died: rank 0's run ended by it, or by its next exchange
        if workers_ is not None and (death := workers_.died(within=1.0)):
            raise RunError(death) from None
        raise
    finally:
        if workers_ is not None:
            workers_.stop()
        if ranks is not None:
            ranks.close()


def _forked_rank(
    setup: Setup,
    env: dict[str, str],
    rank: int,
    scratch: Path,
    threads: int,
    shard: str | None = None,
) -> int:
    """A rank above 0 of ``--workers``, forked from rank 0's built run: train its share,
    keep nothing (rank 0 writes the run; ``scratch``, which rank 0 removes, takes what this
    rank throws away). Ctrl-C is rank 0's to handle: it stops the ranks."""
    from p2pfl.runtime.ranks import Ranks

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _rank_run(setup, Ranks.from_env(env | {"RANK": str(rank)}, threads, shard), scratch)
    return 0


def _helper_rank(args: argparse.Namespace) -> int:
    """A rank above 0 that ``torchrun`` started: build the same run, train its share,
    write nothing (rank 0 does)."""
    from p2pfl.app.sweep import load
    from p2pfl.runtime.ranks import Ranks

    _check_workers(args, bool(load(args.experiment, args.sets, args.seed, args.given)[1]))
    setup = _setup(args, "sim")
    _check_spread(setup, _world()[0], _shard(args))
    _rank_run(setup, Ranks.from_env(shard=_shard(args)))
    return 0


def _rank_run(setup: Setup, ranks: Ranks | None, scratch: Path | None = None) -> None:
    """Run the simulation as a rank above 0: its outputs go to a directory thrown away
    (``scratch``, which rank 0 removes; else one of its own, removed as it ends). A rank
    that fails keeps its connections until it exits, after telling rank 0 why: the other
    ranks then fail after it, and rank 0 names its failure, not theirs."""
    import tempfile

    from p2pfl.app.experiment import run

    if scratch is not None:
        run(setup, scratch, False, "sim", ranks)
    else:
        with tempfile.TemporaryDirectory(prefix="p2pfl-rank") as tmp:
            run(setup, Path(tmp), False, "sim", ranks)
    if ranks is not None:
        ranks.close()


def cmd_peer(args: argparse.Namespace) -> int:
    with _fork_safe(1):
        return _peer(args)


def _peer(args: argparse.Namespace) -> int:
    from p2pfl.runtime import launcher
    from p2pfl.runtime.sockets import check_curve_keys

    start_at = None if args.start_at is None else _start_at(args.start_at)
    setup = _setup(args)
    nodes = launcher.node_ids(setup, args.peer)
    addresses = launcher.read_addresses(Path(args.addresses), setup)
    transport = setup.transport
    try:
        check_curve_keys(transport, setup.topology, nodes)
    except ConfigError as e:
        e.file = e.file or args.experiment
        raise
    _check_nodes(setup, len(nodes))
    out = output_dir(args.out)
    with launcher.claimed(setup, nodes, out):
        if len(nodes) == 1:
            return launcher.run_peer(setup, nodes[0], out, addresses, start_at=start_at)
        procs = launcher.fork_nodes(setup, nodes, out, addresses, start_at=start_at)
        return launcher.wait_nodes(procs, setup, out)


MAX_START_WAIT_S = 86_400.0
"""How far ahead ``--start-at`` may lie (a day): further is a typo (milliseconds, a year)."""


def _start_at(text: str) -> float:
    """``--start-at``: Unix seconds, or an ISO 8601 time with its zone; in the next day."""
    when = None
    try:
        at = float(text)
    except ValueError:
        with suppress(ValueError):
            when = datetime.datetime.fromisoformat(text)
        if when is None:
            raise ConfigError(
                "--start-at", f"{text!r} is neither Unix seconds nor an ISO 8601 time"
            ) from None
        if when.tzinfo is None:
            raise ConfigError("--start-at", f"{text!r} has no time zone: add Z or +HH:MM") from None
        at = when.timestamp()
    if not math.isfinite(at):
        raise ConfigError("--start-at", f"{text!r} is not a time")
    ahead = at - time.time()
    if not 0 < ahead <= MAX_START_WAIT_S:
        when_s = "passed" if ahead <= 0 else "more than a day ahead"
        raise ConfigError(
            "--start-at", f"{text} is {when_s} ({ahead:+.0f} s): give a time in the next 24 h"
        )
    return at


def cmd_keys(args: argparse.Namespace) -> int:
    import zmq.auth

    from p2pfl.network.peers import MAX_PEERS

    if not 1 <= args.peers <= MAX_PEERS:
        raise ConfigError("--peers", f"must be in 1..{MAX_PEERS:,}, got {args.peers}")
    directory = output_dir(args.directory)
    names = [str(i) for i in range(args.peers)] + (["server"] if args.server else [])
    taken = (f"{n}{ext}" for n in names for ext in (".key", ".key_secret"))
    if held := next((f for f in taken if (directory / f).exists()), None):
        raise ConfigError(
            "DIRECTORY",
            f"{directory} already holds {held}: new keys would not match the copies other "
            "hosts have; remove the old ones or choose another directory",
        )
    directory.mkdir(parents=True, exist_ok=True)
    mask = os.umask(0o077)  # secret keys are born private (0600), never world-readable
    try:
        for name in names:
            public, secret = zmq.auth.create_certificates(directory, name)
            os.chmod(public, 0o644)  # public keys are meant to be shared
            os.chmod(secret, 0o600)
    finally:
        os.umask(mask)
    print(f"{len(names)} CURVE key pairs in {directory}; keep the .key_secret files private")
    return 0


def cmd_cost(args: argparse.Namespace) -> int:
    from p2pfl.app import cost

    setup, rows, out = cost_table(args)
    print(cost.sizes_line(setup, args.model_bytes))
    print(cost.format_table(rows))
    print(f"wrote {out / 'cost.csv'}, cost.png and cost.svg")
    return 0


def cost_table(args: argparse.Namespace) -> tuple[Setup, list[dict[str, Any]], Path]:
    """``p2pfl cost``'s work: the built experiment, the table's rows and the directory
    where ``cost.csv`` and its chart were written (the command line and
    :func:`p2pfl.app.library.cost` both run this)."""
    from p2pfl.app import cost
    from p2pfl.reporting import plots

    if args.peers is not None:
        args.sets.append(f"peers.count={args.peers}")
    if args.model_bytes is not None and args.model_bytes <= 0:
        raise ConfigError("--model-bytes", "must be > 0")
    kinds = [k.strip() for k in args.topologies.split(",") if k.strip()]
    if not kinds:
        raise ConfigError("--topologies", f"no topology kind in {args.topologies!r}")
    setup = _setup(args)
    out = output_dir(args.out or f"runs/{setup.config['name']}-cost")
    methods = cost.parse_methods(args.methods or setup.config["algorithm"]["name"])
    rows = cost.analyse(setup, methods, kinds, args.model_bytes)
    out.mkdir(parents=True, exist_ok=True)
    cost.write_csv(rows, out / "cost.csv")
    plots.cost_chart(rows, out)
    return setup, rows, out


def cmd_plot(args: argparse.Namespace) -> int:
    from p2pfl.reporting.plots import plot_progress, plot_runs

    paths = [Path(r) for r in args.runs]
    out = output_dir(args.out or str(paths[0] / "plots"))
    written = plot_progress(paths, out, args.x) if args.x else plot_runs(paths, out)
    print(f"wrote {len(written)} files: {', '.join(str(p) for p in written)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from p2pfl.reporting.report import default_path, write_report

    paths = [Path(r) for r in args.runs]
    out = default_path(paths, Path(args.out) if args.out else None)
    output_dir(str(out.parent))
    command = shlex.join(
        ["p2pfl", "report", *args.runs, *(["--out", args.out] if args.out else [])]
    )
    print(f"wrote {write_report(paths, out, command)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument already reported in one line
        return int(e.code or 0)
    from p2pfl.runtime.children import interrupts_kept

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        commands = {
            "run": cmd_run, "peer": cmd_peer, "keys": cmd_keys, "cost": cmd_cost, "plot": cmd_plot,
            "merge": cmd_merge, "report": cmd_report,
        }  # fmt: skip
        with interrupts_kept():
            return commands[args.command](args)
    except ConfigError as e:
        _error(str(e))
        return 2
    except RunError as e:
        _error(str(e))
        return 1
    except KeyboardInterrupt as e:
        _error(f"interrupted ({str(e) or 'SIGINT'})")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


ALLOCATOR = "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"
"""glibc's allocator settings (``GLIBC_TUNABLES``) a ``p2pfl`` command runs under. torch
allocates with ``posix_memalign`` (64-byte alignment), which in glibc 2.36 takes 96 bytes
more than it keeps and frees the rest as a small chunk; the thread cache and the fast bins
hand those chunks to small allocations at once, so a freed model's block stays exactly one
model long, 96 bytes short of the next model's request, and the heap grows instead of
reusing it. Without both caches the small chunk merges back into its block when the model
is freed: 10,000 DFedAvgM peers peak at 3.44 GiB instead of 4.2-4.6, in the same time and
with the same bits (docs/performance.md, "What the heap holds")."""


def on_glibc() -> bool:
    """Whether this interpreter runs on glibc, whose tunables :data:`ALLOCATOR` sets."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # no such name here (not glibc)
        return False


def _with_allocator() -> None:
    """Run this command again, in this process, with :data:`ALLOCATOR` (glibc reads its
    tunables only when a program starts). Not where the user set ``GLIBC_TUNABLES``
    (even empty: theirs is kept) nor without glibc."""
    if "GLIBC_TUNABLES" in os.environ or not sys.executable or not on_glibc():
        return
    with suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
        env = os.environ | {"GLIBC_TUNABLES": ALLOCATOR}
        os.execve(sys.executable, sys.orig_argv, env)


def program() -> NoReturn:
    """The ``p2pfl`` program: :func:`main`, then exit. It first starts again under
    :data:`ALLOCATOR` (:func:`_with_allocator`). Everything left is frozen out of the
    cyclic collector first (every output is closed by now): the interpreter's last full
    collection would walk every object torch made, about 0.8 s of each command. Then,
    unless a thread other than daemons is still running, the process ends at once
    (:func:`os._exit`) after the exit handlers and a flush of its output: the
    interpreter's teardown (every module emptied, torch's C++ destructors) took another
    0.1-0.2 s after the last output was written. Output that cannot be flushed (a closed
    pipe) leaves by the usual exit, which reports it; so does a command run under a
    profiler or tracer (``python -m cProfile -m p2pfl``: it writes its figures after the
    program returns)."""
    _with_allocator()
    code = main()
    gc.freeze()
    main_thread = threading.main_thread()
    running = [t for t in threading.enumerate() if t is not main_thread and not t.daemon]
    if any(t.is_alive() for t in running) or sys.getprofile() or sys.gettrace():
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(code)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        code = 120  # what the interpreter's own exit gives when it cannot flush
    os._exit(code)


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM ends a command as Ctrl-C does (outputs closed, children stopped)."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    sys.exit(main())
