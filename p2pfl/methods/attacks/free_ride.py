"""Free-riding (Lin et al., "Free-riders in federated learning", 2019): the peer does not
train; it sends back the model its training would have started from — the global model it
received on a star, its own mixed model on a graph — and spends no compute time."""

from __future__ import annotations

from dataclasses import dataclass

from p2pfl.methods.attacks.base import ATTACKS, Attack


@ATTACKS.register("free_ride")
@dataclass(kw_only=True, frozen=True)
class FreeRide(Attack):
    """Skip the local training; send what came."""

    trains = False
