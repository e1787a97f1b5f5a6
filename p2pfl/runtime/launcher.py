"""Real runs: one OS process per node, talking over ZeroMQ (see :mod:`p2pfl.runtime.sockets`).

``launch`` (behind ``p2pfl run --transport zmq``) forks one process per node on this host
from the launcher, which has built the run (torch imported, data loaded, the optimizer's
lazy imports paid): the nodes share those pages copy-on-write (:class:`Forked`). Each binds
its inbox on a free loopback port and says hello to the launcher with the port it got; when
all have, the launcher sends everyone the address table and the common start time. Each
peer writes its own ``peers/NAME/`` files as it goes (metrics, comm, ``result.json``,
``final.bin``), so a dead peer loses nothing already written. The launcher watches the
processes: one that dies, or reports a failure, ends the run at once (the others are
stopped) with a report naming it. Ctrl-C stops every peer process.

``run_peer`` is one node's side, used by the launcher's children and by multi-host runs
(``p2pfl peer EXP --peer 0-49 --addresses FILE``: there too, one forked process per node).
"""

from __future__ import annotations

import csv
import fcntl
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Set
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
import zmq

from p2pfl.core.errors import ConfigError, RunError
from p2pfl.core.json_io import write_json
from p2pfl.core.yaml_io import read_yaml
from p2pfl.learning.state import State
from p2pfl.learning.training import optimizer
from p2pfl.methods.effects import Finish
from p2pfl.network.ledger import Ledger
from p2pfl.network.message import Message
from p2pfl.network.wire import WireError, decode, encode
from p2pfl.reporting.reporters import CsvReporter, Reporter
from p2pfl.runtime.children import Forked, stop
from p2pfl.runtime.setup import Setup
from p2pfl.runtime.sockets import (
    Crashed,
    Schema,
    TransportConfig,
    ZmqNode,
    check_tensors,
    model_schema,
)
from p2pfl.runtime.worker import Worker


@dataclass
class Outcome:
    """What a finished real run hands back: every node's Finish and its reports."""

    finals: dict[int, Finish]
    baselines: dict[str, float]
    elapsed_s: float
    comm: dict[str, Any]
    startup_s: float | None = None  # from launch until every node was up (a launcher's run)
    start_spread_s: float | None = None  # latest node's first step - earliest (p2pfl merge)


@dataclass
class NodeFiles:
    """What a real run's nodes wrote in their ``peers/NAME/`` directories, read and checked
    once: each node's ``result.json`` (a node killed by its crash wrote none), its final
    model (``final.bin``, checked against the model's schema) and its metric and comm rows."""

    results: dict[int, dict[str, Any]]
    rows: dict[int, tuple[list[tuple], list[tuple]]]
    finals: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


def node_id(setup: Setup, name: str, key: str = "--peer") -> int:
    """``"server"`` or a peer number -> the node id; a clear error (naming ``key``) otherwise."""
    topo = setup.topology
    if name == "server" and topo.server is not None:
        return topo.server
    if name.isdigit() and int(name) < topo.num_peers:
        return int(name)
    names = ", ".join(topo.name(n) for n in sorted(topo.graph.nodes))
    raise ConfigError(key, f"no node {name!r} in this topology; nodes are: {names}")


def node_ids(setup: Setup, spec: str) -> list[int]:
    """``--peer``: node names and ranges, e.g. ``server,0-49`` -> node ids, each once."""
    nodes: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if dash and first.isdigit() and last.isdigit():
            lo, hi = node_id(setup, first), node_id(setup, last)
            if lo > hi:
                raise ConfigError("--peer", f"empty range {part.strip()!r}")
            nodes += range(lo, hi + 1)
        else:
            nodes.append(node_id(setup, part.strip()))
    if len(set(nodes)) != len(nodes):
        raise ConfigError("--peer", f"a node is named twice in {spec!r}")
    return nodes


