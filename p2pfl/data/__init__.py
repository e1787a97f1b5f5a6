"""The data layer: offline dataset loaders, partitioners and per-peer data."""

from p2pfl.data import generated, text  # noqa: F401  (register mnist1d, synthetic, shakespeare)
from p2pfl.data.datasets import DATASETS, Dataset, load_dataset
from p2pfl.data.federated import (
    FederatedData,
    PeerData,
    SplitOptions,
    make_federated_data,
)
from p2pfl.data.partition import PARTITIONERS

__all__ = [
    "DATASETS",
    "PARTITIONERS",
    "Dataset",
    "FederatedData",
    "PeerData",
    "SplitOptions",
    "load_dataset",
    "make_federated_data",
]
