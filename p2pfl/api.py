"""The one module a plug-in author imports (docs/extending.md).

A plug-in is a Python module named in an experiment's ``plugins:`` list or installed under
the ``p2pfl.plugins`` entry point (:mod:`p2pfl.core.plugins`); importing it registers its
components by their YAML names::

    from p2pfl.api import METHODS, Method

    @METHODS.register("my_method")      # sets MyMethod.name; a name taken is an error
    class MyMethod(Method): ...

What is here, by what it is for:

- registries, one per kind of component: ``METHODS`` (``algorithm.name``), ``MODELS``
  (``model.name``), ``DATASETS`` (``dataset.name``), ``PARTITIONERS`` (``partition.name``),
  ``GRAPHS`` (``topology.kind``), ``CODECS`` (``compression.KIND.codec``), ``REPORTERS``
  (``eval.reporters``), ``ATTACKS`` (``adversary.attack``) and ``AGGREGATORS``
  (``algorithm.aggregator``);
- attacking and defending: ``Attack`` (the base class of an attack) and ``View`` (what an
  attacker knows when it sends), ``Aggregator`` (the base class of an aggregation rule);
- writing a method: ``Method`` (the base class), ``NodeContext`` (what one node knows), the
  effects its behaviour yields (``Send``, ``Recv``, ``Now``, ``Wait``, ``Neighbours``,
  ``Train``, ``Compute``, ``Evaluate``, ``Report``, ``Artifact``, ``Log``, ``Finish``;
  ``Behaviour`` is the generator's type) and
  what comes back (``Message`` from ``Recv``, ``TrainResult`` from ``Train``, ``PeerData``
  for a ``Compute`` function);
- model states: ``State`` (a ``state_dict``) and ``average_states`` (their weighted mean);
- the analytic cost plan of ``p2pfl cost``: ``Plan`` and ``Transfer``;
- the other components' types: ``Dataset`` (what a dataset loader returns), ``Topology``
  (the graph a method runs on), ``Codec`` and ``Reporter`` (the base classes of a codec and
  a reporter);
- ``numpy_rng(seed, *keys)``: a random stream named by ``keys``, the same on every node;
- ``ConfigError(key, message)``: a bad option, reported as one line naming its key.
"""

from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import numpy_rng
from p2pfl.data.datasets import DATASETS, Dataset
from p2pfl.data.federated import PeerData
from p2pfl.data.partition import PARTITIONERS
from p2pfl.learning.models import MODELS
from p2pfl.learning.robust import AGGREGATORS, Aggregator
from p2pfl.learning.state import State, average_states
from p2pfl.learning.training import TrainResult
from p2pfl.methods.attacks import ATTACKS, Attack, View
from p2pfl.methods.base import METHODS, Method, NodeContext
from p2pfl.methods.effects import (
    Artifact,
    Behaviour,
    Compute,
    Evaluate,
    Finish,
    Log,
    Neighbours,
    Now,
    Recv,
    Report,
    Send,
    Train,
    Wait,
)
from p2pfl.network.codecs import CODECS, Codec
from p2pfl.network.message import Message
from p2pfl.network.plan import Plan, Transfer
from p2pfl.network.topology import GRAPHS, Topology
from p2pfl.reporting.reporters import REPORTERS, Reporter

__all__ = [
    # registries
    "CODECS", "DATASETS", "GRAPHS", "METHODS", "MODELS", "PARTITIONERS", "REPORTERS", "ATTACKS",
    "AGGREGATORS",
    # attacks and defences
    "Attack", "View", "Aggregator",
    # methods and their effects
    "Method", "NodeContext", "Behaviour", "Send", "Recv", "Now", "Wait", "Neighbours", "Train",
    "Compute", "Evaluate",
    "Report", "Artifact", "Log", "Finish", "Message", "TrainResult", "PeerData",
    # model states, cost plans, component types, helpers
    "State", "average_states", "Plan", "Transfer", "Dataset", "Topology", "Codec", "Reporter",
    "numpy_rng", "ConfigError",
]  # fmt: skip