def read_addresses(path: Path, setup: Setup) -> dict[int, str]:
    """An addresses file: a YAML mapping from node names to ``tcp://host:port``."""
    table = read_yaml(path, "addresses file")
    out: dict[int, str] = {}
    owner: dict[str, int] = {}  # each address's node
    for name, address in table.items():
        try:
            node = node_id(setup, str(name), key=str(name))
        except ConfigError as e:
            e.file = str(path)
            raise
        if not isinstance(address, str) or not re.fullmatch(r"tcp://\S+:\d+", address):
            raise ConfigError(str(name), f"must be tcp://HOST:PORT, got {address!r}", str(path))
        port, twin = int(address.rpartition(":")[2]), owner.get(address)
        reason = (
            f"node {setup.topology.name(node)} is given twice" if node in out
            else f"the same address as node {setup.topology.name(twin)}: {address}"
            if twin is not None
            else f"port {port} is not in 1..65535" if not 1 <= port <= 65535
            else None
        )  # fmt: skip
        if reason is not None:
            raise ConfigError(str(name), reason, str(path))
        out[node], owner[address] = address, node
    missing = [setup.topology.name(n) for n in setup.topology.graph.nodes if n not in out]
    if missing:
        raise ConfigError("", f"no address for node(s) {', '.join(missing)}", file=str(path))
    return out


def run_peer(
    setup: Setup,
    node: int,
    out: Path,
    addresses: dict[int, str] | None = None,
    coordinator: str | None = None,
    start_at: float | None = None,
) -> int:
    """Run one node; write ``out/peers/NAME/``; return the process exit code. ``start_at``:
    the wall-clock time (Unix seconds) at which its clock starts, the same on every host."""
    transport = setup.transport
    name = setup.topology.name(node)
    mine = out / "peers" / name
    mine.mkdir(parents=True, exist_ok=True)
    (mine / "config.yaml").write_text(yaml.safe_dump(setup.config, sort_keys=False))  # to merge
    metrics, ledger = CsvReporter(mine), Ledger(mine / "comm.csv", setup.network is not None)
    worker = Worker(setup, metrics, out)
    zn = ZmqNode(
        node, setup.topology, worker, ledger, transport, setup.compression,
        setup.network, model_schema(setup.trainer.module(torch.device("cpu"))),
        worker.total_rounds, setup.stop,
    )  # fmt: skip
    result: dict[str, Any] = {"node": name, "status": "failed"}
    started = time.monotonic()
    try:
        warm_up(setup)
        started = time.monotonic()  # the run's start, after torch's
        if coordinator:
            addresses = _handshake(zn, coordinator, transport)
        else:
            assert addresses is not None
            zn.bind(addresses[node])
        zn.connect(addresses)
        if start_at is not None:  # every host's nodes start their clocks together
            late = time.time() - start_at
            if late > 0:  # its clock has run since then: its first step is at t = late
                sys.stderr.write(f"warning: peer {name}: ready {late:.1f} s after --start-at\n")
            time.sleep(max(0.0, -late))
            zn.t0, started, result["late_s"] = start_at, time.monotonic(), max(0.0, late)
        finish = zn.run(setup.behaviour(setup.contexts()[node]))
        if finish.state is not None:
            (mine / "final.bin").write_bytes(encode(Message("model", node, node, 0, finish.state)))
        result |= {"status": "ok", "output": finish.output, "baselines": worker.baselines}
        return 0
    except Crashed as e:  # the network's doing, not a failure
        result |= {"status": "crashed", "error": str(e), "output": False, "baselines": {}}
        return 0
    except (RunError, ConfigError, zmq.ZMQError) as e:
        result["error"] = str(e)
        sys.stderr.write(f"error: peer {name}: {e}\n")  # one write: peers share stderr
        sys.stderr.flush()
        return 1
    finally:
        result |= zn.report() | {
            "compute_wall_s": setup.trainer.busy_s,
            "elapsed_s": time.monotonic() - started, "t0": zn.t0,
        }  # fmt: skip
        write_json(mine / "result.json", result)  # whole, even if this process is killed
        metrics.close()
        ledger.close()
        zn.close(abort=result["status"] == "failed")


