"""Hardening (issues 19 and 36): forged frames over real ZeroMQ sockets on loopback.

A live node of a 3-peer mesh receives what an attacker sends: a frame that claims a real
neighbour but carries the wrong model tensors, or none of them, an empty tensor of absurd
sides, an oversized meta, floods of valid frames for far-future and near rounds, and under
CURVE a listed key that claims to be another node. Each is dropped at the door, counted by
sender and cause, and the node goes on taking genuine frames; a flood never displaces the
frame the node waits for, and its memory stays within the byte bound. Whole runs (real
processes, ``p2pfl peer`` on known ports) live through a flood and a forged stop, and a
launcher ends a network run whose last node is stopped (SIGSTOP) soon after the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
import zmq
from test_transport import live_node, p2pfl

from conftest import BASE, ROOT, peer_pids
from p2pfl.core.errors import RunError
from p2pfl.learning.models import MODELS
from p2pfl.methods.effects import Finish, Recv
from p2pfl.network.ledger import Ledger
from p2pfl.network.message import Message
from p2pfl.network.topology import build_topology
from p2pfl.network.wire import encode
from p2pfl.runtime.children import free_port
from p2pfl.runtime.sockets import (
    MAX_BACKLOG,
    MAX_BACKLOG_BYTES,
    TransportConfig,
    ZmqNode,
    model_schema,
)

MODEL = torch.nn.Linear(3, 2)
SCHEMA = model_schema(MODEL)
GOOD = {k: v.detach().clone() for k, v in MODEL.state_dict().items()}


def frame(tensors: dict[str, torch.Tensor], kind: str = "model", src: int = 0, round: int = 1):
    return encode(Message(kind, src, 1, round, tensors))


@pytest.fixture
def target():
    node = live_node(schema=SCHEMA)
    sender = node.context.socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(node.endpoint)
    yield node, sender
    sender.close()
    node.close()


def deliver(node: ZmqNode, sender: zmq.Socket, payload: bytes | bytearray) -> None:
    sender.send(payload)
    assert node.inbox_socket.poll(5000)
    node.receive()


FORGED = {
    "wrong shape": {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)},
    "wrong dtype": {"weight": torch.zeros(2, 3, dtype=torch.float64), "bias": torch.zeros(2)},
    "integer weights": {"weight": torch.zeros(2, 3, dtype=torch.int32), "bias": torch.zeros(2)},
    "missing tensor": {"weight": torch.zeros(2, 3)},
    "a scalar for a matrix": {"weight": torch.zeros(()), "bias": torch.zeros(2)},
    "transposed": {"weight": torch.zeros(3, 2), "bias": torch.zeros(2)},
    "half precision": {"weight": torch.zeros(2, 3, dtype=torch.float16), "bias": torch.zeros(2)},
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_a_forged_model_from_a_real_neighbour_is_dropped_and_the_node_goes_on(target, caplog, case):
    node, sender = target
    deliver(node, sender, frame(FORGED[case]))
    assert node.inbox == [] and node.rejected == 1
    assert "dropped a frame" in caplog.text
    deliver(node, sender, frame(GOOD, round=2))  # the genuine model still gets through
    assert [m.round for m in node.inbox] == [2]


@pytest.mark.parametrize("kind", ["statistics", "control"])
def test_other_kinds_may_carry_their_own_tensors_but_not_a_misshapen_model_tensor(target, kind):
    node, sender = target
    deliver(node, sender, frame({"fisher/weight": torch.zeros(6, 6)}, kind=kind))
    deliver(node, sender, frame({"weight": torch.zeros(9)}, kind=kind))
    assert [sorted(m.tensors) for m in node.inbox] == [["fisher/weight"]]
    assert node.rejected == 1


def test_under_curve_a_listed_key_cannot_speak_for_another_node(tmp_path, caplog):
    keys = tmp_path / "keys"
    assert p2pfl("keys", str(keys), "--peers", "3").returncode == 0
    node = live_node(str(keys), schema=SCHEMA)
    honest = live_node(str(keys), node=0, to={1: node.endpoint})  # holds node 0's key pair
    liar = live_node(str(keys), node=2, to={1: node.endpoint})  # node 2's key ...
    try:
        liar.outboxes[1].send(frame(GOOD, src=0, round=7))  # ... claiming to be node 0
        assert node.inbox_socket.poll(5000)
        node.receive()
        assert node.inbox == [] and node.rejected == 1
        assert "CURVE key is not theirs" in caplog.text
        liar.outboxes[1].send(frame(GOOD, src=2, round=8))  # as itself: fine
        honest.outboxes[1].send(frame(GOOD, src=0, round=9))
        for _ in range(2):
            assert node.inbox_socket.poll(5000)
            node.receive()
        assert sorted((m.src, m.round) for m in node.inbox) == [(0, 9), (2, 8)]
    finally:
        for n in (liar, honest, node):
            with contextlib.suppress(Exception):
                n.close()


# --- issue 36: frames that passed the schema ------------------------------------------------


def test_stacked_whole_models_are_a_model_message(target):
    """Candidates stacked as ``i/name`` (one-shot voting) still pass the door."""
    node, sender = target
    stacked = {f"{i}/{k}": v for i in range(2) for k, v in GOOD.items()}
    deliver(node, sender, frame(stacked))
    assert [sorted(m.tensors) for m in node.inbox] == [sorted(stacked)] and node.rejected == 0


NOT_THE_MODEL = {
    "names none of the model's tensors": {"x": torch.zeros(3)},
    "none, with a wrong shape": {"w": torch.zeros(5, 5)},
    "no tensors at all": {},
    "the model and one more": GOOD | {"extra": torch.zeros(1)},
    "a stacked copy with a tensor missing": {"0/weight": GOOD["weight"], "0/bias": GOOD["bias"],
                                             "1/weight": GOOD["weight"]},
    "a stacked copy of the wrong shape": {"0/weight": torch.zeros(3, 3), "0/bias": GOOD["bias"]},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(NOT_THE_MODEL))
def test_a_model_message_that_is_not_the_model_is_dropped_at_the_door(target, case):
    node, sender = target
    deliver(node, sender, frame(NOT_THE_MODEL[case], round=3))
    assert node.inbox == [] and node.dropped == {(0, "not the model"): 1}
    deliver(node, sender, frame(GOOD, round=3))
    assert [m.round for m in node.inbox] == [3]


def test_a_wrong_model_at_a_far_future_round_never_reaches_the_method(target):
    """A FedAvg client takes a model of any round: the frame must not get that far."""
    node, sender = target
    deliver(node, sender, frame({"w": torch.zeros(5, 5)}, round=10**6))
    deliver(node, sender, frame(GOOD, round=10**6))  # well formed, but no round of this run
    assert node.inbox == [] and node.rejected == 2
    assert node.dropped[0, "beyond the round window"] == 1


@pytest.mark.parametrize("kind", ["statistics", "control"])
def test_an_empty_tensor_with_an_absurd_side_is_dropped(target, kind):
    """Shape [0, 2**47] has no bytes, yet no tensor of this run has such a side."""
    node, sender = target
    deliver(node, sender, frame({"stat": torch.zeros(0, 2**47)}, kind=kind))
    assert node.inbox == [] and node.dropped == {(None, "malformed"): 1}
    deliver(node, sender, frame({"stat": torch.zeros(0, 7)}, kind=kind))  # a real empty one
    assert len(node.inbox) == 1


def test_an_oversized_meta_is_dropped_and_a_stop_far_ahead_is_no_stop(target):
    node, sender = target
    stop = {"stop": True, "pad": "x" * 900_000}
    deliver(node, sender, encode(Message("control", 0, 1, 10**6, {}, stop)))
    deliver(node, sender, encode(Message("control", 0, 1, 1, {}, stop)))
    deliver(node, sender, encode(Message("control", 0, 1, 10**6, {}, {"stop": True})))
    assert node.inbox == []
    assert node.dropped == {(0, "oversized meta"): 2, (0, "beyond the round window"): 1}


def flood(node: ZmqNode, sender: zmq.Socket, frames: list) -> None:
    """Send ``frames`` one by one, ``node`` taking each in (to keep it, or drop it)."""
    for f in frames:
        deliver(node, sender, f)


def test_a_far_future_flood_is_dropped_and_the_awaited_model_still_taken(target, caplog):
    """300 well-formed frames in node 0's name, far ahead: none is kept (the backlog stays
    empty), each is counted, the log has a few lines, not 300, and the real model of the
    round the node waits for is taken."""
    node, sender = target
    flood(node, sender, [frame(GOOD, round=10**6 + r) for r in range(300)])
    assert node.inbox == [] and node.dropped == {(0, "beyond the round window"): 300}
    assert caplog.text.count("dropped a frame") == 3  # the 1st, 10th and 100th
    sender.send(frame(GOOD, round=1))
    (msg,) = node._recv(Recv(round=1))
    assert msg.src == 0
    assert node.report()["rejected"] == {"0": {"beyond the round window": 300}}


def test_a_flood_within_the_window_never_displaces_the_awaited_model(target):
    """Frames of the next rounds fill sender 0's backlog (MAX_BACKLOG messages): the model
    of the node's current round still gets in, displacing the furthest-ahead one."""
    node, sender = target
    node.round = 2
    flood(node, sender, [frame(GOOD, round=3 + r % 16) for r in range(MAX_BACKLOG + 20)])
    assert len(node.inbox) == MAX_BACKLOG and node.rejected == 20
    sender.send(frame(GOOD, round=2))
    (msg,) = node._recv(Recv(round=2))
    assert (msg.src, msg.round) == (0, 2)
    assert len(node.inbox) == MAX_BACKLOG - 1 and node.dropped[0, "over the backlog"] == 21


