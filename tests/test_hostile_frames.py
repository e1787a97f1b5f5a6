"""Hardening (issue 19): forged frames over real ZeroMQ sockets on loopback.

A live node of a 3-peer mesh receives what an attacker sends: a frame that claims a real
neighbour but carries the wrong model tensors, a flood of valid frames for a far-future round,
and under CURVE a listed key that claims to be another node. Each is dropped with a logged
reason, and the node goes on taking genuine frames.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import zmq
from test_transport import live_node, p2pfl

from p2pfl.network.message import Message
from p2pfl.network.wire import encode
from p2pfl.runtime.sockets import MAX_BACKLOG, ZmqNode, model_schema

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


def test_a_flood_of_valid_frames_for_a_far_future_round_is_bounded(target):
    node, sender = target
    for r in range(MAX_BACKLOG + 40):
        sender.send(frame(GOOD, round=10**6 + r))
    taken = 0
    while taken < MAX_BACKLOG + 40 and node.inbox_socket.poll(5000):
        node.receive()
        taken += 1
    assert taken == MAX_BACKLOG + 40
    assert len(node.inbox) == MAX_BACKLOG and node.rejected == 40


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
