"""The SimPy runtime's network model: exact link timing, uplink queueing, deadlocks."""

from __future__ import annotations

import math
import random
import threading
import zlib

import numpy as np
import pytest
import torch

from conftest import experiment
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError, RunError
from p2pfl.core.seeding import derive_seed, seed_sequence_state
from p2pfl.methods.effects import Finish, Recv, Send, Wait
from p2pfl.network.dynamics import Network
from p2pfl.network.ledger import Ledger
from p2pfl.network.message import Message
from p2pfl.network.topology import build_topology
from p2pfl.network.wire import encode
from p2pfl.runtime.sim import SimRuntime

LATENCY, BANDWIDTH = 0.25, 8.0e6  # 250 ms, 1 MB/s


def two_peers():
    link = {"latency_s": LATENCY, "bandwidth_bps": BANDWIDTH}
    return build_topology({"kind": "edges", "edges": [[0, 1]], "link": link}, 2, 0)


def payload(n: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(n, dtype=torch.float32)}


def frame_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return len(encode(Message("model", 0, 1, 1, tensors)))


def run_pair(sender, receiver) -> tuple[SimRuntime, Ledger]:
    ledger = Ledger()
    sim = SimRuntime(two_peers(), worker=None, ledger=ledger)  # no Train/Evaluate used here
    sim.run({0: sender(sim), 1: receiver(sim)})
    return sim, ledger


def test_one_message_arrives_after_latency_plus_transfer_time():
    arrivals = []
    tensors = payload(100_000)

    def sender(sim):
        yield Send(1, "model", 1, tensors)
        yield Finish(None)

    def receiver(sim):
        (msg,) = yield Recv()
        arrivals.append(sim.now)
        assert torch.equal(msg.tensors["w"], tensors["w"])
        yield Finish(None)

    _, ledger = run_pair(sender, receiver)
    m = frame_bytes(tensors)
    assert arrivals == [LATENCY + 8 * m / BANDWIDTH]
    assert ledger.total_bytes == m and ledger.messages == 1


def test_two_messages_on_one_uplink_queue_one_transfer_apart():
    arrivals = []
    tensors = payload(50_000)

    def sender(sim):
        yield Send(1, "model", 1, tensors)
        yield Send(1, "model", 2, tensors)
        yield Finish(None)

    def receiver(sim):
        for r in (1, 2):
            yield Recv(round=r)
            arrivals.append(sim.now)
        yield Finish(None)

    run_pair(sender, receiver)
    transfer = 8 * frame_bytes(tensors) / BANDWIDTH
    assert arrivals[0] == pytest.approx(LATENCY + transfer, rel=1e-12)
    assert arrivals[1] - arrivals[0] == pytest.approx(transfer, rel=1e-12)


def star_broadcast(uplink: str, sizes: list[int], late: float = 0.0) -> tuple[list, Ledger]:
    """The server of a 3-peer star sends one message of ``sizes[i]`` floats to peer i, the
    last one ``late`` seconds after the others; each peer's arrival time, and the ledger."""
    topo = build_topology(
        {"kind": "star", "link": {"latency_s": LATENCY, "bandwidth_bps": BANDWIDTH}}, 3, 0
    )
    arrivals: list[float] = [0.0] * 3

    def server(sim):
        for i, n in enumerate(sizes):
            if i == 2 and late:
                yield Wait(late)
            yield Send(i, "model", 1, payload(n))
        yield Finish(None)

    def peer(i):
        def behaviour(sim):
            yield Recv()
            arrivals[i] = sim.now
            yield Finish(None)

        return behaviour

    ledger = Ledger()
    sim = SimRuntime(topo, worker=None, ledger=ledger, uplink=uplink)
    sim.run({3: server(sim)} | {i: peer(i)(sim) for i in range(3)})
    return arrivals, ledger