def test_a_flood_of_past_rounds_never_displaces_the_awaited_model(target):
    node, sender = target
    node.round = 10
    flood(node, sender, [frame(GOOD, round=r % 10) for r in range(MAX_BACKLOG + 5)])
    sender.send(frame(GOOD, round=10))
    (msg,) = node._recv(Recv(round=10))
    assert msg.round == 10 and node.rejected == 5 + 1


def test_a_flood_of_big_frames_is_bounded_in_bytes():
    """300 frames of 4 MB in node 0's name, each of a round in the window: the node keeps at
    most MAX_BACKLOG_BYTES of them (the bound counted messages only: 1 GB was kept)."""
    transport = TransportConfig(timeout_s=5.0, max_message_bytes=8 << 20)
    topo = build_topology({"kind": "mesh"}, 3, 0)
    schema = {"w": ((1 << 20,), torch.float32)}
    node = ZmqNode(1, topo, None, Ledger(), transport, schema=schema)  # type: ignore[arg-type]
    node.connect({0: "tcp://127.0.0.1:1", 2: "tcp://127.0.0.1:1"})
    sender = node.context.socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(node.bind("tcp://127.0.0.1:*"))
    try:
        big = frame({"w": torch.zeros(1 << 20)}, round=5)
        flood(node, sender, [big] * 300)
        held = sum(t.nbytes for m in node.inbox for t in m.tensors.values())
        assert MAX_BACKLOG_BYTES - (4 << 20) < held <= MAX_BACKLOG_BYTES
        assert node.dropped == {(0, "over the backlog"): 300 - len(node.inbox)}
    finally:
        sender.close()
        node.close()


