"""The ZeroMQ runtime: real processes on loopback, the same models as the simulation,
dead peers, Ctrl-C, hostile frames and CURVE authentication."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import AFTER_CUDA, BASE, DEVICE, ROOT, experiment, forks_refused, on_device, peer_pids
from p2pfl.app.experiment import build
from p2pfl.core.errors import RunError
from p2pfl.methods import METHODS
from p2pfl.methods.effects import Recv
from p2pfl.network.ledger import Ledger
from p2pfl.network.message import Message
from p2pfl.network.topology import build_topology
from p2pfl.network.wire import encode
from p2pfl.runtime.launcher import _handshake, warm_up
from p2pfl.runtime.sockets import TransportConfig, ZmqNode

TIMEOUT = 120.0  # a receive waits for its sender's compute, which is slow on a busy CI box

# Each case: the sections that differ from the digits BASE experiment.
SAME_AS_SIM = {
    "fedavg-star": {"algorithm": {"name": "fedavg", "rounds": 2, "participation": 0.5}},
    "fedseq-ring": {"topology": {"kind": "ring"}, "algorithm": {"name": "fedseq", "cycles": 1}},
    "fedelmy-ring": {
        "topology": {"kind": "ring"},
        "algorithm": {"name": "fedelmy", "pool_size": 2, "warmup_epochs": 1},
    },
    "maecho-mesh": {
        "topology": {"kind": "mesh"},
        "model": {"name": "mlp", "hidden": [32], "bias": False},
        "algorithm": {"name": "maecho", "placement": "mesh"},
    },
    "fedavg-attacked-krum": {  # issue 18: seeded Gaussian attackers, the same bits over sockets
        "algorithm": {"name": "fedavg", "rounds": 2, "aggregator": "krum"},
        "adversary": {"fraction": 0.5, "attack": {"name": "gaussian", "std": 0.05}},
    },
    "dfedavgm-ring-120": {  # issue 17: a hundred and more forked peers, the same bits
        "topology": {"kind": "ring"},
        # on the CPU under `pytest --device cuda` too: 120 processes' CUDA contexts (621 MiB
        # each on an H100) do not fit one 80 GB GPU
        "peers": {"count": 120, "device": "cpu"},
        "algorithm": {"name": "dfedavgm", "rounds": 2},
        "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.9},
    },
    "pushsum-robust-ring": {  # running sums: each link's totals, kept across rounds
        "topology": {"kind": "ring"},
        "algorithm": {"name": "pushsum", "rounds": 3, "robust": True},
    },
    "fedfisher-mesh-compressed": {  # uploads under the int16 codec that Send names
        "topology": {"kind": "mesh"},
        "algorithm": {"name": "fedfisher", "placement": "mesh", "compress": True, "steps": 20},
    },
}


def write_experiment(tmp_path: Path, **sections) -> Path:
    config = on_device(BASE | {"transport": {"timeout_s": TIMEOUT}} | sections)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def p2pfl(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2pfl", *args], capture_output=True, text=True, cwd=ROOT, **kw
    )


@pytest.mark.parametrize("case", list(SAME_AS_SIM))
def test_zmq_run_gives_the_simulated_models(tmp_path, case):
    sections = SAME_AS_SIM[case]
    if sections["algorithm"]["name"] not in METHODS:
        pytest.skip(f"{sections['algorithm']['name']} has not landed")
    path = write_experiment(tmp_path, **sections)
    sim = p2pfl("run", str(path), "--out", str(tmp_path / "sim"), "--quiet")
    real = p2pfl("run", str(path), "--out", str(tmp_path / "zmq"), "--quiet", "--transport", "zmq")
    assert sim.returncode == 0, sim.stderr
    assert real.returncode == 0, real.stderr
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("sim", "zmq"))
    assert (a["transport"], b["transport"]) == ("sim", "zmq")
    assert a["final"] == b["final"]
    assert a["per_peer"] == b["per_peer"]
    assert a["comm"] == b["comm"]
    assert a.get("baselines") == b.get("baselines")
    assert a.get("adversary") == b.get("adversary")
    for name, clock in WALL_CLOCK.items():
        sim_rows, zmq_rows = (rows_without(tmp_path / d / name, clock) for d in ("sim", "zmq"))
        assert zmq_rows == sim_rows, name


WALL_CLOCK = {"metrics.csv": ("time",), "comm.csv": ("time", "arrival")}
"""The columns that hold a clock's reading: simulated seconds in a simulation, wall-clock
seconds over sockets. Every other column of every row is the same text both ways."""


def rows_without(path: Path, columns: tuple[str, ...]) -> list[tuple[str, ...]]:
    """``path``'s header and rows as text, less ``columns``; rows sorted (a real run's
    nodes write theirs in wall-clock order, which no two runs share)."""
    with open(path, newline="") as f:
        header, *body = csv.reader(f)
    keep = [i for i, c in enumerate(header) if c not in columns]
    assert len(keep) == len(header) - len(columns), (header, columns)
    return [tuple(header[i] for i in keep), *sorted(tuple(r[i] for i in keep) for r in body)]


@pytest.fixture
def launcher(tmp_path):
    """Start a long real FedAvg run; yield (process, out dir) once it is going; kill it after."""
    path = write_experiment(tmp_path, algorithm={"name": "fedavg", "rounds": 100_000})
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "p2pfl", "run", str(path), "--out", str(out), "--quiet"]
    proc = subprocess.Popen(
        cmd + ["--transport", "zmq"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so teardown can stop every peer
        # Ctrl-C as at a terminal even when the tests run as a background job, whose
        # children inherit an ignored SIGINT (Python then never raises KeyboardInterrupt)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        server_metrics = out / "peers" / "server" / "metrics.csv"
        deadline = time.monotonic() + 300
        while not (server_metrics.is_file() and len(server_metrics.read_text().splitlines()) > 4):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the run never got going"
            time.sleep(0.2)
        yield proc, out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def still_running(pids: dict[str, int]) -> list[str]:
    """The nodes among ``pids`` whose process still runs (a zombie has ended)."""
    alive = []
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            state = stat.rpartition(")")[2].split()[0]
            if stat[stat.index("(") + 1 : stat.rindex(")")] == f"p2pfl {name}" and state != "Z":
                alive.append(name)
    return alive


def test_killing_a_peer_ends_the_run_with_a_report(launcher):
    proc, out = launcher
    pids = peer_pids(proc.pid)
    assert set(pids) == {"0", "1", "2", "3", "server"}
    os.kill(pids["2"], signal.SIGKILL)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=TIMEOUT + 5)
    assert time.monotonic() - killed < TIMEOUT + 5
    assert proc.returncode == 1
    assert "peer 2 died (signal 9)" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "peer 2 died" in summary["error"]
    assert len((out / "metrics.csv").read_text().splitlines()) > 4  # what was written stays
    assert still_running(pids) == []


def test_ctrl_c_stops_every_peer_process(launcher):
    proc, out = launcher
    pids = peer_pids(proc.pid)
    assert len(pids) == 5
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 130
    assert still_running(pids) == []


def test_killing_the_launcher_takes_its_peers_with_it(launcher):
    proc, out = launcher
    pids = peer_pids(proc.pid)
    assert len(pids) == 5
    proc.kill()  # SIGKILL: no handler runs; the peers' parent-death signal ends them
    proc.wait()
    deadline = time.monotonic() + 10
    while still_running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert still_running(pids) == []


def test_a_peer_whose_neighbour_never_comes_up_times_out(tmp_path):
    path = write_experiment(
        tmp_path,
        topology={"kind": "ring"},
        algorithm={"name": "fedseq"},
        transport={"timeout_s": 3.0},
    )
    addresses = tmp_path / "addresses.yaml"
    addresses.write_text(yaml.safe_dump({i: f"tcp://127.0.0.1:{47310 + i}" for i in range(4)}))
    start = time.monotonic()
    done = p2pfl(
        "peer", str(path), "--peer", "1", "--addresses", str(addresses), "--out", str(tmp_path)
    )
    assert done.returncode == 1
    assert "peer 1: 1 waited 3 s for 1 model message(s) of round 1 from 0" in done.stderr
    assert time.monotonic() - start < 120  # start-up (torch, data) + the 3 s timeout
    result = json.loads((tmp_path / "peers" / "1" / "result.json").read_text())
    assert result["status"] == "failed"


def live_node(
    keys: str | None = None,
    node: int = 1,
    to: dict[int, str] | None = None,
    schema=None,
    timeout_s: float = 5.0,
) -> ZmqNode:
    """A real node of a 3-peer mesh, bound on loopback, with no worker (it only receives).

    Its neighbours' addresses are ``to`` (default: a closed port, so sends go nowhere);
    ``schema``: the model tensors it checks received messages against.
    """
    topo = build_topology({"kind": "mesh"}, 3, 0)
    transport = TransportConfig(timeout_s=timeout_s, max_message_bytes=1 << 20, curve_keys=keys)
    zn = ZmqNode(node, topo, None, Ledger(), transport, schema=schema)  # type: ignore[arg-type]
    zn.endpoint = zn.bind("tcp://127.0.0.1:*")
    zn.connect({j: "tcp://127.0.0.1:1" for j in range(3)} | (to or {}))
    return zn


@pytest.mark.parametrize(
    "signal",
    [[1, 2], {"addresses": {"0": "tcp://127.0.0.1:1"}}, {"t0": "now", "addresses": {}},
     {"t0": 1.0, "addresses": {"x": "tcp://127.0.0.1:1"}}, {"t0": 1.0, "addresses": {"0": 5}}],
)  # fmt: skip
def test_a_malformed_start_signal_is_a_run_error(signal: object) -> None:
    """A peer's handshake with a real ROUTER coordinator that answers nonsense: one clear
    RunError naming the start signal, not a KeyError or ValueError from inside."""
    node = live_node()
    router = node.context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    transport = TransportConfig(timeout_s=5.0, startup_timeout_s=5.0)
    try:

        def answer() -> None:
            ident, _hello = router.recv_multipart()
            router.send_multipart([ident, json.dumps(signal).encode()])

        thread = threading.Thread(target=answer)
        thread.start()
        with pytest.raises(RunError, match="malformed start signal"):
            _handshake(node, f"tcp://127.0.0.1:{port}", transport)
        thread.join(10)
    finally:
        router.close()
        node.close()


def valid_frame(round: int = 1) -> bytearray:
    return encode(Message("model", 0, 1, round, {"w": torch.arange(4.0)}))


@pytest.fixture(scope="module")
def fuzz_target():
    node = live_node()
    sender = node.context.socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(node.endpoint)
    yield node, sender
    sender.close()
    node.close()


def mutate(frame: bytearray, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(frame)
    for pos, value in edits:
        out[pos % len(out)] = value
    return bytes(out)


hostile = st.one_of(
    st.binary(max_size=512),
    st.builds(
        mutate,
        st.just(valid_frame()),
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    ),
    st.builds(lambda n: bytes(valid_frame()[:n]), st.integers(0, len(valid_frame()) - 1)),
    st.builds(lambda junk: bytes(valid_frame()) + junk, st.binary(min_size=1, max_size=64)),
    st.builds(
        lambda schema: bytes(valid_frame()[:24]) + len(schema).to_bytes(4, "little") + schema,
        st.binary(max_size=200),
    ),
)


@settings(max_examples=1200, deadline=None, suppress_health_check=list(HealthCheck))
@given(frame=hostile)
def test_hostile_frames_never_crash_or_hang_a_live_receiver(fuzz_target, frame):
    node, sender = fuzz_target
    sender.send(frame)
    assert node.inbox_socket.poll(5000), "the receiver stopped reading"
    node.accept([f.buffer for f in node.inbox_socket.recv_multipart(copy=False)])
    assert all(m.src == 0 and m.dst == 1 for m in node.inbox)
    node.inbox.clear()


def test_fuzzed_receiver_still_takes_valid_messages(fuzz_target):
    """The receiver the test above fuzzed; run without it (alone, or on another pytest-xdist
    worker), this test fuzzes the module's receiver itself first."""
    node, sender = fuzz_target
    if node.rejected < 1000:
        test_hostile_frames_never_crash_or_hang_a_live_receiver(fuzz_target)
    assert node.rejected >= 1000
    sender.send(bytes(64 * 1024 * 1024 // 32))  # over max_message_bytes: ZeroMQ drops it
    sender.send(valid_frame(round=7))
    (msg,) = node._recv(Recv(round=7))
    assert torch.equal(msg.tensors["w"], torch.arange(4.0))


def test_a_receive_whose_deadline_has_passed_takes_what_has_arrived():
    """Push-sum's late shares: a Recv with a deadline already past returns at once, with
    the frames that have reached the socket, not only those read in by an earlier wait."""
    node = live_node()
    sender = node.context.socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(node.endpoint)
    try:
        sender.send(valid_frame(round=3))
        assert node.inbox_socket.poll(5000)  # it has come; nothing has read it in yet
        start = time.monotonic()
        (msg,) = node._recv(Recv(before=4, count=10, deadline=node.now() - 1.0))
        assert msg.round == 3 and time.monotonic() - start < 1.0
        assert node._recv(Recv(before=4, count=10, deadline=node.now())) == []
    finally:
        sender.close()
        node.close()


def test_curve_keeps_out_a_process_without_the_key(tmp_path):
    keys = tmp_path / "keys"
    assert p2pfl("keys", str(keys), "--peers", "3").returncode == 0
    node = live_node(str(keys))
    friend = live_node(str(keys), node=0, to={1: node.endpoint})  # holds node 0's key pair
    intruder = node.context.socket(zmq.PUSH)
    intruder.setsockopt(zmq.LINGER, 0)
    stranger_public, stranger_secret = zmq.curve_keypair()
    intruder.curve_publickey, intruder.curve_secretkey = stranger_public, stranger_secret
    intruder.curve_serverkey = zmq.auth.load_certificate(keys / "1.key")[0]
    intruder.connect(node.endpoint)
    plain = node.context.socket(zmq.PUSH)
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(node.endpoint)
    for sock in (intruder, plain):
        with contextlib.suppress(zmq.Again):  # never connected: nothing to inject
            sock.send(valid_frame(round=5), flags=zmq.NOBLOCK)
    assert not node.inbox_socket.poll(1500)
    friend.outboxes[1].send(valid_frame(round=6))
    assert node.inbox_socket.poll(5000)
    node.receive()
    assert [m.round for m in node.inbox] == [6]
    for sock in (intruder, plain):
        sock.close()
    friend.close()
    node.close()


@pytest.mark.parametrize(
    ("remade", "cause"),
    [("0", "from a key not in"), ("1.key", "encrypted for another public key of 1")],
)
def test_a_wait_that_times_out_names_refused_curve_handshakes(tmp_path, remade, cause):
    """Another host's copy of the keys in which node 0's pair was made again (node 1 does
    not know its new key), or which holds another public key for node 1: node 0 cannot
    reach node 1, and node 1's timeout says why instead of blaming a dead peer."""
    keys, other, fresh = tmp_path / "keys", tmp_path / "other", tmp_path / "fresh"
    assert p2pfl("keys", str(keys), "--peers", "3").returncode == 0
    shutil.copytree(keys, other)
    fresh.mkdir()
    public, secret = zmq.auth.create_certificates(fresh, remade.removesuffix(".key"))
    shutil.copy(public, other)
    if remade == "0":
        shutil.copy(secret, other)
    node = live_node(str(keys), timeout_s=1.5)
    sender = live_node(str(other), node=0, to={1: node.endpoint})
    try:
        with pytest.raises(RunError, match=rf"\(its inbox refused CURVE handshakes: \d+ {cause}"):
            node._recv(Recv(round=6))
        quiet = live_node(str(keys), node=2, timeout_s=0.5)  # nobody tried: the old reason
        with pytest.raises(RunError, match=r"\(a peer died or never came up\?\)$"):
            quiet._recv(Recv(round=6))
        quiet.close()
    finally:
        sender.close(abort=True)
        node.close()


def test_every_shipped_experiment_has_a_transport_section_default():
    assert experiment().config["transport"]["timeout_s"] == 60.0


def test_a_multi_host_run_merged_has_the_outputs_of_a_launcher_run(tmp_path, capsys):
    """Two "hosts", one ``p2pfl peer`` command each (``--peer 0-1`` and ``--peer 2,3``: one
    forked process per node), into their own directories, copied together and merged: the
    summary, metrics and ledger a launcher run writes, with the simulation's final and
    per-peer accuracies and bytes; ``p2pfl plot`` reads it."""
    from p2pfl.app.cli import main
    from p2pfl.runtime.children import free_port

    path = write_experiment(
        tmp_path, topology={"kind": "ring"}, algorithm={"name": "dfedavgm", "rounds": 2},
        transport={"timeout_s": TIMEOUT},
    )  # fmt: skip
    addresses = tmp_path / "addresses.yaml"
    addresses.write_text(yaml.safe_dump({i: f"tcp://127.0.0.1:{free_port()}" for i in range(4)}))
    cmd = [sys.executable, "-m", "p2pfl", "peer", str(path), "--addresses", str(addresses)]
    hosts = {0: "A", 1: "A", 2: "B", 3: "B"}
    procs = [
        subprocess.Popen([*cmd, "--peer", nodes, "--out", str(tmp_path / h)], cwd=ROOT)
        for nodes, h in (("0-1", "A"), ("2,3", "B"))
    ]
    assert [p.wait(timeout=300) for p in procs] == [0] * 2
    merged = tmp_path / "merged"
    for i, h in hosts.items():
        shutil.copytree(tmp_path / h / "peers" / str(i), merged / "peers" / str(i))
    assert main(["merge", str(merged)]) == 0
    assert main(["run", str(path), "--out", str(tmp_path / "sim"), "--quiet"]) == 0
    real = json.loads((merged / "summary.json").read_text())
    sim = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert (real["status"], real["transport"]) == ("ok", "zmq")
    assert 0 <= real["start_spread_s"] < 60  # each host's clock started when it had built
    assert real["final"] == sim["final"] and real["per_peer"] == sim["per_peer"]
    assert real["comm"]["total_bytes"] == sim["comm"]["total_bytes"] > 0
    rows = (merged / "metrics.csv").read_text().splitlines()
    assert sum(",accuracy," in r for r in rows) == sum(
        ",accuracy," in r for r in (tmp_path / "sim" / "metrics.csv").read_text().splitlines()
    )
    assert main(["plot", str(merged)]) == 0
    capsys.readouterr()

    # merged already: refused in one line; --force merges again, the nodes' files kept
    assert main(["merge", str(merged)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["merge", str(merged), "--force"]) == 0
    assert json.loads((merged / "summary.json").read_text())["final"] == sim["final"]
    # a node missing, or nodes that ran different experiments: one line, nothing written
    shutil.rmtree(merged / "peers" / "3")
    capsys.readouterr()
    assert main(["merge", str(merged), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "node(s) 3" in err, err
    shutil.copytree(tmp_path / "B" / "peers" / "3", merged / "peers" / "3")
    config = merged / "peers" / "3" / "config.yaml"
    config.write_text(config.read_text().replace("seed: 0", "seed: 1", 1))
    assert main(["merge", str(merged), "--force"]) == 2
    assert "different experiments" in capsys.readouterr().err
    assert main(["merge", str(tmp_path / "nowhere")]) == 2
    assert "no peers/NAME/config.yaml" in capsys.readouterr().err
    # a spoilt node file: one line naming it (a result before anything is written)
    config.write_text((merged / "peers" / "2" / "config.yaml").read_text())
    result = merged / "peers" / "1" / "result.json"
    kept = result.read_text()
    spoilt_t0 = '{"status": "ok", "output": true, "baselines": {}, "t0": "noon"}'
    for garbage in ("garbage{", "[]", '{"status": "ok"}', spoilt_t0):
        result.write_text(garbage)
        assert main(["merge", str(merged), "--force"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "peers/1/result.json: not a node's result" in err, err
    result.write_text(kept)
    before = {p: p.read_bytes() for p in merged.iterdir() if p.is_file()}
    (merged / "peers" / "1" / "final.bin").write_bytes(b"not a frame" * 10)
    assert main(["merge", str(merged), "--force"]) == 2  # checked before anything is written
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "peers/1/final.bin: not a model frame" in err, err
    assert {p: p.read_bytes() for p in merged.iterdir() if p.is_file()} == before


def test_the_launcher_warms_up_without_autograd_before_it_forks(monkeypatch):
    """Autograd's engine, once started on a host with a GPU, refuses to run in a forked
    child: the launcher's warm-up before the fork takes an optimizer step with no backward
    pass (each peer runs its own)."""
    setup = build(experiment())

    def no_backward(*args, **kwargs):
        raise AssertionError("backward before the fork")

    monkeypatch.setattr(torch.Tensor, "backward", no_backward)
    warm_up(setup, forks=True)
    with pytest.raises(AssertionError, match="backward before the fork"):
        warm_up(setup)  # a peer's own warm-up does run it


def test_a_device_that_cannot_start_is_one_error_line(monkeypatch):
    """A peer whose CUDA context does not fit (out of memory) says so in one line."""
    setup = build(experiment())

    def full(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ...")

    monkeypatch.setattr(torch, "zeros", full)
    with pytest.raises(RunError, match=rf"^{DEVICE['name']}: CUDA error: out of memory$"):
        warm_up(setup)


def started_peers(tmp_path: Path, nodes: str) -> tuple[subprocess.Popen, list[str], Path]:
    """``p2pfl peer`` for ``nodes`` of a long DFedAvgM ring, into ``tmp_path/out``, in its
    own process group, once every node's files are open; also its arguments but --peer."""
    from p2pfl.runtime.children import free_port

    algorithm = {"name": "dfedavgm", "rounds": 100_000}
    path = write_experiment(tmp_path, topology={"kind": "ring"}, algorithm=algorithm)
    addresses = tmp_path / "addresses.yaml"
    addresses.write_text(yaml.safe_dump({i: f"tcp://127.0.0.1:{free_port()}" for i in range(4)}))
    out = tmp_path / "out"
    cmd = ["peer", str(path), "--addresses", str(addresses), "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pfl", *cmd, "--peer", nodes],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    first, _, last = nodes.partition("-")
    while not all(
        (out / "peers" / str(n) / "comm.csv").is_file()
        for n in range(int(first), int(last or first) + 1)
    ):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "the peers never got going"
        time.sleep(0.2)
    return proc, cmd, out


def test_a_second_command_for_a_running_node_is_refused_and_touches_nothing(tmp_path, capsys):
    """Issue: a second ``p2pfl peer --peer 0`` truncated the live node 0's files and wrote a
    failed ``result.json``; now one error line naming it, and its files are as they were."""
    from p2pfl.app.cli import main

    proc, argv, out = started_peers(tmp_path, "0")
    try:
        mine = out / "peers" / "0"
        before = {p.name: p.read_bytes() for p in mine.iterdir()}
        for nodes in ("0", "0-1"):
            assert main([*argv, "--peer", nodes]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "node 0 is already running in" in err, err
            now = {p.name: p.read_bytes() for p in mine.iterdir()}  # the live node may append
            assert now.keys() == before.keys() and all(now[k].startswith(before[k]) for k in now)
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_merge_names_a_bad_row_in_one_short_line(tmp_path, capsys):
    """Issue: a node file with a row a node never writes (NUL bytes, after a truncation) made
    ``p2pfl merge`` fail with the whole row in its error line; now one short line naming the
    file, before anything is written."""
    from p2pfl.app.cli import main

    config = yaml.safe_dump(build(experiment()).config, sort_keys=False)
    result = json.dumps({"status": "ok", "output": True, "baselines": {}})
    for name in ("0", "1", "2", "3", "server"):
        mine = tmp_path / "peers" / name
        mine.mkdir(parents=True)
        (mine / "config.yaml").write_text(config)
        (mine / "result.json").write_text(result)
        (mine / "metrics.csv").write_text("time,round,peer,metric,value\r\n0.5,1,0,loss,2.1\r\n")
    comm = "time,round,src,dst,kind,bytes,arrival\r\n1,1,0,server,model,9\r\n"
    for file, text in (
        ("metrics.csv", "time,round,peer,metric,value\r\n" + "\0" * 100_000 + "1,1,0,loss,2\r\n"),
        ("comm.csv", comm),
    ):
        (tmp_path / "peers" / "2" / file).write_text(text)
        assert main(["merge", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and len(err) < 200, err[:300]
        assert f"peers/2/{file}: line 2: not a row a node writes" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["peers"]
        (tmp_path / "peers" / "2" / file).unlink()


@pytest.mark.parametrize(
    "table,message",
    [
        ({0: 1, 1: 1, 2: 2, 3: 3}, "1: the same address as node 0: tcp://127.0.0.1:27561"),
        ({0: 99_999, 1: 1, 2: 2, 3: 3}, "0: port 99999 is not in 1..65535"),
        ({0: 0, 1: 1, 2: 2, 3: 3}, "0: port 0 is not in 1..65535"),
        ({0: 1, "00": 2, 1: 3, 2: 4, 3: 5}, "00: node 0 is given twice"),
    ],
)
def test_addresses_that_cannot_all_be_bound_are_a_config_error(tmp_path, table, message):
    """Issue: two nodes on one endpoint, or a port out of range (ZeroMQ took another), ran
    and timed out; now a ``ConfigError`` before anything starts."""
    from p2pfl.core.errors import ConfigError
    from p2pfl.runtime.launcher import read_addresses

    setup = build(experiment(topology={"kind": "ring"}, algorithm={"name": "dfedavgm"}))
    path = tmp_path / "addresses.yaml"
    ports = {k: p if p in (0, 99_999) else 27560 + p for k, p in table.items()}
    path.write_text(yaml.safe_dump({k: f"tcp://127.0.0.1:{p}" for k, p in ports.items()}))
    with pytest.raises(ConfigError, match=f"addresses.yaml: {message}"):
        read_addresses(path, setup)


def test_hosts_started_apart_share_one_clock_with_start_at(tmp_path):
    """Two "hosts" started 2 s apart, both with ``--start-at``: every node's clock starts at
    that time (its ``result.json`` says so), so their times are comparable; the merge says
    how far apart the nodes' starts were (0 here) and equals the simulation."""
    from p2pfl.app.cli import main
    from p2pfl.runtime.children import free_port

    path = write_experiment(
        tmp_path, topology={"kind": "ring"}, algorithm={"name": "dfedavgm", "rounds": 1},
        # on the CPU: a CUDA context per node, beside a busy suite, can come after the start
        peers={"count": 4, "device": "cpu"},
    )  # fmt: skip
    addresses = tmp_path / "addresses.yaml"
    addresses.write_text(yaml.safe_dump({i: f"tcp://127.0.0.1:{free_port()}" for i in range(4)}))
    start = round(time.time() + 12, 3)  # after both hosts' imports and builds
    cmd = [sys.executable, "-m", "p2pfl", "peer", str(path), "--addresses", str(addresses)]
    procs = []
    for nodes in ("0-1", "2-3"):
        procs.append(
            subprocess.Popen(
                [*cmd, "--peer", nodes, "--out", str(tmp_path / "run"), "--start-at", str(start)],
                cwd=ROOT,
            )
        )
        time.sleep(2)
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    results = [json.loads((tmp_path / f"run/peers/{i}/result.json").read_text()) for i in range(4)]
    assert [(r["t0"], r["late_s"]) for r in results] == [(start, 0.0)] * 4
    assert time.time() - start > max(r["elapsed_s"] for r in results)  # timed from the start
    for i in range(4):  # host A's nodes, on a clock of their own, would wait 2 s for B's
        rows = (tmp_path / f"run/peers/{i}/comm.csv").read_text().splitlines()[1:]
        assert 0 <= min(float(r.split(",")[-1]) for r in rows) < 1.5, rows
    assert main(["merge", str(tmp_path / "run")]) == 0
    real = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert real["status"] == "ok" and real["start_spread_s"] == 0.0
    assert main(["run", str(path), "--out", str(tmp_path / "sim"), "--quiet"]) == 0
    sim = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert real["final"] == sim["final"]


def test_a_host_ready_after_its_start_time_says_so(tmp_path, capfd):
    """A start time that passed while the nodes were built: they run at once, on the shared
    clock, and say how late they were (stderr, result.json, the merge's start_spread_s)."""
    from p2pfl.app.cli import main
    from p2pfl.runtime import launcher
    from p2pfl.runtime.children import free_port

    if forks_refused():  # the command line refuses a passed start: the nodes fork from here
        pytest.skip(AFTER_CUDA)
    setup = build(
        experiment(
            topology={"kind": "ring"}, algorithm={"name": "dfedavgm", "rounds": 1},
            transport={"timeout_s": TIMEOUT},
        )
    )  # fmt: skip
    addresses = {i: f"tcp://127.0.0.1:{free_port()}" for i in range(4)}
    out, nodes = tmp_path / "run", [0, 1, 2, 3]
    with launcher.claimed(setup, nodes, out):
        procs = launcher.fork_nodes(setup, nodes, out, addresses, start_at=time.time() - 1)
        assert launcher.wait_nodes(procs, setup, out) == 0
    assert capfd.readouterr().err.count("s after --start-at") == 4
    late = [json.loads((out / f"peers/{i}/result.json").read_text())["late_s"] for i in nodes]
    assert all(s >= 1 for s in late)
    assert main(["merge", str(out)]) == 0
    spread = json.loads((out / "summary.json").read_text())["start_spread_s"]
    assert spread == pytest.approx(max(late) - min(late))


@pytest.mark.parametrize(
    "when,message",
    [
        ("soon", "'soon' is neither Unix seconds nor an ISO 8601 time"),
        ("2030-01-01T09:00:00", "has no time zone: add Z or +HH:MM"),
        ("1", "1 is passed"),
        ("2020-01-01T09:00:00Z", "is passed"),
        (str(time.time() + 200_000), "is more than a day ahead"),
        ("nan", "'nan' is not a time"),
        ("-inf", "'-inf' is not a time"),
    ],
    # fixed names: a name holding the time differs between pytest-xdist workers
    ids=["words", "no-zone", "unix-past", "iso-past", "day-ahead", "nan", "minus-inf"],
)
def test_a_bad_start_time_is_one_line_before_anything_is_written(tmp_path, capsys, when, message):
    from p2pfl.app.cli import main

    path = write_experiment(tmp_path, topology={"kind": "ring"}, algorithm={"name": "dfedavgm"})
    addresses = tmp_path / "addresses.yaml"
    addresses.write_text(yaml.safe_dump({i: f"tcp://127.0.0.1:{27570 + i}" for i in range(4)}))
    out = tmp_path / "out"
    argv = ["peer", str(path), "--addresses", str(addresses), "--out", str(out), "--peer", "0"]
    assert main([*argv, f"--start-at={when}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--start-at" in err and message in err, err
    assert not out.exists()


def test_a_node_of_a_peer_command_that_dies_ends_it_at_once(tmp_path):
    """Issue: ``p2pfl peer --peer 0-3`` waited out ``transport.timeout_s`` when a node was
    killed, and did not name it; now it ends at once naming it, the others stopped."""
    proc, _, out = started_peers(tmp_path, "0-3")
    try:
        pids = peer_pids(proc.pid)
        assert set(pids) == {"0", "1", "2", "3"}
        os.kill(pids["2"], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=TIMEOUT)
        assert time.monotonic() - killed < 10, err
        assert proc.returncode == 1
        assert err.strip().splitlines()[-1] == "error: peer 2 died (signal 9)", err
        assert still_running(pids) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
