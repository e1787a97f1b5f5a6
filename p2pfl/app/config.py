"""Experiment files: load the YAML, apply ``--set``/``--seed``, check every key, fill defaults.

Every section is checked against the signature of the component it configures (see
:mod:`p2pfl.core.options`), before any data is loaded, so a typo fails in milliseconds with
``error: FILE: key.path: what is wrong``. The resolved mapping (all defaults filled in) is
what a run writes to ``config.yaml``.

The top-level keys of an experiment file (each section's own keys: the docs' YAML
reference, generated from the components by :mod:`p2pfl.app.reference`):

- ``name``: the run's name (at most 200 bytes): ``runs/NAME-seedN`` and every output's
  ``experiment`` (default: the file's name without ``.yaml``).
- ``seed``: the seed of every random draw (0..2⁶³−1); the same seed gives the same result.
- ``dataset``: where the data comes from, ``{name, ...}``.
- ``partition``: how the data is split among the peers, ``{name, ...}``.
- ``model``: the network every peer trains, ``{name, ...}``.
- ``topology``: who talks to whom: a graph ``{kind, ...}`` or a ``file`` of one.
- ``peers``: how many peers and what they run on: compute speed, links, device.
- ``algorithm``: the method, ``{name, ...}``, with its own keys.
- ``train``: how every local training runs (methods may override keys per call).
- ``eval``: how often the global test set is scored and where the rows go.
- ``transport``: how a real run over ZeroMQ behaves (ignored in simulation).
- ``compression``: a codec per message kind, counted by the bytes really sent.
- ``plugins``: your own modules (``.py`` files or dotted names), imported before any name
  is looked up, so every section may name what they register.
- ``network``: a network that misbehaves: churn, crashes, loss, partitions, changing graphs.
- ``adversary``: attacking peers: who attacks and how.
- ``stop``: end the run at a time, a number of samples trained or an accuracy.
- ``sweep``: a grid ``{key: [values]}`` over any keys: one run per cell, one table.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from p2pfl.core.errors import ConfigError
from p2pfl.core.options import bind, bind_with_common
from p2pfl.core.plugins import load_plugins
from p2pfl.core.yaml_io import find_file, read_yaml, typed_value, yaml_problem
from p2pfl.data.datasets import DATASETS, load_dataset, take_subsets
from p2pfl.data.federated import SplitOptions
from p2pfl.data.partition import PARTITIONERS, takes_groups
from p2pfl.learning.models import resolve_model
from p2pfl.learning.robust import resolve_aggregator
from p2pfl.learning.training import TrainConfig
from p2pfl.methods import METHODS
from p2pfl.methods.attacks import resolve_adversary
from p2pfl.methods.base import Aggregating, Method
from p2pfl.methods.relaxed import parse_relaxed_init
from p2pfl.network.codecs import resolve_section as resolve_compression
from p2pfl.network.dynamics import resolve_network
from p2pfl.network.peers import Population, build_population, resolve_peers
from p2pfl.network.topology import parse_topology
from p2pfl.runtime.setup import UNBOUNDED_ROUNDS, EvalConfig, StopConfig
from p2pfl.runtime.sockets import TransportConfig

SECTIONS = (
    "name", "seed", "dataset", "partition", "model", "topology", "peers", "algorithm", "train",
    "eval", "transport", "compression", "plugins", "network", "adversary", "stop",
)  # fmt: skip
DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "dataset": {"name": "digits"},
    "partition": {"name": "iid"},
    "model": {"name": "mlp"},
    "train": {},
    "eval": {},
    "transport": {},
    "compression": {},
}
REQUIRED = ("topology", "peers", "algorithm")
MAX_NAME_BYTES = 200  # runs/NAME-seedN must stay a valid file name


def apply_set(config: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set a.b.c=value`` (the value is parsed as YAML: numbers, lists, ...;
    :func:`typed_value`: what a file would refuse is refused alike)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError("--set", f"expected key.path=value, got {assignment!r}")
    try:
        assignment.encode()
    except UnicodeEncodeError:  # bytes that are not UTF-8 on the command line
        raise ConfigError("--set", f"is not valid UTF-8: {assignment!r}") from None
    try:
        value = typed_value(raw)
    except yaml.constructor.ConstructorError as e:
        shown = f"{assignment[:80]}..." if len(assignment) > 80 else assignment
        raise ConfigError("--set", f"{shown!r}: {yaml_problem(e)}") from None
    set_path(config, key, value)


def set_path(config: dict[str, Any], key: str, value: Any) -> None:
    """``config[a][b][c] = value`` for the dotted ``key`` ``a.b.c``, making the mappings on
    the way; a ``ConfigError`` where one on the way is not a mapping."""
    *parents, leaf = key.split(".")
    node = config
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parents[: i + 1]), "is not a mapping; cannot --set below it")
        node = child
    node[leaf] = value


def _include(section: dict[str, Any], key: str, base: Path, what: str) -> dict[str, Any]:
    """Merge the YAML file named by ``section[key]`` under the section's inline keys."""
    if key not in section:
        return section
    name = section[key]
    if not isinstance(name, str):
        raise ConfigError(key, "must be a file path")
    path = find_file(name, base)
    if path is None:
        raise ConfigError(key, f"no such {what} file {name!r}")
    included = read_yaml(path, f"{what} file")
    return included | {k: v for k, v in section.items() if k != key}