def test_a_timed_out_wait_names_the_flood(target):
    node, sender = target
    node.transport = TransportConfig(timeout_s=0.5, max_message_bytes=1 << 20)
    flood(node, sender, [frame(GOOD, round=10**6 + r) for r in range(30)])
    with pytest.raises(RunError) as e:
        node._recv(Recv(round=1))
    assert "a peer died" not in str(e.value)
    assert "30 frame(s) in 0's name (30 beyond the round window): a flood?" in str(e.value)


def test_the_window_follows_the_node_s_own_round(target):
    """A method's rounds past its ``total_rounds`` still pass once the node names them."""
    node, sender = target
    sender.send(frame(GOOD, round=40))

    def behaviour():
        (msg,) = yield Recv(round=40)
        yield Finish(msg.tensors)

    assert node.run(behaviour()).state is not None and node.rejected == 0


def test_a_method_that_fails_on_a_believed_frame_ends_in_one_line(target):
    """A well-formed model in node 0's name whose meta weight is no number: the method's
    error, with the frame that caused it, not a traceback."""
    node, sender = target
    sender.send(encode(Message("model", 0, 1, 1, GOOD, {"weight": "x"})))

    def behaviour():
        (msg,) = yield Recv(round=1)
        yield Finish(msg.tensors if float(msg.meta["weight"]) else {})

    with pytest.raises(RunError) as e:
        node.run(behaviour())
    assert str(e.value) == (
        "1's method failed on what it received (a model frame from 0 at round 1): "
        "ValueError: could not convert string to float: 'x'"
    )