@contextmanager
def claimed(setup: Setup, nodes: list[int], out: Path) -> Iterator[None]:
    """Hold a lock on each node's ``out/peers/NAME/`` (forked nodes inherit it); a
    ``ConfigError`` naming a node already running there, before any file is opened."""
    with ExitStack() as stack:
        for n in nodes:
            mine = out / "peers" / setup.topology.name(n)
            mine.mkdir(parents=True, exist_ok=True)
            fd = os.open(mine, os.O_RDONLY | os.O_DIRECTORY)
            stack.callback(os.close, fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                name = setup.topology.name(n)
                raise ConfigError("--out", f"node {name} is already running in {mine}") from None
        yield


def fork_nodes(
    setup: Setup,
    nodes: list[int],
    out: Path,
    addresses: dict[int, str] | None = None,
    coordinator: str | None = None,
    start_at: float | None = None,
) -> dict[int, Forked]:
    """One process per node of ``nodes``, forked from this one (which has built ``setup``),
    each running :func:`run_peer` with one torch thread, as ``p2pfl NAME`` in ``ps``."""
    setup.check_forkable("nodes")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # set before forking: no child inherits a pool it cannot use
    procs: dict[int, Forked] = {}
    try:
        for n in nodes:
            main = partial(run_peer, setup, n, out, addresses, coordinator, start_at)
            procs[n] = Forked(main, f"p2pfl {setup.topology.name(n)}")
        return procs
    except BaseException:  # a fork that failed (a process limit) or Ctrl-C: none is left
        stop(procs.values(), STOP_GRACE_S)
        raise
    finally:
        torch.set_num_threads(threads)


def wait_nodes(procs: dict[int, Forked], setup: Setup, out: Path) -> int:
    """Wait for every forked node (``p2pfl peer`` with several); the first that fails or
    dies ends the wait at once, named (the others are stopped), as do Ctrl-C and SIGTERM."""
    try:
        _watch(procs, out, setup)
    finally:
        stop(procs.values(), STOP_GRACE_S)
    return 0


def _watch(procs: dict[int, Forked], out: Path, setup: Setup, t0: float | None = None) -> None:
    """Poll the forked nodes until every one has exited; the first that fails or dies
    raises, named (:func:`_check`). Given the run's start ``t0`` (a launcher's run, every
    node here), each node whose crash time (``network.crashes``) has come is killed, and its
    death is no failure; and the last node left running must end soon after the others
    (:func:`_late`)."""
    crashed: set[int] = set()
    left, ended_at = len(procs), None
    while running := [n for n, p in procs.items() if p.poll() is None]:
        _check(procs, out, setup, crashed)
        if t0 is not None:
            _crash(procs, setup, t0, crashed)
            if len(running) < left:
                left, ended_at = len(running), time.time() - t0
            if left == 1 and ended_at is not None:
                _late(procs, running[0], setup, t0, ended_at)
        time.sleep(0.05)
    _check(procs, out, setup, crashed)


def _late(procs: dict[int, Forked], n: int, setup: Setup, t0: float, ended_at: float) -> None:
    """Raise a ``RunError`` naming node ``n``, the one left running, if it still is
    ``transport.timeout_s`` after the others had all ended at ``ended_at`` (or after the
    network brought it back online): nothing it could wait for is left, so it is hung
    (SIGSTOP, a deadlock), and no receive times out on it where a ``network:`` section lets
    its neighbours go on."""
    timeout = setup.transport.timeout_s
    due = ended_at
    if setup.network is not None and (back := setup.network.next_online(n, ended_at)) < math.inf:
        due = back
    if time.time() - t0 <= due + timeout or procs[n].poll() is not None:
        return
    try:
        state = Path(f"/proc/{procs[n].pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        state = ""
    stopped = " (its process is stopped: SIGSTOP?)" if state in ("T", "t") else ""
    raise RunError(
        f"peer {setup.topology.name(n)} did not end within {timeout:g} s "
        f"(transport.timeout_s) of the other nodes{stopped}"
    )


STOP_GRACE_S = 1.0
"""How long a peer process has to exit after SIGTERM before it is killed."""


def warm_up(setup: Setup, forks: bool = False) -> None:
    """Pay torch's one-off costs (autograd's start, and on a GPU its optimizer's lazy imports:
    over a second, many more when every node starts at once on a few cores) before the run's
    clock starts, so that they do not eat into a method's deadlines. Touches no random
    stream. ``forks``: this process forks the nodes afterwards, so it warms up the
    optimizer on the CPU alone, for them to inherit; each node does the rest. Neither CUDA
    nor autograd's engine, once started on a host with a GPU, works in a forked child."""
    for device in setup.devices:
        if forks and device.type == "cuda":
            continue
        try:
            w = torch.zeros(1, requires_grad=True, device=device)
        except RuntimeError as e:  # CUDA's: no memory left for one more process's context
            raise RunError(f"{device}: {str(e).splitlines()[0]}") from None
        if forks:
            w.grad = torch.zeros_like(w)
        else:
            w.sum().backward()
        optimizer([w], setup.train).step()


def _handshake(zn: ZmqNode, coordinator: str, transport: TransportConfig) -> dict[int, str]:
    """Tell the launcher our endpoint; wait for the address table and the start time."""
    endpoint = zn.bind(f"tcp://{transport.host}:*")
    ctl = zn.context.socket(zmq.DEALER)
    ctl.setsockopt(zmq.LINGER, 1000)
    ctl.connect(coordinator)
    ctl.send_json({"node": zn.node, "endpoint": endpoint})
    if not ctl.poll(int(transport.startup_timeout_s * 1000)):
        raise RunError(f"no start signal within {transport.startup_timeout_s:g} s")
    start = ctl.recv_json()
    ctl.close()
    zn.t0, addresses = _start_signal(start)
    return addresses


def _start_signal(start: object) -> tuple[float, dict[int, str]]:
    """The launcher's start signal, checked: ``{"t0": time, "addresses": {node: endpoint}}``."""
    if isinstance(start, dict):
        t0, table = start.get("t0"), start.get("addresses")
        if (
            isinstance(t0, int | float)
            and not isinstance(t0, bool)
            and isinstance(table, dict)
            and all(k.isdigit() and isinstance(v, str) for k, v in table.items())
        ):
            return t0, {int(k): v for k, v in table.items()}
    raise RunError(f"malformed start signal from the launcher: {start!r:.200}")


def launch(setup: Setup, out: Path, reporters: Reporter) -> Outcome:
    """Run every node of ``setup`` as its own process on this host; merge their outputs
    (their metric rows go to ``reporters``, in time order)."""
    transport = setup.transport
    context = zmq.Context()
    ctl = context.socket(zmq.ROUTER)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.bind(f"tcp://{transport.host}:*")
    endpoint = ctl.getsockopt_string(zmq.LAST_ENDPOINT)
    nodes = sorted(setup.topology.graph.nodes)
    procs: dict[int, Forked] = {}
    start = time.monotonic()
    startup_s = None
    failed = True
    try:
        with claimed(setup, nodes, out):
            warm_up(setup, forks=True)  # once, here: every node inherits it
            procs = fork_nodes(setup, nodes, out, coordinator=endpoint)
            addresses = _gather_hellos(ctl, procs, out, setup, transport)
            startup_s = time.monotonic() - start
            t0 = time.time()
            table = {str(n): ep for n, (_, ep) in addresses.items()}
            for ident, _ in addresses.values():
                ctl.send_multipart([ident, json.dumps({"addresses": table, "t0": t0}).encode()])
            _watch(procs, out, setup, t0)
        failed = False
    finally:
        stop(procs.values(), STOP_GRACE_S)
        ctl.close()
        context.term()
        try:  # the rows written until the end, also of a run that failed
            files = read_nodes(out, setup)
            comm = _merge(out, files, setup, reporters)
        except RunError:
            if not failed:  # else the run's own error is the one to report
                raise
    return Outcome(*_collect(files), time.monotonic() - start, comm, startup_s)


def gather(setup: Setup, out: Path, files: NodeFiles, reporters: Reporter) -> Outcome:
    """The outcome of a run whose nodes ran elsewhere (``p2pfl peer`` on several hosts),
    their ``peers/NAME/`` directories copied into ``out`` and read (``files``, with every
    node's result: ``p2pfl merge`` checks that first): merged as the launcher merges its own.
    Its elapsed time is the longest node's, from start to end."""
    for n, result in files.results.items():
        if result["status"] == "failed":
            name = setup.topology.name(n)
            raise RunError(f"peer {name} failed: {result.get('error', 'no reason given')}")
    comm = _merge(out, files, setup, reporters)
    elapsed = max(float(r.get("elapsed_s", 0.0)) for r in files.results.values())
    starts = [float(r["t0"]) + r.get("late_s", 0.0) for r in files.results.values() if "t0" in r]
    spread = max(starts) - min(starts) if len(starts) == len(files.results) else None
    return Outcome(*_collect(files), elapsed, comm, start_spread_s=spread)


def _gather_hellos(ctl, procs, out: Path, setup: Setup, transport: TransportConfig):
    """Wait until every node has said hello with its endpoint (or fail naming the missing)."""
    hellos: dict[int, tuple[bytes, str]] = {}
    deadline = time.monotonic() + transport.startup_timeout_s
    while len(hellos) < len(procs):
        _check(procs, out, setup)
        if time.monotonic() > deadline:
            missing = [setup.topology.name(n) for n in procs if n not in hellos]
            raise RunError(
                f"peer(s) {', '.join(missing)} did not come up within "
                f"{transport.startup_timeout_s:g} s"
            )
        if ctl.poll(100):
            ident, payload = ctl.recv_multipart()
            hello = json.loads(payload)
            hellos[int(hello["node"])] = (ident, hello["endpoint"])
    return hellos


def _crash(procs: dict[int, Forked], setup: Setup, t0: float, crashed: set[int]) -> None:
    """Kill (SIGKILL) every node whose crash time (``network.crashes``) has come."""
    if setup.network is None:
        return
    for n, at in setup.network.crash_at.items():
        if n not in crashed and time.time() - t0 >= at:
            crashed.add(n)
            if procs[n].poll() is None:
                procs[n].kill()


def _check(
    procs: dict[int, Forked], out: Path, setup: Setup, crashed: Set[int] = frozenset()
) -> None:
    """Raise a ``RunError`` naming the first node that failed or died (not of a crash),
    and the stops that nodes took (:func:`_stops`)."""
    for n, p in procs.items():
        code = p.poll()
        if code is None or code == 0 or n in crashed:
            continue
        name = setup.topology.name(n)
        result = out / "peers" / name / "result.json"
        if code > 0 and result.is_file():
            reason = json.loads(result.read_text()).get("error", f"exit code {code}")
            raise RunError(f"peer {name} failed: {reason}{_stops(procs, out, setup)}")
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        raise RunError(f"peer {name} died ({how}){_stops(procs, out, setup)}")


def _stops(procs: dict[int, Forked], out: Path, setup: Setup) -> str:
    """The stop frames that nodes which ended took (their ``result.json``'s ``stop``), for a
    failed run's error: a stop in a peer's name ends a node the others still wait for."""
    notes = []
    for n in procs:
        name = setup.topology.name(n)
        try:
            stop = json.loads((out / "peers" / name / "result.json").read_text()).get("stop")
            notes.append(f"peer {name} stopped on a stop frame from {stop['from']} "
                         f"at round {stop['round']}")  # fmt: skip
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            continue
    return "".join(f"; {note}" for note in notes)


METRIC_ROW = (float, int, str, str, float)
COMM_ROW = (float, int, str, str, str, int, float)


def _rows(path: Path, types: tuple[type, ...]) -> list[tuple]:
    """A node's CSV file's rows (its header skipped), typed; a ``RunError`` naming the file
    and line of a row a node does not write."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        reader = csv.reader(f)
        next(reader, None)
        try:
            return [tuple(t(v) for t, v in zip(types, row, strict=True)) for row in reader]
        except (ValueError, csv.Error):
            raise RunError(f"{path}: line {reader.line_num}: not a row a node writes") from None


def read_nodes(out: Path, setup: Setup) -> NodeFiles:
    """Every node's files in ``out/peers/NAME/``, all read and checked before anything is
    written; a ``RunError`` naming the first file that is not one a node writes
    (:func:`read_result`, :func:`read_final`, :func:`_rows`)."""
    comm_row = COMM_ROW + (str,) * (setup.network is not None)
    files = NodeFiles({}, {})
    schema = model_schema(setup.trainer.module(torch.device("cpu")))
    for n in sorted(setup.topology.graph.nodes):
        mine = out / "peers" / setup.topology.name(n)
        if (mine / "result.json").is_file():
            files.results[n] = read_result(mine)
            if (mine / "final.bin").is_file():
                files.finals[n] = read_final(mine / "final.bin", schema)
        metrics, comm = _rows(mine / "metrics.csv", METRIC_ROW), _rows(mine / "comm.csv", comm_row)
        files.rows[n] = metrics, comm
    return files


def _merge(out: Path, files: NodeFiles, setup: Setup, reporters: Reporter) -> dict[str, Any]:
    """Replay the nodes' metric rows into ``reporters`` and merge their comm rows into the
    run's ``comm.csv``, ordered by time."""
    rows = files.rows.values()
    for row in sorted((r for metrics, _ in rows for r in metrics), key=lambda r: r[0]):
        reporters.log(*row)
    ledger = Ledger(out / "comm.csv", setup.network is not None)
    for row in sorted((r for _, comm in rows for r in comm), key=lambda r: r[0]):
        ledger.record(*row)
    ledger.close()
    return ledger.summary()


def read_result(mine: Path) -> dict[str, Any]:
    """A node's ``result.json`` (in its directory ``mine``); a ``RunError`` naming the file
    if it is not one a node writes."""
    path = mine / "result.json"
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"{path}: not a node's result ({e})") from None
    if not isinstance(result, dict) or result.get("status") not in ("ok", "crashed", "failed"):
        raise RunError(f"{path}: not a node's result (no status ok, crashed or failed)")
    for key in ("t0", "late_s", "elapsed_s"):
        if key in result and (type(result[key]) not in (int, float) or result[key] != result[key]):
            raise RunError(f"{path}: not a node's result ({key} is not a number)")
    finished = isinstance(result.get("output"), bool) and isinstance(result.get("baselines"), dict)
    if result["status"] != "failed" and not finished:
        raise RunError(f"{path}: not a node's result (no output or baselines)")
    return result


def read_final(path: Path, schema: Schema) -> State:
    """A node's ``final.bin``: a model frame holding exactly the model's tensors, with their
    shapes and dtypes (:func:`check_tensors`); a ``RunError`` naming the file otherwise."""
    try:
        state = decode(bytearray(path.read_bytes())).tensors
    except (OSError, WireError) as e:
        raise RunError(f"{path}: not a model frame ({e})") from None
    try:
        check_tensors("model", state, schema, stacked=False)
    except WireError as e:
        raise RunError(f"{path}: not this experiment's model ({e})") from None
    return state


def _collect(files: NodeFiles) -> tuple[dict[int, Finish], dict]:
    """Every node's final model (its ``final.bin``, read by :func:`read_nodes`) and reports;
    a node killed by its crash before it could write its result has none."""
    finals: dict[int, Finish] = {}
    baselines: dict[str, float] = {}
    for n, result in files.results.items():
        finals[n] = Finish(files.finals.get(n), result["output"])
        baselines |= result["baselines"]
    return finals, baselines