def _named(
    registry: Any, options: dict[str, Any], skip: int, common: Any = None, common_skip: int = 0
) -> dict[str, Any]:
    """Check a ``{name, ...}`` section against its registered component; return it resolved."""
    if common is None:
        return registry.resolve(options, skip)
    if "name" not in options:
        raise ConfigError("name", f"missing; choose one of: {', '.join(registry.names())}")
    fn = registry.get(options["name"])
    rest = {k: v for k, v in options.items() if k != "name"}
    own, shared = bind_with_common(fn, common, rest, skip, common_skip)
    return {"name": options["name"]} | own | shared


def graph_path(options: dict[str, Any], file: Path) -> dict[str, Any]:
    """A ``graph_file`` mapping with its ``path`` found (like ``topology.file``) and made
    absolute, so the resolved config runs from anywhere; other mappings as they are."""
    if options.get("kind") != "graph_file" or not isinstance(options.get("path"), str):
        return options
    path = find_file(options["path"], file)
    if path is None:
        raise ConfigError("path", f"no such graph file {options['path']!r}")
    return options | {"path": str(path.resolve())}


def _topology(options: dict[str, Any], file: Path) -> dict[str, Any]:
    """Check a ``topology:`` mapping (all but what needs the peer count)."""
    options = graph_path(options, file)
    parse_topology(options)
    return options


def _algorithm(options: dict[str, Any]) -> dict[str, Any]:
    """Check an ``algorithm:`` mapping; a method's ``aggregator`` (FedAvg's, DFedAvgM's, a
    plug-in's: a rule of ``AGGREGATORS``) and its ``relaxed_init`` are checked here too and
    written with their defaults."""
    out = _named(METHODS, options, 0)
    if "aggregator" in out:
        out["aggregator"] = resolve_aggregator(out["aggregator"])
    if issubclass(METHODS.get(out["name"]), Aggregating):  # FedInit's start, with its defaults
        relaxed = parse_relaxed_init(out["relaxed_init"])
        out["relaxed_init"] = None if relaxed is None else asdict(relaxed)
    return out


def _natural_count(config: dict[str, Any], out: dict[str, Any], file: Path) -> Any:
    """The ``peers:`` section, with ``count`` filled in when it is left out (inline and in
    the profile) and the partition splits by the dataset's natural groups (``natural``):
    one peer per group. The dataset is loaded to count them, so config.yaml records the
    number."""
    peers = config.get("peers")
    try:
        given = _include(_section(config, "peers"), "profile", file, "peer profile")
    except ConfigError as e:
        raise e.within("peers") from None
    if "count" in given or not takes_groups(PARTITIONERS.get(out["partition"]["name"])):
        return peers
    try:
        dataset = load_dataset(out["dataset"], out["seed"])
    except ConfigError as e:
        raise e.within("dataset") from None
    if dataset.train_groups is None:
        raise ConfigError(
            "count",
            f"left out, but dataset {dataset.name} has no natural groups for partition "
            f"{out['partition']['name']} to count; give peers.count or use a dataset with groups",
        ).within("peers")
    return dict(peers or {}) | {"count": len(torch.unique(dataset.train_groups))}


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError("", "must be a mapping of keys")  # the caller adds the key
    return dict(value)


@dataclass(frozen=True, eq=False)
class Resolved:
    """An experiment checked once (what :func:`resolve` returns): the sections that need
    neither the data nor the graph bound to their components — the method (with its
    aggregator), the population, the training, evaluation, transport and stop settings — and
    ``config``, the same experiment as a mapping with every default filled in, which a run
    writes to ``config.yaml`` (read it, never change it). ``build`` adds what needs the data
    or the graph."""

    config: dict[str, Any]
    method: Method
    population: Population
    train: TrainConfig
    eval: EvalConfig
    transport: TransportConfig
    stop: StopConfig | None = None

    @property
    def name(self) -> str:
        return self.config["name"]

    @property
    def seed(self) -> int:
        return self.config["seed"]


def resolve(raw: dict[str, Any], file: Path) -> Resolved:
    """Check every key of an experiment mapping, fill in every default and bind the sections
    to their components: every check that needs neither the data nor the graph."""
    config, bound = _checked(raw, file)
    algorithm = {k: v for k, v in config["algorithm"].items() if k != "name"}
    try:
        method = METHODS.get(config["algorithm"]["name"])(**algorithm)
    except ConfigError as e:
        raise e.within("algorithm") from None
    try:
        population = build_population(config["seed"], **config["peers"])
    except ConfigError as e:
        raise e.within("peers") from None
    return Resolved(config, method, population, **bound)