# --- whole runs: real processes on known ports ----------------------------------------------

ROUNDS = 10
RUN = BASE | {"peers": {"count": 3}, "algorithm": {"name": "fedavg", "rounds": ROUNDS},
              "transport": {"timeout_s": 3.0}}  # fmt: skip
STAR = ["server", "0", "1", "2"]  # the nodes of a star of 3 peers (the server is node 3)
STATE = MODELS.get("mlp")((1, 8, 8), 10, hidden=(32,)).state_dict()


def peer_run(
    tmp_path: Path,
    forged: dict[str, list[bytearray]],
    sections: dict[str, Any] | None = None,
    nodes: list[str] | None = None,
) -> subprocess.CompletedProcess:
    """Run every node of ``RUN`` (with ``sections``; ``nodes``: its node names) with one
    ``p2pfl peer`` command on known loopback ports, with ``forged`` frames (by target node)
    queued on an attacker's sockets connected to those ports: each node takes them in as soon
    as it binds, before any genuine frame."""
    path, out = tmp_path / "exp.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(RUN | (sections or {})))
    nodes = nodes or STAR
    addresses = {name: f"tcp://127.0.0.1:{free_port()}" for name in nodes}
    (tmp_path / "addresses.yaml").write_text(yaml.safe_dump(addresses))
    context = zmq.Context()
    try:
        for name, frames in forged.items():
            attacker = context.socket(zmq.PUSH)
            attacker.setsockopt(zmq.LINGER, 0)
            attacker.setsockopt(zmq.RECONNECT_IVL, 10)  # at the port 10 ms after it opens
            attacker.connect(addresses[name])
            for f in frames:
                attacker.send(f)
        table = str(tmp_path / "addresses.yaml")
        cmd = ["peer", str(path), "--peer", ",".join(nodes), "--addresses", table]
        return p2pfl(*cmd, "--out", str(out), timeout=120)
    finally:
        context.destroy(linger=0)


def result(tmp_path: Path, node: str) -> dict[str, Any]:
    return json.loads((tmp_path / "out" / "peers" / node / "result.json").read_text())


def test_a_run_flooded_in_a_peer_s_name_ends_well_and_reports_the_flood(tmp_path):
    """300 well-formed models in peer 0's name, for rounds far ahead, reach the server before
    peer 0's first model: the run ends well (it failed: the backlog was full, and peer 0's
    real model was dropped), and the server's result.json counts the flood."""
    flood = [encode(Message("model", 0, 3, 10**6 + r, STATE)) for r in range(300)]
    done = peer_run(tmp_path, {"server": flood})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    server = result(tmp_path, "server")
    assert server["status"] == "ok" and server["rejected_frames"] == 300
    assert server["rejected"] == {"0": {"beyond the round window": 300}}


def test_a_far_future_stop_with_a_huge_meta_is_no_stop(tmp_path):
    """A stop for round 10**6 with a 900 kB meta, in the server's name: peer 2 drops it and
    the run ends well (peer 2 stopped, and the run failed 3 s later)."""
    stop = encode(Message("control", 3, 2, 10**6, {}, {"stop": True, "pad": "x" * 900_000}))
    done = peer_run(tmp_path, {"2": [stop]})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert result(tmp_path, "2")["rejected"] == {"server": {"oversized meta": 1}}
    assert result(tmp_path, "2")["stop"] == {"from": "server", "round": ROUNDS}  # the real one


