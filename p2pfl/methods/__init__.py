"""Federated-learning methods, one module each, registered by their YAML name."""

# Importing a method module registers it.
from p2pfl.methods import (  # noqa: F401
    adpsgd,
    attacks,
    dfedavgm,
    dfedsam,
    fedasync,
    fedavg,
    fedbuff,
    fedelmy,
    fedfisher,
    fedprox,
    fedseq,
    fisher_merge,
    gossip,
    maecho,
    pushsum,
    regmean,
)
from p2pfl.methods.base import METHODS

__all__ = ["METHODS"]
