"""Attacks on any method, one module each, registered by their YAML name (``adversary.attack``)."""

# Importing an attack module registers it.
from p2pfl.methods.attacks import (  # noqa: F401
    alie,
    free_ride,
    gaussian,
    ipm,
    label_flip,
    scale,
    sign_flip,
)
from p2pfl.methods.attacks.base import (
    ATTACKS,
    Adversary,
    Attack,
    View,
    attacked,
    build_adversary,
    resolve_adversary,
)

__all__ = [
    "ATTACKS", "Adversary", "Attack", "View", "attacked", "build_adversary", "resolve_adversary",
]  # fmt: skip
