"""Moving a model between two peer processes: p2pfl's ZeroMQ path against bare pyzmq.

For 1, 10 and 45 MB models the sender process times, per repeat, (a) p2pfl: encode the
state at the wire choke point and send it from a ``ZmqNode`` to a ``ZmqNode`` in the
receiver process, which decodes and checks it, then acks; (b) bare pyzmq: send the same
number of raw bytes over a PUSH socket to a PULL socket in the same receiver, which acks.
Both use loopback TCP and zero-copy sends; the median of the repeats is reported.

    python benchmarks/transport.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import report  # noqa: E402

from p2pfl.methods.effects import Recv, Send  # noqa: E402
from p2pfl.network.ledger import Ledger  # noqa: E402
from p2pfl.network.topology import build_topology  # noqa: E402
from p2pfl.runtime.sockets import (
    TransportConfig,  # noqa: E402
    ZmqNode,  # noqa: E402
)

SIZES_MB = (1, 10, 45)
TRANSPORT = TransportConfig(timeout_s=60.0, max_message_bytes=1 << 30)


def node(i: int) -> ZmqNode:
    topo = build_topology({"kind": "edges", "edges": [[0, 1]]}, 2, 0)
    return ZmqNode(i, topo, worker=None, ledger=Ledger(), transport=TRANSPORT)


def receiver(endpoints: mp.Queue, count: int) -> None:
    """Node 1: receive ``count`` p2pfl messages and ``count`` bare frames, ack each."""
    me = node(1)
    p2p_endpoint = me.bind("tcp://127.0.0.1:*")
    bare = me.context.socket(zmq.PULL)
    bare_port = bare.bind_to_random_port("tcp://127.0.0.1")
    ack = me.context.socket(zmq.PUSH)
    endpoints.put((p2p_endpoint, f"tcp://127.0.0.1:{bare_port}"))
    ack.connect(endpoints_ack := endpoints.get())
    me.connect({0: endpoints_ack})  # unused: node 1 only receives
    for r in range(count):
        me._recv(Recv(round=r))
        ack.send(b"p")
        bare.recv(copy=False)
        ack.send(b"b")
    ack.close()
    bare.close()
    me.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    endpoints: mp.Queue = ctx.Queue()
    count = len(SIZES_MB) * (args.repeats + 1)
    proc = ctx.Process(target=receiver, args=(endpoints, count))
    proc.start()
    p2p_endpoint, bare_endpoint = endpoints.get(timeout=120)
    me = node(0)
    acks = me.context.socket(zmq.PULL)
    endpoints.put(f"tcp://127.0.0.1:{acks.bind_to_random_port('tcp://127.0.0.1')}")
    me.connect({1: p2p_endpoint})
    bare = me.context.socket(zmq.PUSH)
    bare.connect(bare_endpoint)

    rows, r = [], 0
    for mb in SIZES_MB:
        state = {"w": torch.randn(mb * 1_000_000 // 4)}
        raw = state["w"].numpy()
        p2p, plain = [], []
        for i in range(args.repeats + 1):  # the first repeat warms up the connection
            t = time.perf_counter()
            me._send(Send(1, "model", r, state))
            acks.recv()
            t_p2p = time.perf_counter() - t
            t = time.perf_counter()
            bare.send(raw, copy=False)
            acks.recv()
            t_bare = time.perf_counter() - t
            r += 1
            if i:
                p2p.append(t_p2p)
                plain.append(t_bare)
        a, b = statistics.median(p2p), statistics.median(plain)
        rows.append([mb, 1000 * a, 1000 * b, a / b, mb / a / 1000])
    proc.join(timeout=60)
    bare.close()
    acks.close()
    me.close()
    report(
        "transport",
        ["model_MB", "p2pfl_ms", "bare_pyzmq_ms", "ratio", "p2pfl_GB_per_s"],
        rows,
        {"goal": "ratio <= 1.5 at 45 MB", "repeats": args.repeats},
    )


if __name__ == "__main__":
    main()
