"""Label flipping, a data attack: the attacker trains honestly on labels mapped c → C − 1 − c
(train and validation), and sends the model that gives (the baseline of Fang et al. 2020
and of He et al. 2022's code)."""

from __future__ import annotations

from dataclasses import dataclass

from p2pfl.data.federated import PeerData
from p2pfl.methods.attacks.base import ATTACKS, Attack


@ATTACKS.register("label_flip")
@dataclass(kw_only=True, frozen=True)
class LabelFlip(Attack):
    """Train on flipped labels."""

    def poison(self, data: PeerData, num_classes: int) -> PeerData:
        flip = num_classes - 1
        return PeerData(data.train_x, flip - data.train_y, data.val_x, flip - data.val_y)
