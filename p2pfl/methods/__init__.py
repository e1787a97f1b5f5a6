"""Federated-learning methods, one module each, registered by their YAML name."""

from p2pfl.options import Registry

METHODS: Registry = Registry("method")

# Importing a method module registers it.
from p2pfl.methods import (  # noqa: E402, F401
    dfedavgm,
    dfedsam,
    fedavg,
    fedelmy,
    fedfisher,
    fedprox,
    fedseq,
    fisher_merge,
    maecho,
    regmean,
)