def test_a_shared_uplink_splits_its_bandwidth_among_the_transfers_under_way():
    """Processor sharing, exactly: three equal messages sent at once all land at 3·T + L
    (FIFO: T, 2T, 3T + L); a lone message takes T + L as on a FIFO uplink; the bytes are the
    same either way."""
    fifo, fifo_ledger = star_broadcast("fifo", [50_000] * 3)
    shared, shared_ledger = star_broadcast("shared", [50_000] * 3)
    t = 8 * frame_bytes(payload(50_000)) / BANDWIDTH
    assert fifo == pytest.approx([LATENCY + t, LATENCY + 2 * t, LATENCY + 3 * t], rel=1e-12)
    assert shared == pytest.approx([LATENCY + 3 * t] * 3, rel=1e-12)
    assert shared_ledger.summary() == fifo_ledger.summary()
    # unequal sizes: the small one (a) shares with two, then (b - a) goes at half speed ...
    a, b = (8 * frame_bytes(payload(n)) / BANDWIDTH for n in (10_000, 40_000))
    shared, _ = star_broadcast("shared", [10_000, 40_000, 40_000])
    assert shared[0] == pytest.approx(LATENCY + 3 * a, rel=1e-9)
    assert shared[1] == shared[2] == pytest.approx(LATENCY + 3 * a + 2 * (b - a), rel=1e-9)
    # ... and a third transfer that starts at T/2 (a quarter of each of the first two sent)
    # takes a third from then on: they land at T/2 + 3·(3T/4), it T/4 later, alone
    shared, _ = star_broadcast("shared", [50_000] * 3, late=t / 2)
    assert shared == pytest.approx([LATENCY + 11 * t / 4] * 2 + [LATENCY + 3 * t], rel=1e-9)


def test_an_unknown_uplink_is_refused_with_its_key():
    with pytest.raises(ConfigError, match="uplink"):
        build(experiment(peers={"count": 4, "uplink": "lifo"}))


def test_recv_returns_messages_sorted_by_sender_not_arrival():
    topo = build_topology({"kind": "star"}, 3, 0)
    got = []

    def peer(i):
        def behaviour(sim):
            yield Send(topo.server, "model", 1, payload(10 * (3 - i)))  # peer 0 is slowest
            yield Finish(None)

        return behaviour

    def server(sim):
        msgs = yield Recv(count=3)
        got.extend(m.src for m in msgs)
        yield Finish(None)

    sim = SimRuntime(topo, worker=None, ledger=Ledger())
    sim.run({0: peer(0)(sim), 1: peer(1)(sim), 2: peer(2)(sim), 3: server(sim)})
    assert got == [0, 1, 2]


def test_deadlock_is_reported_with_who_waits_for_what():
    def waiter(sim):
        yield Recv(kinds=("statistics",), round=7)
        yield Finish(None)

    def quiet(sim):
        yield Finish(None)

    with pytest.raises(RunError, match=r"0 waits for 1 statistics message\(s\) of round 7$"):
        run_pair(lambda sim: waiter(sim), quiet)  # no network: section, so no hint about one


def test_sending_to_a_non_neighbour_fails():
    topo = build_topology({"kind": "ring"}, 5, 0)

    def bad(sim):
        yield Send(2, "model", 1, payload(3))
        yield Finish(None)

    sim = SimRuntime(topo, worker=None, ledger=Ledger())
    with pytest.raises(RunError, match="not its neighbour"):
        sim.run({0: bad(sim)})


def test_seed_sequence_state_equals_numpys():
    """The plain-Python SeedSequence gives numpy's two words for any entropy: short and long
    lists, zeros, integers of one, two and four 32-bit words."""
    rng = random.Random(0)
    cases = [[0], [1], [2**32], [0, 0, 0, 0, 0], [2**63 - 1, 5]]
    for _ in range(3000):
        sizes = [0, 1, 2**32 - 1, rng.randrange(2**32), rng.randrange(2**64), rng.randrange(2**128)]
        cases.append([rng.choice(sizes) for _ in range(rng.randint(1, 7))])
    for entropy in cases:
        want = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
        assert seed_sequence_state(entropy) == tuple(int(w) for w in want), entropy


def test_derive_seed_keeps_the_first_versions_values():
    """Every stream's seed must stay what it was, or old runs no longer replay: the first
    version computed high·2^31 + low as a numpy uint64 @ int64 product, i.e. in float64."""
    for seed, keys in [(0, ("train", 3, 4, 0)), (7, ("init",)), (2**31 - 1, ("part", 99, 1))]:
        ints = [zlib.crc32(k.encode()) if isinstance(k, str) else k for k in keys]
        state = np.random.SeedSequence([seed, *ints]).generate_state(2, dtype=np.uint32)
        old = int(state.astype(np.uint64) @ [1 << 31, 1]) & ((1 << 63) - 1)
        assert derive_seed(seed, *keys) == old


