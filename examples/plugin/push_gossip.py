"""A p2pfl plug-in: push-gossip learning and a quantity-skew partitioner.

Name this file in an experiment's ``plugins:`` list (see ``experiment.yaml`` beside it), or
install this directory (``pip install ./examples/plugin``) and leave ``plugins:`` out. The
walk-through is docs/extending.md in the p2pfl repository.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from p2pfl.api import (
    METHODS,
    PARTITIONERS,
    Behaviour,
    ConfigError,
    Evaluate,
    Finish,
    Method,
    NodeContext,
    Plan,
    Recv,
    Send,
    Topology,
    Train,
    Transfer,
    average_states,
    numpy_rng,
)


@METHODS.register("push_gossip")
@dataclass(kw_only=True, eq=False)
class PushGossip(Method):
    """Gossip learning (Ormándi, Hegedűs, Jelasity, Concurrency and Computation 22(4), 2013,
    Algorithm 1) in synchronous rounds: every round each peer trains on its own data, pushes
    its model to one neighbour drawn at random, and merges what it receives by averaging.
    """

    serverless = True  # a graph with a server (a star) is refused before the run
    rounds: int = 10  # its algorithm: keys are its fields

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ConfigError("rounds", f"must be >= 1, got {self.rounds}")

    def total_rounds(self, num_peers: int) -> int:
        return self.rounds

    def targets(self, topology: Topology, seed: int, round: int) -> dict[int, int]:
        """Who pushes to whom in ``round``: one neighbour per peer, drawn from the round's
        random stream, which every node draws alike (so each knows what it will receive)."""
        rng = numpy_rng(seed, "push_gossip", round)
        out = {}
        for i in topology.peers:
            neighbours = topology.neighbours(i)
            out[i] = neighbours[int(rng.integers(len(neighbours)))]
        return out

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        state = ctx.init_state()
        for r in range(1, self.rounds + 1):
            state = (yield Train(state, r)).state  # local SGD on this peer's data
            targets = self.targets(ctx.topology, ctx.seed, r)
            yield Send(targets[ctx.node], "model", r, state)  # push to one neighbour
            senders = [i for i, j in targets.items() if j == ctx.node]
            if senders:  # merge: the mean of this model and every model pushed here
                msgs = yield Recv(count=len(senders), round=r)
                state = average_states([state] + [m.tensors for m in msgs])
            yield Evaluate(state, r)
        yield Finish(state)

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        """Round r (phase r): every peer pushes one model, N·M bytes a round, R·N·M in all."""
        for r in range(1, self.rounds + 1):
            for i, j in self.targets(plan.topology, plan.seed, r).items():
                yield plan.send(i, j, "model", r, r, plan.state)


@PARTITIONERS.register("quantity_skew")
def quantity_skew(
    labels: np.ndarray,
    num_peers: int,
    rng: np.random.Generator,
    *,
    beta: float = 0.5,
    min_size: int = 10,
) -> list[np.ndarray]:
    """Quantity skew (Li, Diao, Chen, He, "Federated Learning on Non-IID Data Silos", ICDE
    2022, §IV-C): peer sizes in proportions q ~ Dir_N(beta), labels IID. The shuffled train
    set is cut at cumsum(q)·n; q is redrawn until every peer has ``min_size`` samples."""
    n = len(labels)
    if beta <= 0:
        raise ConfigError("beta", f"must be > 0, got {beta}")
    if not 0 <= min_size * num_peers <= n:
        raise ConfigError("min_size", f"{num_peers} peers x {min_size} exceeds the {n} samples")
    for _ in range(100):
        q = rng.dirichlet(np.full(num_peers, beta))
        cuts = (np.cumsum(q)[:-1] * n).astype(int)
        if np.diff(cuts, prepend=0, append=n).min() >= min_size:
            return np.split(rng.permutation(n), cuts)
    raise ConfigError("min_size", f"100 draws of Dir({beta}) left a peer below {min_size}")
