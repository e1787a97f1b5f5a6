"""Reading YAML safely (numbers as numbers, one-line errors that name the file), and finding
the files an experiment names."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import yaml

from p2pfl.core.errors import ConfigError

MAX_FILE_BYTES = 4 << 20  # an experiment, profile or addresses file; larger ones are refused
MAX_DEPTH = 1_000  # nested [ and { (indentation costs quadratic bytes: 4 MB hold 2,900 levels)
MAX_NODES = 1_000_000  # values in one document, aliases expanded: bounds an "alias bomb"


_SafeLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 6x faster


class _Loader(_SafeLoader):
    """A safe loader (libyaml's parser where PyYAML has it) that reads ``1e9`` (no dot, no
    exponent sign: a string in YAML 1.1) as a number and refuses a key given twice in one
    mapping (YAML says keys are unique; PyYAML would silently keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$"
        r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    """One YAML document; ``yaml.YAMLError`` if it is malformed or, aliases expanded, holds
    more than ``MAX_NODES`` values (PyYAML shares an alias' object, so a "billion laughs"
    loads in microseconds and then hangs whatever walks it: a deepcopy, a sweep, a dump)."""
    if text.count("[") + text.count("{") > MAX_DEPTH:  # libyaml recurses: 10**5 levels crash it
        brackets = (1 if c in "[{" else -1 for c in re.findall(r"[\[\]{}]", text))
        if max(itertools.accumulate(brackets)) > MAX_DEPTH:
            raise yaml.YAMLError(f"nested more than {MAX_DEPTH} levels deep")
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise yaml.YAMLError(str(e).split(";")[0]) from None
    _count(data, [MAX_NODES])
    return data


def _count(value: Any, budget: list[int]) -> None:
    """Walk ``value`` (each alias as often as it is used), spending ``budget[0]``."""
    stack = [value]
    while stack:
        item = stack.pop()
        budget[0] -= 1
        if budget[0] < 0:
            raise yaml.YAMLError(
                f"more than {MAX_NODES:,} values once aliases are expanded (an alias bomb?)"
            )
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def typed_value(text: str) -> Any:
    """A value typed on the command line (``--set``, ``cost --methods``): read as YAML, or
    kept as typed where it is not YAML at all; what a file would refuse for what it asks (a
    tag such as ``!!python/object``, a key twice) raises ``yaml.constructor.ConstructorError``
    alike, since taken as plain text it would hide the refusal."""
    try:
        return parse_yaml(text)
    except yaml.constructor.ConstructorError:
        raise
    except yaml.YAMLError:
        return text


def yaml_problem(e: yaml.YAMLError) -> str:
    """Why YAML text is refused, in one line, with its line where the parser knows it."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}" if mark else ""
    return f"not valid YAML{where}: {getattr(e, 'problem', e)}"


def read_yaml(path: Path, what: str = "file") -> dict[str, Any]:
    """Read a YAML mapping; a missing or malformed file is a ``ConfigError`` naming it."""
    if not path.is_file():
        raise ConfigError("", f"no such {what}", file=str(path))
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(
                "", f"is {size / 2**20:.0f} MB; the limit is {MAX_FILE_BYTES >> 20} MB", str(path)
            )
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError("", f"cannot read {what}: {e.strerror}", str(path)) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            "", f"not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})", str(path)
        ) from None
    return parse_mapping(text, str(path))


def parse_mapping(text: str, name: str) -> dict[str, Any]:
    """YAML text that must hold a mapping (a file's, or text given from Python); a
    ``ConfigError`` naming ``name`` if it does not."""
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError("", yaml_problem(e), name) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", "must be a YAML mapping of keys", file=name)
    return data


def find_file(name: str, base: Path) -> Path | None:
    """The file an experiment at ``base`` names by a relative ``name`` (``topology.file``,
    ``peers.profile``, ``plugins``): as given (from the current directory), next to the
    experiment file, or one directory above it; ``None`` if none of these is a file."""
    candidates = [Path(name), base.parent / name, base.parent.parent / name]
    return next((p for p in candidates if p.is_file()), None)
