"""DFedAvgM (Sun, Li, Wang, TPAMI 2022): decentralized FedAvg with momentum, on any graph.

Every round each peer trains locally with SGD + heavy-ball momentum (``train.momentum``;
the momentum restarts every round, as in the paper's algorithm), sends its model to its
neighbours, and mixes: x_i ← Σ_j w_ij x_j with Metropolis–Hastings weights
w_ij = 1 / (1 + max(deg_i, deg_j)) — symmetric and doubly stochastic; 1/N on a mesh and
1/3 on a ring. One round moves Σ_i deg(i) models. The result is the mean of all peers.

``wait_s`` lives with a network that misbehaves (``network:``): a peer sends to the
neighbours it believes reachable, waits at most ``wait_s`` seconds for those that send to it,
and mixes with the ones that answered; the weight of a neighbour that did not answer stays
with the peer (the row still sums to 1). ``mixing: uniform`` weighs itself and every answer
1/(1 + answers) instead of Metropolis–Hastings: the rule for graphs redrawn during the run
(``network.graph``, possibly directed like ``s_out``), whose degrees a peer cannot know —
Epidemic Learning's rule (de Vos et al., NeurIPS 2023, Alg. 1); on a static d-regular graph
the two are the same. Without either option the method is as above, bit for bit.

``aggregator:`` replaces the mixing step by a robust rule (:mod:`p2pfl.learning.robust`)
against attacking neighbours (``adversary:``): ``median`` and ``trimmed_mean`` over the peer
and its neighbours, or ClippedGossip (``clipped_gossip``, He, Karimireddy, Jaggi 2022), which
keeps the mixing weights but clips each neighbour's pull. It sends exactly what mixing sends.

``relaxed_init: {beta, aggregate}`` adds FedInit's relaxed start (:mod:`p2pfl.methods.relaxed`)
in its gossip form (our extension, not in the paper; docs/pans-fedinit.md): a peer starts
from its mixed model x̄ + β·(x̄ − its last local model). It sends nothing extra.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from p2pfl.core.errors import ConfigError, RunError
from p2pfl.methods.base import METHODS, Aggregating, NodeContext
from p2pfl.methods.effects import Behaviour, Evaluate, Finish, State, Train
from p2pfl.methods.relaxed import local_round
from p2pfl.methods.steps import broadcast, deadline_in, gather, reachable
from p2pfl.network.dynamics import Network
from p2pfl.network.message import Message
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import Topology


def metropolis_weights(topology: Topology, node: int) -> dict[int, float]:
    """Row ``node`` of the Metropolis–Hastings mixing matrix (self included)."""
    deg = topology.graph.degree
    row = {j: 1.0 / (1 + max(deg[node], deg[j])) for j in topology.neighbours(node)}
    row[node] = 1.0 - sum(row.values())
    return row


@METHODS.register("dfedavgm")
@dataclass(kw_only=True, eq=False)
class DFedAvgM(Aggregating):
    """Local momentum SGD, then one gossip-averaging step with the neighbours, per round.

    Args:
        wait_s: with a misbehaving network: send to the reachable neighbours, wait at most this long
            for the in-neighbours and mix with those that answered (null: wait for all).
        mixing: the mixing weights: ``metropolis`` (Metropolis-Hastings: 1/N on a mesh, 1/3 on a
            ring) or ``uniform`` (1/(1 + answers), for graphs redrawn by ``network.graph``).
    """

    serverless = True

    wait_s: float | None = None
    mixing: Literal["metropolis", "uniform"] = "metropolis"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.wait_s is not None and not self.wait_s > 0:
            raise ConfigError("wait_s", "must be > 0")

    @property
    def live(self) -> bool:
        """Whether a peer asks the network whom it can reach (``wait_s``, or ``mixing:
        uniform`` for a graph that changes) rather than taking the graph's neighbours."""
        return self.wait_s is not None or self.mixing == "uniform"

    def check(self, topology: Topology, seed: int) -> None:
        """Also: each peer's neighbours and itself are enough for the aggregator as set."""
        super().check(topology, seed)
        inputs = {f"peer {p}": len(topology.neighbours(p)) + 1 for p in topology.peers}
        self.rule.check_inputs(inputs)

    def check_network(self, network: Network) -> None:
        """Metropolis–Hastings weights come from the degrees of the graph at the start: a
        graph that ``network.graph`` changes needs ``mixing: uniform``."""
        if network.changes_graph and self.mixing == "metropolis":
            raise ConfigError(
                "mixing",
                "metropolis mixing needs a static graph, and network.graph changes it: "
                "set mixing: uniform",
            )

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Round r (phase r): every peer sends its model to each neighbour, Σ_i deg(i)·M per
        round: N(N−1)·M on a mesh, 2N·M on a ring."""
        topology = plan.topology
        for r in range(1, self.rounds + 1):
            for i in topology.peers:
                for j in topology.neighbours(i):
                    yield plan.send(i, j, "model", r, r, plan.state)

    def local_train(self, state: State, round: int) -> Train:
        """The round's local training (a hook: DFedSAM swaps the optimiser)."""
        return Train(state, round)

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        """Sun et al. 2022, Algorithm 1, at node i (with ``wait_s``: mixing with the
        neighbours that answered in time)."""
        row = metropolis_weights(ctx.topology, ctx.node)  # w_il, row i of W
        x = ctx.init_state()  # x^0(i) = x^0
        last = x  # the last local model (FedInit's per-peer state)
        for t in range(1, self.rounds + 1):
            # z^t(i): K steps of SGD with momentum θ from x^t(i), the momentum restarted
            last, z = yield from local_round(
                self.relaxed, self.local_train, x, last, ctx.trainable, t
            )
            del x  # z^t replaces it: a peer holds one model while it waits for its neighbours
            senders = yield from reachable(ctx, self.live, t, incoming=True)
            receivers = yield from reachable(ctx, self.live, t)
            yield from broadcast(receivers, "model", t, z)  # neighbours communicate z^t
            deadline = yield from deadline_in(self.wait_s)
            answers = yield from gather(len(senders), t, deadline)
            x = self.mix(z, answers, row)  # x^{t+1}(i) = Σ_l w_il z^t(l)
            del z, answers  # between rounds a peer holds x alone (and, with FedInit, last)
            if self.relaxed is None:
                last = x  # unused without FedInit: it need not keep z^t alive
            yield Evaluate(x, t)
        yield Finish(x)

    def mix(self, own: State, answers: list[Message], row: dict[int, float]) -> State:
        """Σ_l w_il z(l) over this peer and the neighbours that answered: Metropolis–Hastings
        weights, a silent neighbour's weight staying with the peer (the row sums to 1), or
        with ``mixing: uniform`` 1/(1 + answers) each; the aggregator as set combines them."""
        if self.mixing == "uniform":
            weights, own_weight = [1.0] * len(answers), 1.0
        else:
            if any(m.src not in row for m in answers):
                raise RunError("metropolis mixing needs a static graph: set mixing: uniform")
            weights = [row[m.src] for m in answers]
            own_weight = 1.0 - sum(weights)
        return self.rule(own, [m.tensors for m in answers], weights, own_weight)
