"""Experiment files: load the YAML, apply ``--set``/``--seed``, check every key, fill defaults.

Every section is checked against the signature of the component it configures (see
:mod:`p2pfl.options`), before any data is loaded, so a typo fails in milliseconds with
``error: FILE: key.path: what is wrong``. The resolved mapping (all defaults filled in) is
what a run writes to ``config.yaml``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from p2pfl.codec import resolve_section as resolve_compression
from p2pfl.data.datasets import DATASETS, take_subsets
from p2pfl.data.federated import SplitOptions
from p2pfl.data.partition import PARTITIONERS
from p2pfl.errors import ConfigError
from p2pfl.matching import MatchingConfig
from p2pfl.methods import METHODS
from p2pfl.models import resolve_model
from p2pfl.options import bind, bind_with_common
from p2pfl.peers import population
from p2pfl.training import TrainConfig

SECTIONS = (
    "name", "seed", "dataset", "partition", "model", "topology", "peers", "algorithm", "train",
    "eval", "transport", "compression",
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


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e9`` (no dot, no exponent sign) as a string; accept it as a number."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$"
        r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


@dataclass(frozen=True)
class EvalConfig:
    """The ``eval:`` section: how often the global test set is scored, and the optional
    neuron-matching measure after the run (:mod:`p2pfl.matching`)."""

    every: int = 1
    per_peer: bool = True
    matching: dict | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError("every", "must be >= 1")
        if self.matching is not None:
            try:
                keys = asdict(MatchingConfig(**bind(MatchingConfig, self.matching)))
            except ConfigError as e:
                raise e.within("matching") from None
            object.__setattr__(self, "matching", keys)  # stored with its defaults filled in


@dataclass(frozen=True)
class TransportConfig:
    """The ``transport:`` section: how real (ZeroMQ) runs behave; ignored in simulation."""

    timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    max_message_bytes: int = 1 << 30
    host: str = "127.0.0.1"
    curve_keys: str | None = None

    def __post_init__(self) -> None:
        for key in ("timeout_s", "startup_timeout_s", "max_message_bytes"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, "must be > 0")


def read_yaml(path: Path, what: str = "file") -> dict[str, Any]:
    """Read a YAML mapping; a missing or malformed file is a ``ConfigError`` naming it."""
    if not path.is_file():
        raise ConfigError("", f"no such {what}", file=str(path))
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(
            "", f"not valid YAML{where}: {getattr(e, 'problem', e)}", str(path)
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", "must be a YAML mapping of keys", file=str(path))
    return data


def apply_set(config: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set a.b.c=value`` (the value is parsed as YAML: numbers, lists, ...)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError("--set", f"expected key.path=value, got {assignment!r}")
    try:
        value = parse_yaml(raw)
    except yaml.YAMLError:
        value = raw
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
    candidates = [Path(name), base.parent / name, base.parent.parent / name]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ConfigError(key, f"no such {what} file {name!r}")
    included = read_yaml(path, f"{what} file")
    return included | {k: v for k, v in section.items() if k != key}


def _named(
    registry: Any, options: dict[str, Any], skip: int, common: Any = None, common_skip: int = 0
) -> dict[str, Any]:
    """Check a ``{name, ...}`` section against its registered component; return it resolved."""
    if "name" not in options:
        raise ConfigError("name", f"missing; choose one of: {', '.join(registry.names())}")
    fn = registry.get(options["name"])
    rest = {k: v for k, v in options.items() if k != "name"}
    if common is None:
        return {"name": options["name"]} | bind(fn, rest, skip)
    own, shared = bind_with_common(fn, common, rest, skip, common_skip)
    return {"name": options["name"]} | own | shared


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(key, "must be a mapping of keys")
    return dict(value)


def resolve(raw: dict[str, Any], file: Path) -> dict[str, Any]:
    """Check every key of an experiment mapping and return it with all defaults filled in."""
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
    if not isinstance(config["seed"], int) or isinstance(config["seed"], bool):
        raise ConfigError("seed", f"must be an integer, got {config['seed']!r}")
    out["seed"] = config["seed"]
    steps = {
        "dataset": lambda o: _named(DATASETS, o, 0, take_subsets, 2),
        "partition": lambda o: _named(PARTITIONERS, o, 3, SplitOptions),
        "model": resolve_model,
        "topology": lambda o: _include(o, "file", file, "topology"),
        "peers": lambda o: bind(population, _include(o, "profile", file, "peer profile")),
        "algorithm": lambda o: _named(METHODS, o, 0),
        "train": lambda o: asdict(TrainConfig(**bind(TrainConfig, o))),
        "eval": lambda o: asdict(EvalConfig(**bind(EvalConfig, o))),
        "transport": lambda o: asdict(TransportConfig(**bind(TransportConfig, o))),
        "compression": resolve_compression,
    }
    for key, step in steps.items():
        try:
            out[key] = step(_section(config, key))
        except ConfigError as e:
            raise e.within(key) from None
    try:
        population(**out["peers"])
    except ConfigError as e:
        raise e.within("peers") from None
    return out


def read_experiment(
    path: str | Path, sets: Sequence[str] = (), seed: int | None = None
) -> dict[str, Any]:
    """An experiment file's raw mapping with ``--set`` and ``--seed`` applied."""
    file = Path(path)
    try:
        raw = read_yaml(file, "experiment file")
        for assignment in sets:
            apply_set(raw, assignment)
        if seed is not None:
            raw["seed"] = seed
        return raw
    except ConfigError as e:
        e.file = e.file or str(file)
        raise


def load_experiment(
    path: str | Path, sets: Sequence[str] = (), seed: int | None = None
) -> dict[str, Any]:
    """Read, override and resolve an experiment file; errors carry the file name."""
    file = Path(path)
    raw = read_experiment(file, sets, seed)
    try:
        if "sweep" in raw:
            from p2pfl.sweep import base_config  # it imports this module

            return base_config(raw, file)
        return resolve(raw, file)
    except ConfigError as e:
        e.file = e.file or str(file)
        raise
