"""The ZeroMQ runtime: one node's behaviour in its own process, over real TCP sockets.

Each node binds one PULL socket (its inbox) and connects one PUSH socket to every
neighbour. ``Send`` encodes the message at the choke point (``wire.encode_parts``) and
hands its parts to ZeroMQ as one multipart message without copying the tensors.
``Recv`` polls the inbox with the configured timeout and consumes messages exactly as
the simulation does (``mailbox.take``), so the same seed gives the same models. Frames
that fail to decode, that claim a sender that is not a neighbour, a ``model`` message that
is not the model, an oversized ``meta``, a round outside the node's round window, or a frame
that finds its sender's backlog full of messages the node needs more are dropped at the
door, counted by sender and cause, and logged (:meth:`ZmqNode.accept`): a flood costs a
bounded memory and never displaces the message a node waits for. With
``transport.curve_keys`` every socket uses CURVE encryption, only holders of a listed key
can connect, and a frame's sender must be the node whose key sent it.

With a ``network:`` section every process builds the same seeded :class:`Network` and lives
it in wall-clock time: an offline node drops what reaches it (recorded as ``offline``) and
its next ``Send``, ``Train`` or ``Compute`` waits until it is back; a message its link loses,
one across a partition, or one to a peer known to have crashed is not sent at all (the sender
records it, with the bytes it would have cost). Crashes are real: the launcher kills the
process at its time (and a node that finds itself past its crash time stops). Latency jitter
is the real network's own; the drawn one is not added.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Generator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from p2pfl.core.errors import ConfigError, RunError
from p2pfl.methods.effects import Behaviour, Compute, Effect, Finish, Recv, Send, Train
from p2pfl.network.codecs import Compression, choose
from p2pfl.network.dynamics import Network
from p2pfl.network.ledger import Ledger
from p2pfl.network.message import Message
from p2pfl.network.topology import Topology
from p2pfl.network.wire import WireError, decode, encode_parts
from p2pfl.runtime.interpreter import Interpreter, run_blocking
from p2pfl.runtime.mailbox import describe, matches, take
from p2pfl.runtime.setup import StopConfig, TransportConfig
from p2pfl.runtime.worker import Worker

log = logging.getLogger("p2pfl.transport")


MAX_BACKLOG = 256
"""Messages of one sender a node keeps waiting to be taken; more are dropped (a flood)."""

MAX_BACKLOG_BYTES = 256 << 20
"""Tensor bytes of one sender's messages a node keeps waiting to be taken (or four models'
worth, if that is more; one message alone may exceed it)."""

ROUND_WINDOW = 16
"""A frame's round is at most this far past both the run's rounds and the node's own latest
round (and not negative): later rounds are no protocol's, so a flood cannot fill a backlog."""

MAX_META_BYTES = 64 << 10
"""The largest ``meta`` (as compact JSON) a received message may carry."""

SERVE_POLL_MS = 5
"""How often a serving node that trains looks at its inbox (milliseconds at most)."""


class CurveKeys:
    """CURVE key pairs from a directory: ``NAME.key`` (public) and ``NAME.key_secret``."""

    def __init__(self, directory: str, name: str) -> None:
        self.directory = Path(directory)
        secret = self.directory / f"{name}.key_secret"
        if not secret.is_file():
            raise ConfigError("transport.curve_keys", f"no secret key {secret}")
        self.public, private = _load_key(secret)
        if private is None:
            raise ConfigError("transport.curve_keys", f"{secret} holds no secret key")
        self.secret: bytes = private

    def public_of(self, name: str) -> bytes:
        path = self.directory / f"{name}.key"
        if not path.is_file():
            raise ConfigError("transport.curve_keys", f"no public key {path}")
        return _load_key(path)[0]


def _load_key(path: Path) -> tuple[bytes, bytes | None]:
    """A key file's (public, secret) keys, each 40 Z85 characters (32 bytes) once checked."""
    try:
        public, secret = zmq.auth.load_certificate(path)
        for key in (public, secret):
            if key is not None and len(z85.decode(key)) != 32:
                raise ValueError("a key is 40 Z85 characters")
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise ConfigError("transport.curve_keys", f"{path}: not a CURVE key file ({e})") from None
    return public, secret


