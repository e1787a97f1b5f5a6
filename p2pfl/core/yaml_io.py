"""Reading YAML safely (numbers as numbers, one-line errors that name the file), and finding
the files an experiment names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from p2pfl.core.errors import ConfigError


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


def find_file(name: str, base: Path) -> Path | None:
    """The file an experiment at ``base`` names by a relative ``name`` (``topology.file``,
    ``peers.profile``, ``plugins``): as given (from the current directory), next to the
    experiment file, or one directory above it; ``None`` if none of these is a file."""
    candidates = [Path(name), base.parent / name, base.parent.parent / name]
    return next((p for p in candidates if p.is_file()), None)
