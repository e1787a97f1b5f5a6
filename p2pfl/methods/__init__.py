"""Federated-learning methods, one module each, registered by their YAML name."""

from p2pfl.options import Registry

METHODS: Registry = Registry("method")

# Importing a method module registers it.
from p2pfl.methods import dfedavgm, fedavg, fedprox, fedseq  # noqa: E402, F401
