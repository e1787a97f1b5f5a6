"""A population sharded across ranks (``--shard``): each rank holds only its own peers' models.

Without ``--shard`` every rank of :mod:`p2pfl.runtime.ranks` holds every peer's model and
trains a share. With it, peer ``p`` of ``N`` belongs to rank ``p·world // N`` (contiguous
blocks; a server to rank 0), and a rank's memory for models falls as 1/world:

- Every rank still runs the whole SimPy simulation, every node's behaviour included, in the
  same event order: the clock, the ledger, the network's draws and every decision a method
  takes on figures (accuracies, counts, its own metadata) are replicated, which is what keeps
  the outputs byte-identical to one process. Only the tensors are sharded: a peer another
  rank owns is a *ghost* here, its models ``meta`` tensors (a layout, no bytes) that flow
  through the method's code, the wire's size and the mixing like real ones.
- A training is computed by its peer's owner; its figures (validation accuracy, samples)
  travel to every rank, its model does not. Evaluations are scored by the owner.
- A message from a peer to one of another rank's peers gets its bytes when its receiver is
  about to read it (a ``Recv`` returns it, or a handler serves it): then every rank, at the
  same point of the same event order, ships all such messages sent since the last time,
  point to point, laid out by the layout both sides know (nothing is pickled).
- The run's model, the uniform mean of the peers' final models, is
  :func:`~p2pfl.learning.state.average_states`' float64 sum in peer order, passed along the
  ranks as a chain (rank 0's block first): the same bits as in one process.

A method whose code reads a ghost's values (a robust rule that picks a model by its
distances, a codec that packs by value) cannot run sharded: it fails at once, saying so.

Every rank repeating the whole simulation costs each rank the simulation's CPU time and the
per-peer bookkeeping (docs/performance.md, "A population sharded across ranks").
``--shard-events`` (:mod:`p2pfl.runtime.windows`) shards the events too: each rank runs only
its own peers, the ranks advancing in windows of the smallest link latency.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from p2pfl.learning.state import State, ghost, state_bytes
from p2pfl.network.message import Message
from p2pfl.runtime.ranks import Ranks, read_raw, write_raw


class Shards:
    """Which rank owns each node's model, and the messages that cross between ranks."""

    def __init__(self, ranks: Ranks, peers: int) -> None:
        self.ranks = ranks
        self.peers = peers
        self.rank = ranks.rank
        # messages between peers of different ranks sent since the last ship, in the order
        # they were sent (the same on every rank), with the bytes this rank must ship
        self.unsent: dict[int, tuple[Message, State | None]] = {}

    def owner(self, node: int) -> int:
        return self.ranks.owner(node, self.peers)

    def mine(self, node: int) -> bool:
        return self.owner(node) == self.rank

    def sent(self, msg: Message) -> Message:
        """What this rank keeps of a message just sent (as its receiver would decode it):
        itself between two peers of one rank; otherwise a ghost here, whose bytes the
        sender's rank keeps until its receiver reads it."""
        src, dst = self.owner(msg.src), self.owner(msg.dst)
        if src == dst:
            return msg
        tensors = None
        if src == self.rank:
            tensors = msg.tensors
            msg = Message(msg.kind, msg.src, msg.dst, msg.round, ghost(msg.tensors), msg.meta)
        self.unsent[id(msg)] = (msg, tensors)
        return msg

    def read(self, msgs: list[Message]) -> None:
        """Before a node reads ``msgs``: give the messages sent from another rank their
        bytes. Every rank calls it at the same point with the same messages (as ghosts or
        not), so every rank takes the same decision to ship."""
        if any(id(m) in self.unsent for m in msgs):
            self.ship()

    def ship(self) -> None:
        """Every rank sends the messages it holds for each other rank and fills in those
        sent to its own peers, point to point, each pair's bytes in one buffer in the order
        they were sent."""
        out: dict[int, list[State]] = {}
        into: dict[int, list[Message]] = {}
        for msg, tensors in self.unsent.values():
            if tensors is not None:
                out.setdefault(self.owner(msg.dst), []).append(tensors)
            elif self.owner(msg.dst) == self.rank:
                into.setdefault(self.owner(msg.src), []).append(msg)
        self.unsent = {}
        sends = {}
        for r, held in out.items():
            sends[r] = torch.empty(sum(state_bytes(t) for t in held), dtype=torch.uint8)
            write_raw((t for tensors in held for t in tensors.values()), sends[r])
        recvs = {
            r: torch.empty(sum(state_bytes(m.tensors) for m in ms), dtype=torch.uint8)
            for r, ms in into.items()
        }
        with self.ranks.together():
            pending = [dist.isend(b, r) for r, b in sends.items() if len(b)]
            pending += [dist.irecv(b, r) for r, b in recvs.items() if len(b)]
            for request in pending:
                if request is not None:  # None: this rank is not in the group (never here)
                    request.wait()
        for r, ms in into.items():
            offset = 0
            for m in ms:
                m.tensors, offset = read_raw(recvs[r], offset, m.tensors)

    def average(self, states: list[tuple[int, State]]) -> State:
        """The uniform mean of ``states`` (each peer's, in peer order; another rank's as
        ghosts) on every rank, with :func:`~p2pfl.learning.state.average_states`' bits: its
        float64 sum in peer order goes from rank to rank, rank 0's block first, and the
        last rank's result is broadcast."""
        owners = [self.owner(p) for p, _ in states]
        if owners != sorted(owners):
            raise AssertionError("a sharded mean needs the states in peer order")
        layout = states[0][1]
        share = 1.0 / float(len(states))
        sizes = [t.numel() for t in layout.values()]
        acc = torch.zeros(sum(sizes), dtype=torch.float64)  # on the CPU between ranks
        world, rank = self.ranks.world, self.rank
        mine = [s for (_, s), owner in zip(states, owners, strict=True) if owner == rank]
        device = next(iter(mine[0].values())).device if mine else acc.device
        with self.ranks.together():
            if rank > 0:
                dist.recv(acc, rank - 1)
            summed = acc.to(device)  # summed where the models are, as average_states does
            views = dict(zip(layout, summed.split(sizes), strict=True))
            for state in mine:
                for k, v in state.items():
                    views[k].view(v.shape).add_(v, alpha=share)
            acc = summed.cpu()
            if rank < world - 1:
                dist.send(acc, rank + 1)
            dist.broadcast(acc, world - 1)
        views = dict(zip(layout, acc.split(sizes), strict=True))
        out: State = {}
        for k, v in layout.items():
            a = views[k].view(v.shape)
            out[k] = a.to(v.dtype) if v.is_floating_point() else a.round().to(v.dtype)
        return out
