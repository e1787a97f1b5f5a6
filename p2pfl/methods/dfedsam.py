"""DFedSAM (Shi et al., ICML 2023): DFedAvgM whose local optimiser is SAM.

Every local ``Train`` of DFedAvgM runs with ``optimizer: sam`` (see :mod:`p2pfl.learning.training`):
``train.rho`` (default 0.05), and the base SGD's ``lr``, ``momentum`` and
``weight_decay``, come from the ``train:`` section. One gossip step per round, as in the
FedELMY paper's one-shot adaptation (``rounds: 1``, its App. A).
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pfl.methods.base import METHODS
from p2pfl.methods.dfedavgm import DFedAvgM
from p2pfl.methods.effects import State, Train


@METHODS.register("dfedsam")
@dataclass(kw_only=True, eq=False)
class DFedSAM(DFedAvgM):
    """Local SAM steps, then one gossip-averaging step with the neighbours, per round."""

    def local_train(self, state: State, round: int) -> Train:
        return Train(state, round, overrides={"optimizer": "sam"})