def _checked(raw: dict[str, Any], file: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The experiment as a mapping with every default filled in, and the sections that are
    dataclasses (train, eval, transport, stop) as their objects."""
    config = copy.deepcopy(DEFAULTS) | raw
    for key in config:
        if key not in SECTIONS:
            raise ConfigError(key, f"unknown top-level key; valid keys are: {', '.join(SECTIONS)}")
    for key in REQUIRED:
        if key not in config:
            raise ConfigError(key, "missing required section")
    out: dict[str, Any] = {"name": config.get("name", file.stem)}
    if not isinstance(out["name"], str):
        raise ConfigError("name", "must be a string")
    if not 0 < len(out["name"].encode()) <= MAX_NAME_BYTES or "\0" in out["name"]:
        raise ConfigError("name", f"must be 1 to {MAX_NAME_BYTES} bytes (it names directories)")
    if not isinstance(config["seed"], int) or isinstance(config["seed"], bool):
        raise ConfigError("seed", f"must be an integer, got {config['seed']!r}")
    if not 0 <= config["seed"] < 2**63:
        raise ConfigError("seed", f"must be in 0..2**63-1, got {config['seed']}")
    out["seed"] = config["seed"]
    plugins = load_plugins(config.get("plugins", []), file)  # before any registry lookup
    if plugins:
        out["plugins"] = plugins
    steps = {
        "dataset": lambda o: _named(DATASETS, o, 0, take_subsets, 2),
        "partition": lambda o: _named(PARTITIONERS, o, 3, SplitOptions),
        "model": resolve_model,
        "topology": lambda o: _topology(_include(o, "file", file, "topology"), file),
        "peers": lambda o: resolve_peers(_include(o, "profile", file, "peer profile"), file),
        "algorithm": _algorithm,
        "train": lambda o: TrainConfig(**bind(TrainConfig, o)),
        "eval": lambda o: EvalConfig(**bind(EvalConfig, o)),
        "transport": lambda o: TransportConfig(**bind(TransportConfig, o)),
        "compression": resolve_compression,
    }
    bound: dict[str, Any] = {}
    for key, step in steps.items():
        if key == "peers":
            config["peers"] = _natural_count(config, out, file)
        try:
            out[key] = step(_section(config, key))
        except ConfigError as e:
            raise e.within(key) from None
        if key in ("train", "eval", "transport"):
            bound[key] = out[key]
            out[key] = asdict(out[key])
    if "network" in config:  # only when given: without it, config.yaml is as it always was
        try:
            out["network"] = _network(_section(config, "network"), file)
        except ConfigError as e:
            raise e.within("network") from None
    if "stop" in config:  # only when given, like network
        try:
            bound["stop"] = StopConfig(**bind(StopConfig, _section(config, "stop")))
        except ConfigError as e:
            raise e.within("stop") from None
        out["stop"] = asdict(bound["stop"])
        if out["stop"]["accuracy"] is not None and out["eval"]["every_s"] is None:
            raise ConfigError(
                "accuracy", "needs eval.every_s: how often the run's model is scored"
            ).within("stop")
        given = config["algorithm"] if isinstance(config["algorithm"], dict) else {}
        if "rounds" in out["algorithm"] and "rounds" not in given:
            out["algorithm"]["rounds"] = UNBOUNDED_ROUNDS  # the stop bounds the run
    if "adversary" in config:  # only when given, like network
        try:
            out["adversary"] = resolve_adversary(_section(config, "adversary"))
        except ConfigError as e:
            raise e.within("adversary") from None
    return out, bound


def _network(options: dict[str, Any], file: Path) -> dict[str, Any]:
    """Check a ``network:`` mapping; a churn trace's and graph files' paths become absolute."""
    graph = options.get("graph")
    if isinstance(graph, dict):
        try:
            if isinstance(graph.get("schedule"), list):
                entries = [
                    graph_path(e, file) if isinstance(e, dict) else e for e in graph["schedule"]
                ]
                graph = graph | {"schedule": entries}
            else:
                graph = graph_path(graph, file)
        except ConfigError as e:
            raise e.within("graph") from None
        options = options | {"graph": graph}
    resolve_network(options)
    churn = options.get("churn")
    if churn and churn.get("trace") is not None:
        path = find_file(churn["trace"], file)
        if path is None:
            raise ConfigError("churn.trace", f"no such trace file {churn['trace']!r}")
        options = options | {"churn": churn | {"trace": str(path.resolve())}}
    return options


def read_experiment(
    path: str | Path,
    sets: Sequence[str | tuple[str, Any]] = (),
    seed: int | None = None,
    given: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An experiment file's raw mapping with ``--set`` and ``--seed`` applied (a ``--set``
    from Python is a ``(key.path, value)`` pair); ``given``, if any, stands for the file's
    contents (an experiment from Python, :mod:`p2pfl.app.library`: ``path`` then only names
    it and anchors its relative paths)."""
    file = Path(path)
    try:
        raw = read_yaml(file, "experiment file") if given is None else copy.deepcopy(given)
        for assignment in sets:  # --set text, or (key, value) from Python
            if isinstance(assignment, str):
                apply_set(raw, assignment)
            else:
                set_path(raw, *assignment)
        if seed is not None:
            raw["seed"] = seed
        return raw
    except ConfigError as e:
        e.file = e.file or str(file)
        raise