def test_a_shared_uplink_late_in_a_long_run_ends_its_transfers():
    """At t = 20,000 s a float step of the clock is worth more bits than a transfer's
    rounding test allowed: the last few bits' timer fired at the same instant, again and
    again. The transfers now end when what is left cannot move the clock."""
    topo = build_topology({"kind": "star"}, 3, 0)  # the default link: 100 Mbit/s, 10 ms
    arrivals = []

    def server(sim):
        yield Wait(20_000.0)
        for i in range(3):
            yield Send(i, "model", 1, payload(1000))
        yield Finish(None)

    def peer(sim):
        yield Recv()
        arrivals.append(sim.now)
        yield Finish(None)

    sim = SimRuntime(topo, worker=None, ledger=Ledger(), uplink="shared")
    runs = threading.Thread(
        target=sim.run, args=({3: server(sim)} | {i: peer(sim) for i in range(3)},), daemon=True
    )
    runs.start()
    runs.join(timeout=30)
    assert not runs.is_alive(), "the simulation did not end"
    t = 8 * frame_bytes(payload(1000)) / 100e6
    assert arrivals == pytest.approx([20_000.0 + 0.01 + 3 * t] * 3, rel=1e-12)


def listener_pair(network=None, deadline: float = 1000.0) -> dict[str, float]:
    """Peer 0 sends a model and waits (up to ``deadline``) for an acknowledgement; peer 1
    acknowledges, then listens "until the end". When each ended, and the run's end."""
    seen: dict[str, float] = {}

    def sender(sim):
        yield Send(1, "model", 1, payload(10))
        yield Recv(kinds=("control",), deadline=deadline)
        seen["sender"] = sim.now
        yield Finish(None)

    def listener(sim):
        yield Recv()
        yield Send(0, "control", 1, {})
        yield Recv(kinds=("statistics",), deadline=math.inf)
        seen["listener"] = sim.now
        yield Finish(None)

    sim = SimRuntime(two_peers(), worker=None, ledger=Ledger(), network=network)
    finals = sim.run({0: sender(sim), 1: listener(sim)})
    return seen | {"end": sim.now, "finals": sorted(finals)}


def test_a_listener_ends_when_nothing_else_can_happen_not_at_a_leftover_timer():
    """The acknowledgement lands at about 0.5 s, long before the sender's deadline (1,000 s)
    and peer 1's crash time (50 s): the listener is woken then, ends with its final model,
    and the run ends then (AD-PSGD's passive peers ran to their last request's timeout)."""
    t = 8 * frame_bytes(payload(10)) / BANDWIDTH
    acked = 2 * LATENCY + t + 8 * frame_bytes({}) / BANDWIDTH
    crashes = Network({"crashes": {"at": {1: 50.0}}}, two_peers(), 0)
    for seen in (listener_pair(), listener_pair(crashes)):
        assert seen["sender"] == seen["listener"] == seen["end"] == pytest.approx(acked)
        assert seen["finals"] == [0, 1]


def test_full_collections_are_rarer_only_while_a_simulation_runs(tmp_path, monkeypatch):
    """While the simulation runs the cyclic collector's third threshold is FULL_RARER times
    the caller's (full collections over the peers' objects took most of a 10⁴-peer run's
    collecting), and the caller's thresholds are back afterwards, also after a failure."""
    import gc

    from p2pfl.app.experiment import run
    from p2pfl.runtime import sim

    seen: list[tuple[int, int, int]] = []
    quiet = SimRuntime._run_until_quiet

    def recording(self):
        seen.append(gc.get_threshold())
        return quiet(self)

    monkeypatch.setattr(SimRuntime, "_run_until_quiet", recording)
    before = gc.get_threshold()
    try:
        gc.set_threshold(500, 7, 3)
        run(build(experiment()), tmp_path / "run")
        assert seen and set(seen) == {(500, 7, 3 * sim.FULL_RARER)}
        assert gc.get_threshold() == (500, 7, 3)

        def failing(self):
            raise RuntimeError("a run that fails")

        monkeypatch.setattr(SimRuntime, "_run_until_quiet", failing)
        with pytest.raises(RunError):
            run(build(experiment()), tmp_path / "failed")
        assert gc.get_threshold() == (500, 7, 3)
    finally:
        gc.set_threshold(*before)