def check_curve_keys(transport: TransportConfig, topology: Topology, nodes: Iterable[int]) -> None:
    """Load, up front, every CURVE key that ``nodes`` will: each one's own pair and every
    other node's public key (its inbox knows every sender; a ``ConfigError`` naming the
    missing or broken file)."""
    mine = set(nodes)
    if transport.curve_keys is None or not mine:
        return
    for node in sorted(mine):
        keys = CurveKeys(transport.curve_keys, topology.name(node))
    others = set(topology.graph.nodes) - (mine if len(mine) == 1 else set())
    for other in sorted(others):  # each file once: a launcher checks every node's
        keys.public_of(topology.name(other))


Schema = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""A model's tensor names with their shapes and dtypes: what a received model must hold."""


def model_schema(module: torch.nn.Module) -> Schema:
    """The :data:`Schema` of ``module``'s state."""
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


def check_tensors(
    kind: str, tensors: Mapping[str, torch.Tensor], schema: Schema, stacked: bool = True
) -> None:
    """A tensor named like a model tensor has its shape and dtype; a ``model`` message
    holds the whole model and nothing else, or (``stacked``) whole models stacked as
    ``i/name`` (candidates sent to vote on), so no method is handed a model it cannot load:
    a ``WireError`` naming the first tensor that is not so."""
    for k, t in tensors.items():
        name = k.split("/", 1)[1] if kind == "model" and stacked and "/" in k else k
        if name in schema and (tuple(t.shape), t.dtype) != schema[name]:
            shape, dtype = schema[name]
            raise WireError(
                f"{kind} tensor {k!r} is {t.dtype}{list(t.shape)}, the model's is "
                f"{dtype}{list(shape)}"
            )
    if kind != "model" or not schema or tensors.keys() == schema.keys():
        return
    if not stacked:
        odd = sorted(tensors.keys() ^ schema.keys())
        raise WireError(f"model message is not the model (tensor {odd[0]!r})")
    copies = max(1, -(-len(tensors) // len(schema)))  # whole models it holds
    whole = {f"{i}/{k}" for i in range(copies) for k in schema}
    if tensors.keys() != whole:
        odd = sorted((tensors.keys() ^ whole) - schema.keys())
        first = odd[0] if odd else next(iter(tensors), "")
        raise WireError(f"model message is not the model (tensor {first!r})")


class Halted(Exception):
    """A ``stop:`` condition was met at this node (its key: ``time_s``, ``samples``)."""


class Crashed(RunError):
    """This node reached its crash time (``network.crashes``) or left for good."""


class ZmqNode(Interpreter):
    """Runs one node's behaviour over sockets; local effects go to the shared ``Worker``."""

    def __init__(
        self,
        node: int,
        topology: Topology,
        worker: Worker,
        ledger: Ledger,
        transport: TransportConfig,
        compression: Compression | None = None,
        network: Network | None = None,
        schema: Schema | None = None,
        rounds: int = 0,
        stop: StopConfig | None = None,
    ) -> None:
        super().__init__()
        self.node = node
        self.network = network
        self.topology = topology
        self.worker = worker
        self.ledger = ledger
        self.transport = transport
        self.compression = compression
        self.name = topology.name(node)
        self.t0 = time.time()
        self.context = zmq.Context()
        self.keys = CurveKeys(transport.curve_keys, self.name) if transport.curve_keys else None
        self.auth: ThreadAuthenticator | None = None
        self.inbox_socket = self.context.socket(zmq.PULL)
        self.inbox_socket.setsockopt(zmq.MAXMSGSIZE, transport.max_message_bytes)
        self.inbox_socket.setsockopt(zmq.LINGER, 0)
        self.outboxes: dict[int, zmq.Socket] = {}
        self.inbox: list[Message] = []
        self.schema = schema or {}
        model_bytes = sum(math.prod(s) * d.itemsize for s, d in self.schema.values())
        self.backlog_bytes = max(MAX_BACKLOG_BYTES, 4 * model_bytes)
        self.rounds = rounds  # the run's (the method's total_rounds)
        self.stop_cfg = stop
        self.keep_latest = stop is not None
        self.stop_at = stop.time_s if stop is not None and stop.time_s is not None else math.inf
        self.halted: str | None = None  # why a stop: section ended this node
        self.round = 0  # the latest round this node's own effects named
        self.dropped: Counter[tuple[int | None, str]] = Counter()  # (claimed sender, cause)
        self.stop: Message | None = None  # the last stop frame the behaviour took
        self.senders: dict[str, int] = {}  # CURVE user id (z85 public key) -> node
        self.handshakes: zmq.Socket | None = None  # the inbox's failed CURVE handshakes
        self.refused = {"key": 0, "crypto": 0}  # ... counted by cause (refusals())

    def bind(self, endpoint: str) -> str:
        """Bind the inbox (``tcp://host:*`` picks a free port); return the real endpoint."""
        if self.keys:
            others = [j for j in sorted(self.topology.graph.nodes) if j != self.node]
            for j in others:
                z85 = self.keys.public_of(self.topology.name(j))  # as the ZAP handler names it
                self.senders[z85.decode("ascii")] = j
            self.auth = ThreadAuthenticator(self.context)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=str(self.keys.directory))
            self.inbox_socket.curve_server = True
            self.inbox_socket.curve_publickey = self.keys.public
            self.inbox_socket.curve_secretkey = self.keys.secret
            failed = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            self.handshakes = self.inbox_socket.get_monitor_socket(failed)
        self.inbox_socket.bind(endpoint)
        return self.inbox_socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, addresses: dict[int, str]) -> None:
        """Open a PUSH socket to every neighbour's inbox (to every node, when the network
        redraws the graph)."""
        timeout_ms = int(self.transport.timeout_s * 1000)
        others = self.topology.neighbours(self.node)
        if self.network is not None and self.network.changes_graph:
            others = [j for j in sorted(self.topology.graph.nodes) if j != self.node]
        for j in others:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
            sock.setsockopt(zmq.LINGER, timeout_ms)  # deliver what is queued before closing
            if self.keys:
                sock.curve_publickey = self.keys.public
                sock.curve_secretkey = self.keys.secret
                sock.curve_serverkey = self.keys.public_of(self.topology.name(j))
            sock.connect(addresses[j])
            self.outboxes[j] = sock

    def now(self) -> float:
        """Wall-clock seconds since the run's start (shared by every node of a run)."""
        return time.time() - self.t0

    def run(self, behaviour: Behaviour) -> Finish:
        """Drive the behaviour to its end; a timeout or bad send raises ``RunError``, and so
        does a method that fails on the messages it was just handed (:meth:`resume`)."""
        try:
            run_blocking(self.drive(self.node, behaviour))
        except Halted as e:  # a stop: section's condition: the node keeps its latest model
            self.halted = str(e)
            self.stopped_finals([self.node])
        finish = self.finals.get(self.node)
        if finish is None:
            raise RunError(f"{self.name} ended without declaring its final model")
        return finish

    def resume(self, node: int, gen: Behaviour, value: Any) -> Effect:
        """The behaviour's next effect. A frame in a neighbour's name is believed, and a
        well-formed one may still hold what the method cannot use (a ``meta`` weight that
        is no number): a method that fails on the messages it was just handed names them,
        in one line."""
        try:
            return gen.send(value)
        except StopIteration:
            raise
        except Exception as e:
            if not (isinstance(value, list) and value and isinstance(value[0], Message)):
                raise
            name = self.topology.name
            took = [f"a {m.kind} frame from {name(m.src)} at round {m.round}" for m in value]
            took = took[:3] + ["..."] * (len(took) > 3)
            raise RunError(
                f"{self.name}'s method failed on what it received ({', '.join(took)}): "
                f"{type(e).__name__}: {e}"
            ) from None

    @property
    def clock(self) -> float:
        return self.now()

    def before(self, node: int, eff: Effect) -> Generator[None, None, None]:
        """Note the latest round the node named (its round window); with a network, stop
        at the crash time and, before an action, wait while offline."""
        if self.halted or self.now() >= self.stop_at:
            raise Halted(self.halted or "time_s")
        if isinstance(r := getattr(eff, "round", None), int) and r > self.round:
            self.round = r
        if self.network is not None:
            self._live(isinstance(eff, (Send, Train, Compute)))
        yield from ()

    def send(self, node: int, eff: Send) -> None:
        self._send(eff)

    def recv(self, node: int, eff: Recv) -> Generator[None, None, list[Message]]:
        yield from ()
        return self._recv(eff)

    def sleep(self, node: int, until: float) -> Generator[None, None, None]:
        yield from ()
        self._drain_until(until)

    def compute(self, node: int, eff: Train | Compute) -> Generator[None, None, Any]:
        """Run it here; a node that serves (``Serve``) trains in a thread meanwhile and
        answers what arrives from this one, between the behaviour's steps as always."""
        yield from ()
        if node not in self.servers:
            value = self.worker.perform(node, eff, self.now())[0]
        else:
            with ThreadPoolExecutor(1, thread_name_prefix=f"p2pfl-{self.name}") as pool:
                job = pool.submit(self.worker.perform, node, eff, self.now())
                while not job.done():
                    if self.inbox_socket.poll(SERVE_POLL_MS):
                        self.receive()
                value = job.result()[0]
        share = self.stop_cfg.samples if self.stop_cfg is not None else None
        if isinstance(eff, Train) and share is not None:
            self.trained(value)  # each node counts its own, against its share of the total
            if self.samples * self.topology.num_peers >= share:
                self.halted = "samples"
        return value

    def _live(self, acts: bool) -> None:
        """Stop at the crash time; before an action (``acts``), wait while offline."""
        net = self.network
        assert net is not None
        if net.crashed(self.node, self.now()):
            raise Crashed(f"{self.name} crashed at t={net.crash_at[self.node]:g}s")
        if acts and not net.online(self.node, self.now()):
            back = net.next_online(self.node, self.now())
            if back == float("inf"):
                raise Crashed(f"{self.name} went offline for good")
            self._drain_until(back)

    def _drain_until(self, until: float) -> None:
        """Sleep until ``until`` on the run's clock, taking in (or, offline, dropping) frames."""
        while (remaining := min(until, self.stop_at) - self.now()) > 0:
            if self.inbox_socket.poll(max(1, int(remaining * 1000))):
                self.receive()

    def close(self, abort: bool = False) -> None:
        """Close every socket: after a finished behaviour, deliver what is queued first (up to
        the timeout); ``abort`` (the run failed or is being stopped) drops it at once. A
        peer that may be gone never takes what is queued for it: with a ``network:``
        section, and after a ``stop:`` condition (every peer stops at ``time_s``, and its
        last frames may be to a neighbour that has already closed), at most 2 s are given."""
        linger = None
        if self.network is not None or self.halted is not None:
            linger = min(2000, int(self.transport.timeout_s * 1000))
        if abort:
            linger = 0
        if linger is not None:
            for sock in self.outboxes.values():
                sock.setsockopt(zmq.LINGER, linger)
        for sock in self.outboxes.values():
            sock.close()  # waits up to LINGER for queued frames
        if self.handshakes is not None:
            self.inbox_socket.disable_monitor()
            self.handshakes.close(linger=0)
        self.inbox_socket.close()
        if self.auth:
            self.auth.stop()
        self.context.term()

    def _send(self, eff: Send) -> None:
        if eff.dst not in self.outboxes:
            raise RunError(f"{self.name} sent to {self.topology.name(eff.dst)}, not a neighbour")
        msg = Message(eff.kind, self.node, eff.dst, eff.round, eff.tensors, eff.meta)
        try:
            compression = choose(self.compression, eff.kind, eff.codec)
            parts = encode_parts(msg, compression)
            if self.network is not None and (fate := self._fate_at_send(eff)) is not None:
                now, size = self.now(), sum(memoryview(p).nbytes for p in parts)
                name = self.topology.name
                self.ledger.record(
                    now, msg.round, self.name, name(eff.dst), msg.kind, size, now, fate
                )
                self.ledger.flush()
                return
            self.outboxes[eff.dst].send_multipart(parts, copy=False)
        except zmq.Again:
            raise RunError(
                f"{self.name} could not hand a message to {self.topology.name(eff.dst)} "
                f"within {self.transport.timeout_s:g} s"
            ) from None

    def _fate_at_send(self, eff: Send) -> str | None:
        """What the network does to this message before it leaves (``None``: it goes): the
        simulation's fate, judged by the sender now (its arrival is the real network's)."""
        net, now = self.network, self.now()
        assert net is not None
        fate, lost, _ = net.departure(self.node, eff.dst, eff.round, now)
        if fate is None:
            fate = net.fate(self.node, eff.dst, now, now, lost, receiver=False)
        return None if fate == "delivered" else fate

    def _recv(self, recv: Recv) -> list[Message]:
        if recv.deadline is not None:
            self._drain_until_taken(recv)
            return self._took(take(self.inbox, recv, partial=True) or [])
        deadline = time.monotonic() + self.transport.timeout_s
        while (got := take(self.inbox, recv)) is None:
            if self.now() >= self.stop_at:
                raise Halted("time_s")
            remaining = min(deadline - time.monotonic(), self.stop_at - self.now())
            if remaining <= 0:
                raise RunError(
                    f"{self.name} waited {self.transport.timeout_s:g} s for "
                    f"{describe(recv, self.topology.name)} ({self.refusals()})"
                )
            if self.inbox_socket.poll(max(1, int(remaining * 1000))):
                self.receive()
        return self._took(got)

    def _took(self, msgs: list[Message]) -> list[Message]:
        """``msgs``, handed to the behaviour; a stop among them (a ``control`` message whose
        meta says ``"stop": true``) is remembered, to name it if the run then fails."""
        for m in msgs:
            if m.kind == "control" and m.meta.get("stop") is True:
                self.stop = m
        return msgs

    def refusals(self) -> str:
        """Why a wait may have timed out: the CURVE handshakes this node's inbox refused
        (a stranger's count too, but a peer whose keys differ on its host is the usual
        cause) and the frames it dropped at the door (a flood in a peer's name), or else a
        peer that died or never came up."""
        while self.handshakes is not None and self.handshakes.poll(0):
            event = recv_monitor_message(self.handshakes)["event"]
            self.refused["key" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "crypto"] += 1
        key, crypto = self.refused["key"], self.refused["crypto"]
        hints = []
        if key + crypto:
            causes = [
                f"{key} from a key not in {self.transport.curve_keys}" if key else "",
                f"{crypto} encrypted for another public key of {self.name}" if crypto else "",
            ]
            hints.append(
                f"its inbox refused CURVE handshakes: {', '.join(c for c in causes if c)}; "
                "do all hosts hold the same keys?"
            )
        if self.dropped:
            hints.append(f"it dropped {self.drops()}")
        return "; ".join(hints) or "a peer died or never came up?"

    @property
    def rejected(self) -> int:
        """How many frames this node dropped (at the door, or from a full backlog)."""
        return sum(self.dropped.values())

    def drops(self) -> str:
        """The dropped frames in words, by claimed sender and cause, e.g. ``300 frames in
        0's name (300 beyond the round window): a flood?``."""
        senders = sorted({src for src, _ in self.dropped}, key=lambda s: (s is None, s or 0))
        parts = []
        for src in senders:
            causes = {c: n for (s, c), n in self.dropped.items() if s == src}
            who = "of no known sender" if src is None else f"in {self.topology.name(src)}'s name"
            why = ", ".join(f"{n} {c}" for c, n in sorted(causes.items()))
            parts.append(f"{sum(causes.values())} frame(s) {who} ({why})")
        return "; ".join(parts) + (": a flood?" if self.rejected >= 10 else "")

    def report(self) -> dict[str, Any]:
        """What this node's ``result.json`` says of the frames it dropped and the stop it
        took: ``rejected_frames``, ``rejected`` (per claimed sender, per cause) and ``stop``."""
        name = self.topology.name
        by: dict[str, dict[str, int]] = {}
        for (src, cause), n in sorted(self.dropped.items(), key=lambda i: (str(i[0][0]), i[0][1])):
            by.setdefault("?" if src is None else name(src), {})[cause] = n
        out: dict[str, Any] = {"rejected_frames": self.rejected, "rejected": by}
        if self.stop is not None:
            out["stop"] = {"from": name(self.stop.src), "round": self.stop.round}
        if self.halted is not None:
            out["stopped"] = self.halted
        return out

    def _drain_until_taken(self, recv: Recv) -> None:
        """Take in frames until ``recv`` is satisfied or its deadline has passed (an endless
        one: the transport timeout, as far as a process can tell that the run is over)."""
        assert recv.deadline is not None
        deadline = recv.deadline
        if deadline == float("inf"):
            deadline = self.now() + self.transport.timeout_s
        deadline = min(deadline, self.stop_at)
        while self.inbox_socket.poll(0):  # what has arrived counts, even past the deadline
            self.receive()
        while not sum(matches(recv, m) for m in self.inbox) >= recv.count:
            remaining = deadline - self.now()
            if remaining <= 0:
                return
            if self.inbox_socket.poll(max(1, int(remaining * 1000))):
                self.receive()

    def receive(self) -> None:
        """Receive one multipart frame from the inbox and ``accept`` it."""
        frames = self.inbox_socket.recv_multipart(copy=False)
        key = str(frames[0].get("User-Id")) if self.keys else None  # set by the CURVE handshake
        self.accept([f.buffer for f in frames], key)

    def accept(self, parts: list[memoryview], key: str | None = None) -> Message | None:
        """Decode and check one multipart frame; keep it, or drop it with a logged reason.

        It must come to this node from a neighbour (under CURVE: from the key of the node it
        names as its sender), hold the model's shapes and dtypes for every model tensor it
        names (a ``model`` message: the whole model, :func:`check_tensors`), carry a meta
        of at most ``MAX_META_BYTES``, name a round in the node's window (0 to
        ``ROUND_WINDOW`` past the run's rounds and its own) and find room in its sender's
        backlog (:meth:`_make_room`)."""
        size = sum(p.nbytes for p in parts)
        src: int | None = None
        cause = "malformed"
        try:
            if size > self.transport.max_message_bytes:
                raise WireError(f"{size} bytes exceed transport.max_message_bytes")
            msg = decode(parts, self.transport.max_message_bytes)  # tensors view the frames
            cause = "misrouted"
            if msg.dst != self.node or msg.src not in self.outboxes:
                raise WireError(f"unexpected route {msg.src} -> {msg.dst}")
            if self.keys is not None and self.senders.get(key or "") != msg.src:
                raise WireError(f"claims to come from {msg.src}, but its CURVE key is not theirs")
            src, cause = msg.src, "not the model"
            check_tensors(msg.kind, msg.tensors, self.schema)
            cause = "oversized meta"
            meta = len(json.dumps(msg.meta, separators=(",", ":")))
            if meta > MAX_META_BYTES:
                raise WireError(f"a meta of {meta} bytes exceeds {MAX_META_BYTES}")
            cause, last = "beyond the round window", max(self.round, self.rounds) + ROUND_WINDOW
            if not 0 <= msg.round <= last:
                raise WireError(f"round {msg.round} is outside this node's window 0..{last}")
            cause = "over the backlog"
            self._make_room(msg)
        except WireError as e:
            self._drop(src, cause, f"a frame of {size} bytes", str(e))
            return None
        now = self.now()
        name = self.topology.name
        offline = self.network is not None and not self.network.online(self.node, now)
        fate = "offline" if offline else "delivered"
        self.ledger.record(now, msg.round, name(msg.src), self.name, msg.kind, size, now, fate)
        self.ledger.flush()  # a peer that is killed later keeps what it recorded
        if offline:
            return None
        if not self.serves(self.node, msg):
            self.inbox.append(msg)
        return msg

    def _need(self, msg: Message) -> tuple[int, int]:
        """How little this node needs ``msg`` (larger: less): a round at or after its own
        latest, the nearer the more; a past round least, the older the less."""
        ahead = msg.round - self.round
        return (0, ahead) if ahead >= 0 else (1, -ahead)

    def _make_room(self, msg: Message) -> None:
        """Keep each sender's waiting messages within ``MAX_BACKLOG`` and the byte bound:
        while ``msg`` does not fit, the waiting message this node needs least (the newest
        of equals) is dropped for it if needed less, else ``msg`` is refused (a
        ``WireError``). A flood's frames, rounds ahead of the awaited one, so never
        displace it."""

        def held(m: Message) -> int:
            return sum(t.nbytes for t in m.tensors.values())

        mine = [m for m in self.inbox if m.src == msg.src]
        while mine and (
            len(mine) >= MAX_BACKLOG or sum(map(held, mine)) + held(msg) > self.backlog_bytes
        ):
            worst = max(reversed(mine), key=self._need)
            if self._need(msg) >= self._need(worst):
                raise WireError(
                    f"{len(mine)} messages of {sum(map(held, mine))} bytes from {msg.src} "
                    "already wait to be taken"
                )
            mine = [m for m in mine if m is not worst]
            self.inbox = [m for m in self.inbox if m is not worst]
            self._drop(msg.src, "over the backlog", f"a waiting frame of round {worst.round}", "")

    def _drop(self, src: int | None, cause: str, what: str, why: str) -> None:
        """Count a dropped frame; log the first of each sender and cause, the tenth, the
        hundredth, ... (a flood is reported, not logged frame by frame)."""
        self.dropped[src, cause] += 1
        n = self.dropped[src, cause]
        if n == 10 ** (len(str(n)) - 1):
            who = "" if src is None else f" in {self.topology.name(src)}'s name"
            why = f": {why}" if why else ""
            log.warning("%s dropped %s%s%s (%s: %d so far)", self.name, what, who, why, cause, n)
