"""The network model against real links: the same messages simulated and sent for real.

Every node runs in its own network namespace, joined to a bridge (in a namespace of its
own) by a veth pair; the node's egress is shaped with ``tc tbf`` to the link bandwidth, so
its egress is its uplink, as in the model. The shaped queue is one FIFO (``--queue fifo``,
the default) or fair among the flows with ACKs first (``--queue fair``: an HTB under the
tbf, standing in for ``fq_codel``, which this kernel lacks). Each case runs one
communication pattern twice with the same behaviour code: in p2pfl's simulation
(``SimRuntime``) and over ZeroMQ (``ZmqNode``, one process per namespace). A sender reads
the clock just before each ``Send``; the receiver's ledger gives each message's arrival
(all namespaces share the host's clock). Per message the script compares the simulated
send-to-arrival time with the measured one, and per case the simulated end with the
measured one (there is no compute).

- ``star``: the server sends a model-sized message to each peer back to back (its uplink is
  shared: contention), then every peer sends one back (parallel uplinks);
- ``ring``: every node sends one to each of its two neighbours at once.

The simulated uplink is either today's ``fifo`` (one transfer at a time, in order) or
``shared`` (the transfers under way share the uplink equally, as TCP flows do); both are
reported. Links have the model's latency 0.1 ms (this kernel has no netem: the real latency
is the veth's own, tens of microseconds). Needs root; every namespace, veth, bridge and
qdisc it makes is removed when it ends, also on Ctrl-C or SIGTERM (``--cleanup`` removes the
leftovers of a run that was killed with SIGKILL); without root, or where ``ip``/``tc`` fail,
it says so in one line and exits with status 2.

    python benchmarks/calibrate.py [--quick] [--bandwidths 1 10 100] [--sizes 1 4]
                                   [--peers 4] [--queue fifo|fair] [--tcp reno]
                                   [--figure docs/figures/calibration.png]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

from p2pfl.methods.effects import Behaviour, Finish, Now, Recv, Send, Wait  # noqa: E402
from p2pfl.network.ledger import Ledger  # noqa: E402
from p2pfl.network.topology import Topology, build_topology  # noqa: E402
from p2pfl.runtime.sim import SimRuntime  # noqa: E402
from p2pfl.runtime.sockets import TransportConfig, ZmqNode  # noqa: E402

PREFIX = "p2pcal"
SUBNET = "10.78.0"
PORT = 5600
LATENCY_S = 1e-4
MB = 1_000_000
QUEUE_BYTES = 16_000_000  # the shaped queue holds whatever TCP sends: no drops
QUEUES = ("fifo", "fair")
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    """One pattern on one bandwidth with one message size."""

    pattern: str  # star | ring
    peers: int
    mbit: float
    mbytes: float

    def topology(self) -> Topology:
        link = {"latency_s": LATENCY_S, "bandwidth_bps": self.mbit * 1e6}
        return build_topology({"kind": self.pattern, "link": link}, self.peers, 0)


def behaviour(case: Case, topo: Topology, node: int, sends: list) -> Behaviour:
    """The pattern for ``node``; every send's (src, dst, round, clock) goes to ``sends``."""
    tensors = {"w": torch.zeros(int(case.mbytes * MB) // 4)}
    yield Wait(0.0)

    def send(dst: int, rnd: int) -> Iterator:
        sends.append((node, dst, rnd, (yield Now())))
        yield Send(dst, "model", rnd, tensors)

    if case.pattern == "star" and node == topo.server:
        for peer in range(topo.num_peers):
            yield from send(peer, 0)
        yield Recv(count=topo.num_peers, round=1)
    elif case.pattern == "star":
        yield Recv(round=0)
        yield from send(topo.server, 1)  # type: ignore[arg-type]
    else:
        neighbours = topo.neighbours(node)
        for dst in neighbours:
            yield from send(dst, 0)
        yield Recv(count=len(neighbours), round=0)
    yield Finish(None)


def ledger_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def simulate(case: Case, uplink: str, tmp: Path) -> dict[tuple, tuple[float, float]]:
    """Simulated (send, arrival) per message (src, dst, round)."""
    topo = case.topology()
    path = tmp / f"sim-{uplink}.csv"
    ledger = Ledger(path)
    runtime = SimRuntime(topo, None, ledger, uplink=uplink)  # type: ignore[arg-type]
    sends: list = []
    runtime.run({n: behaviour(case, topo, n, sends) for n in topo.graph.nodes})
    ledger.close()
    name = {topo.name(n): n for n in topo.graph.nodes}
    return {
        (name[r["src"]], name[r["dst"]], int(r["round"])): (float(r["time"]), float(r["arrival"]))
        for r in ledger_rows(path)
    }


# --- the real side: namespaces, shaping, one process per node -----------------------------


class SetupError(RuntimeError):
    """An ``ip``/``tc`` command failed: the links cannot be made here."""


def sh(*cmd: str) -> None:
    """Run one ``ip``/``tc`` command; a failure is one clear line."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise SetupError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def fail(message: str) -> NoReturn:
    """End with one line on stderr and exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def cleanup(prefix: str) -> int:
    """Delete every namespace named ``prefix*`` (their veths, bridge and qdiscs go with them)."""
    gone = namespaces(prefix)
    for ns in gone:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return len(gone)


class Lab:
    """``nodes`` namespaces on a bridge, each node's egress shaped to ``mbit`` with a ``queue``
    (``fifo`` or ``fair``, see :meth:`_shape`), its TCP congestion control ``tcp``
    (``None``: the kernel's default)."""

    def __init__(
        self, nodes: int, mbit: float, tcp: str | None = None, queue: str = "fifo"
    ) -> None:
        self.prefix = f"{PREFIX}{os.getpid()}-"
        self.bridge = f"{self.prefix}br"
        self.ns = [f"{self.prefix}{i}" for i in range(nodes)]
        self.queue = queue
        try:
            self._make(nodes, mbit, tcp)
        except BaseException:
            self.close()
            raise

    def _make(self, nodes: int, mbit: float, tcp: str | None) -> None:
        sh("ip", "netns", "add", self.bridge)
        sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for i, ns in enumerate(self.ns):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            if tcp:
                sh("ip", "netns", "exec", ns, "sysctl", "-qw",
                   f"net.ipv4.tcp_congestion_control={tcp}")  # fmt: skip
            sh("ip", "-n", self.bridge, "link", "add", f"b{i}", "type", "veth", "peer", "name",
               "eth0", "netns", ns)  # fmt: skip
            sh("ip", "-n", self.bridge, "link", "set", f"b{i}", "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            self._shape(i, nodes, int(mbit * 1e6))

    def _shape(self, i: int, nodes: int, rate: int) -> None:
        """Shape node ``i``'s egress to ``rate`` bit/s with ``tbf`` over one FIFO queue; with the
        ``fair`` queue an HTB under the tbf orders the packets (its classes, at 10× the rate,
        never hold any back): TCP's small packets (ACKs) first, then one class per
        destination, a frame each in turn. That is per-flow fair queueing as ``fq_codel``,
        Linux's default qdisc, does it; this kernel has no ``fq_codel``, ``sfq`` or ``fq``."""
        tc = ("tc", "-n", self.ns[i])
        burst = max(3000, rate // 8 // 250)  # 4 ms of traffic, at least two full frames
        sh(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "tbf", "rate",
           f"{rate}bit", "burst", str(burst), "limit", str(QUEUE_BYTES))  # fmt: skip
        if self.queue == "fifo":
            return
        sh(*tc, "qdisc", "add", "dev", "eth0", "parent", "1:1", "handle", "2:", "htb", "default",
           "1")  # fmt: skip
        small_tcp = ["ip", "protocol", "6", "0xff", "match", "u16", "0x0000", "0xff80", "at", "2"]
        flows = {1: (1, None), 2: (0, small_tcp)}  # class: (priority, u32 match); 1: the rest
        for j in range(nodes):
            if j != i:
                flows[100 + j] = (1, ["ip", "dst", f"{self.address(j)}/32"])
        for minor, (prio, match) in flows.items():
            sh(*tc, "class", "add", "dev", "eth0", "parent", "2:", "classid", f"2:{minor}", "htb",
               "rate", f"{10 * rate}bit", "prio", str(prio), "quantum", "1514")  # fmt: skip
            sh(*tc, "qdisc", "add", "dev", "eth0", "parent", f"2:{minor}", "bfifo", "limit",
               str(QUEUE_BYTES))  # fmt: skip
            if match:
                sh(*tc, "filter", "add", "dev", "eth0", "parent", "2:", "protocol", "ip", "prio",
                   str(2 - prio), "u32", "match", *match, "flowid", f"2:{minor}")  # fmt: skip

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def close(self) -> None:
        cleanup(self.prefix)


def measure(
    case: Case, tmp: Path, tcp: str | None = None, queue: str = "fifo"
) -> dict[tuple, tuple[float, float]]:
    """Measured (send, arrival) per message (src, dst, round), on the run's clock."""
    topo = case.topology()
    nodes = sorted(topo.graph.nodes)
    procs: list[subprocess.Popen] = []
    lab = Lab(len(nodes), case.mbit, tcp, queue)  # removes what it made if it fails
    try:
        spec = tmp / "spec.json"
        spec.write_text(json.dumps(asdict(case)))
        go = tmp / "go"
        for n in nodes:
            cmd = ["ip", "netns", "exec", lab.ns[n], sys.executable, __file__, "--node", str(n)]
            cmd += ["--spec", str(spec), "--dir", str(tmp)]
            procs.append(subprocess.Popen(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}))
        deadline = time.monotonic() + 120
        while not all((tmp / f"ready-{n}").exists() for n in nodes):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                raise RuntimeError("a node did not come up (see its error above)")
            time.sleep(0.05)
        go.write_text(repr(time.time() + 0.5))  # every node starts its clock then
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"a node exited with code {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lab.close()
    sent = {}
    for n in nodes:
        for src, dst, rnd, t in json.loads((tmp / f"sends-{n}.json").read_text()):
            sent[(src, dst, rnd)] = t
    name = {topo.name(n): n for n in topo.graph.nodes}
    times = {}
    for n in nodes:
        for r in ledger_rows(tmp / f"comm-{n}.csv"):
            key = (name[r["src"]], name[r["dst"]], int(r["round"]))
            times[key] = (sent[key], float(r["arrival"]))
    return times


def node_main(node: int, spec: Path, out: Path) -> None:
    """One node of a measured case, inside its namespace."""
    case = Case(**json.loads(spec.read_text()))
    topo = case.topology()
    transport = TransportConfig(timeout_s=600.0, max_message_bytes=1 << 30)
    zn = ZmqNode(node, topo, None, Ledger(out / f"comm-{node}.csv"), transport)  # type: ignore[arg-type]
    zn.bind(f"tcp://{Lab.address(node)}:{PORT}")
    zn.connect({n: f"tcp://{Lab.address(n)}:{PORT}" for n in topo.graph.nodes})
    time.sleep(0.5)  # the TCP connections come up
    (out / f"ready-{node}").write_text("")
    go = out / "go"
    for _ in range(12_000):  # at most 120 s
        if go.exists() and go.read_text():
            break
        time.sleep(0.01)
    zn.t0 = float(go.read_text())
    sends: list = []
    zn.run(behaviour(case, topo, node, sends))
    (out / f"sends-{node}.json").write_text(json.dumps(sends))
    zn.ledger.close()
    zn.close()


# --- the report ---------------------------------------------------------------------------

UPLINKS = ("fifo", "shared")
COLUMNS = ["pattern", "peers", "Mbit/s", "MB", "messages", "measured median s", "measured end s"]
COLUMNS += [f"{u} {what}" for u in UPLINKS for what in ("median err", "worst err", "end err")]


def _keyed(times: dict[tuple, tuple[float, float]]) -> dict[str, list[float]]:
    return {f"{k[0]}->{k[1]} r{k[2]}": list(v) for k, v in sorted(times.items())}


def cases(args: argparse.Namespace) -> list[Case]:
    out = []
    for mbit in args.bandwidths:
        for mbytes in args.sizes:
            if mbit < 5 and mbytes > 1:  # 4 MB at 1 Mbit/s is 32 s a message: one size there
                continue
            if "star" in args.patterns:
                out.append(Case("star", args.peers, mbit, mbytes))
            if "ring" in args.patterns:
                out.append(Case("ring", args.peers + 1, mbit, mbytes))
    return out


def figure(cases: list[dict], path: Path) -> None:
    """Measured against simulated send-to-arrival time per message, FIFO and shared uplink
    side by side, coloured by bandwidth (``cases``: the results file's ``cases``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8), sharex=True, sharey=True)
    colours = {m: f"C{i}" for i, m in enumerate(sorted({c["case"]["mbit"] for c in cases}))}
    for ax, uplink in zip(axes, UPLINKS, strict=True):
        for c in cases:
            sim, real = c["simulated"][uplink], c["measured"]
            xs = [sim[k][1] - sim[k][0] for k in real]
            ys = [b - a for a, b in real.values()]
            marker = "o" if c["case"]["pattern"] == "star" else "^"
            ax.scatter(xs, ys, s=16, marker=marker, color=colours[c["case"]["mbit"]])
        ax.plot([0.05, 60], [0.05, 60], "k-", lw=0.8)
        ax.fill_between([0.05, 60], [0.0425, 51], [0.0575, 69], color="0.85", label="±15 %")
        ax.set(xscale="log", yscale="log", title=f"uplink: {uplink}",
               xlabel="simulated send→arrival s")  # fmt: skip
    axes[0].set_ylabel("measured send→arrival s (tc-shaped veths)")
    for mbit, colour in colours.items():
        axes[1].scatter([], [], color=colour, label=f"{mbit:g} Mbit/s")
    axes[1].scatter([], [], marker="o", color="0.4", label="star")
    axes[1].scatter([], [], marker="^", color="0.4", label="ring")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidths", type=float, nargs="+", default=[1, 10, 100])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4], help="MB per message")
    parser.add_argument("--peers", type=int, default=4, help="star peers (the ring has one more)")
    parser.add_argument("--quick", action="store_true", help="10 Mbit/s, 1 MB, 3 peers only")
    parser.add_argument("--patterns", nargs="+", default=["star", "ring"], choices=["star", "ring"])
    parser.add_argument("--tcp", help="TCP congestion control in the namespaces (e.g. cubic)")
    parser.add_argument(
        "--queue", choices=QUEUES, default="fifo", help="uplink queue: FIFO, or fair, ACKs first"
    )
    parser.add_argument("--figure", type=Path, default=ROOT / "docs/figures/calibration.png")
    parser.add_argument("--cleanup", action="store_true", help="remove leftovers, then exit")
    parser.add_argument("--replot", type=Path, help="draw the figure from a results file")
    parser.add_argument("--node", type=int, help=argparse.SUPPRESS)  # a node's own process
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node is not None:
        node_main(args.node, args.spec, args.dir)
        return
    if args.cleanup:
        print(f"removed {cleanup(PREFIX)} namespace(s)")
        return
    if args.replot:
        figure(json.loads(args.replot.read_text())["cases"], args.figure)
        print(f"-> {args.figure}")
        return
    if os.geteuid() != 0:
        fail("calibrate needs root (network namespaces and tc)")
    if args.quick:
        args.bandwidths, args.sizes, args.peers = [10], [1], 3
    stop: Callable = lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt(signum))  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    rows, per_case = [], []
    try:
        for case in cases(args):
            with tempfile.TemporaryDirectory(prefix="p2pcal") as tmp:
                real = measure(case, Path(tmp), args.tcp, args.queue)
                sim = {u: simulate(case, u, Path(tmp)) for u in UPLINKS}
            took = {k: b - a for k, (a, b) in real.items()}
            errors = {u: [took[k] / (s[k][1] - s[k][0]) - 1 for k in took] for u, s in sim.items()}
            end = max(b for _, b in real.values())
            row = [case.pattern, case.peers, case.mbit, case.mbytes, len(took),
                   statistics.median(took.values()), end]  # fmt: skip
            for u in UPLINKS:
                row += [statistics.median(errors[u]), max(errors[u], key=abs),
                        end / max(b for _, b in sim[u].values()) - 1]  # fmt: skip
            rows.append(row)
            per_case.append({"case": asdict(case), "measured": _keyed(real),
                             "simulated": {u: _keyed(s) for u, s in sim.items()}})  # fmt: skip
            said = (f"{c} {v:.3g}" for c, v in zip(COLUMNS[4:], row[4:], strict=True))
            print(f"{case}: " + ", ".join(said), flush=True)
    except KeyboardInterrupt:
        raise SystemExit("interrupted: every namespace removed") from None
    except SetupError as e:
        fail(str(e))
    finally:
        cleanup(f"{PREFIX}{os.getpid()}-")
    extra = {"cases": per_case, "latency_s": LATENCY_S, "queue": args.queue, "tcp": args.tcp}
    variant = [args.queue] * (args.queue != "fifo") + [args.tcp] * bool(args.tcp)
    report("_".join(["calibrate", *variant]), COLUMNS, rows, extra)  # calibrate_fair_reno.json
    if per_case:
        figure(per_case, args.figure)
        print(f"-> {args.figure}")


if __name__ == "__main__":
    main()
