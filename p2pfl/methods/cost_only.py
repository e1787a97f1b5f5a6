"""Cost-only entries: methods the FedELMY paper compares with that p2pfl does not run.

Each has the ``check`` and ``transfers`` of its Fig. 5 cost formula but no behaviour, so
``p2pfl cost --methods metafed,dense,fedov`` can put them in a table (marked "cost only");
``p2pfl run`` does not know them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from p2pfl.core.options import Registry
from p2pfl.methods.base import Method, NodeContext
from p2pfl.methods.effects import Behaviour
from p2pfl.methods.fedseq import FedSeq
from p2pfl.network.plan import Plan, Transfer

COST_ONLY: Registry[type[Method]] = Registry("cost-only method")


@COST_ONLY.register("metafed")
@dataclass(kw_only=True, eq=False)
class MetaFed(FedSeq):
    """MetaFed (Chen et al., TNNLS 2023): cyclic knowledge distillation along a ring, an
    accumulation pass then a personalization pass, i.e. FedSeq's chain twice: (2N − 1)·M."""

    cycles: int = field(default=2, init=False)

    def behaviour(self, ctx: NodeContext) -> Behaviour:
        raise NotImplementedError("metafed is a cost-only entry")


class ServerUpload(Method):
    """One-shot methods whose peers upload their model to a server once and get nothing
    back (the server distils or ensembles): N·M in one phase."""

    topologies = ("star",)

    def total_rounds(self, num_peers: int) -> int:
        return 1

    def transfers(self, plan: Plan) -> Iterator[Transfer]:
        for p in plan.topology.peers:
            yield plan.send(p, plan.topology.hub, "model", 1, 1, plan.state)


@COST_ONLY.register("dense")
class Dense(ServerUpload):
    """DENSE (Zhang et al., NeurIPS 2022): data-free distillation of the uploaded ensemble."""


@COST_ONLY.register("fedov")
class FedOV(ServerUpload):
    """FedOV (Diao, Li, He, ICLR 2023): open-set classifiers ensembled by voting."""