def test_a_forged_stop_within_the_window_is_named_when_the_run_fails(tmp_path):
    """A well-formed stop in the server's name, at the last round, is believed (no CURVE), so
    peer 2 stops and the server's wait times out: the run's one line names the stop, not
    only "a peer died or never came up?"."""
    stop = encode(Message("control", 3, 2, ROUNDS, {}, {"stop": True}))
    done = peer_run(tmp_path, {"2": [stop]})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: peer ") and " waited 3 s for " in last, last  # 0 or server
    assert last.endswith(f"; peer 2 stopped on a stop frame from server at round {ROUNDS}"), last
    assert result(tmp_path, "2")["stop"] == {"from": "server", "round": ROUNDS}


@pytest.mark.parametrize(
    "meta,round", [({"stop": True}, 1), ({"stop": 1}, ROUNDS), ({}, ROUNDS)],
    ids=["an-early-round", "stop-not-true", "no-stop-key"],
)  # fmt: skip
def test_a_control_frame_that_is_not_the_servers_stop_is_passed_over(tmp_path, meta, round):
    """A FedAvg client stops only on the server's form of stop (``stop: true`` at the last
    round): a forged control of any other form is passed over and the run ends well."""
    done = peer_run(tmp_path, {"2": [encode(Message("control", 3, 2, round, {}, meta))]})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert result(tmp_path, "2")["status"] == "ok"


def test_a_stopped_peer_of_a_network_run_ends_the_launcher_soon_after_the_others(tmp_path):
    """SIGSTOP peer 1 of a gossip run with a ``network:`` section: its neighbours go on (no
    receive waits for it), and once they have all ended the launcher gives it
    ``timeout_s``, then ends the run with one line naming it and a failed summary.json
    (it waited for ever)."""
    timeout, rounds, period = 2.0, 4, 0.5
    config = BASE | {
        "topology": {"kind": "ring"}, "network": {"links": {"loss": 0.1}},
        "algorithm": {"name": "gossip", "rounds": rounds, "period_s": period},
        "transport": {"timeout_s": timeout},
    }  # fmt: skip
    path, out = tmp_path / "exp.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "p2pfl", "run", str(path), "--out", str(out), "--quiet"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*cmd, "--transport", "zmq"], cwd=ROOT, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    hung = None
    try:
        deadline = time.monotonic() + 120
        metrics = out / "peers" / "1" / "metrics.csv"  # a row: past the handshake
        while not (metrics.is_file() and metrics.read_text().count("\n") > 1):
            assert time.monotonic() < deadline and proc.poll() is None, "the run did not start"
            time.sleep(0.05)
        hung = peer_pids(proc.pid)["1"]
        os.kill(hung, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
        if hung is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)
    assert proc.returncode == 1 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last == (
        "error: run failed: peer 1 did not end within 2 s (transport.timeout_s) of the other "
        "nodes (its process is stopped: SIGSTOP?)"
    ), err
    # the others end with the schedule (rounds x period), plus 2 s to deliver what they queued
    assert elapsed <= rounds * period + 2.0 + timeout + 4.0, elapsed  # 6.7 s when written
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "peer 1 did not end" in summary["error"]


def test_a_push_sum_run_fed_a_weight_that_is_no_number_fails_in_one_line(tmp_path):
    """Push-sum reads each share's weight from its meta: a forged share whose weight is a
    string ends the run with one line naming the frame (it was a ValueError traceback)."""
    forged = encode(Message("model", 0, 1, 1, STATE, {"weight": "x"}))
    ring = {"topology": {"kind": "ring"}, "algorithm": {"name": "pushsum", "rounds": 3}}
    done = peer_run(tmp_path, {"1": [forged]}, ring, ["0", "1", "2"])
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: peer 1 failed: 1's method failed on what it received (a model frame from 0 at "
            "round 1"
        )
    ), done.stderr
