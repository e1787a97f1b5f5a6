"""The reference pages of the docs site, generated from the code so they cannot drift.

:func:`yaml_reference` walks every section of an experiment file and every component
registered for it (methods, models, datasets, partitioners, graphs, codecs, attacks,
aggregators, reporters, and whatever a plug-in adds): each key with its type and default
from the component's signature (or dataclass fields) and its meaning from its docstring.
:func:`cli_reference` renders the argument parser of :mod:`p2pfl.app.cli`. The docs build
(``docs/hooks/reference.py``, run by ``mkdocs build``) writes both as pages, and
``tests/test_docs_site.py`` fails when a key has no description.

A key's meaning is found, in this order, in

- a bullet of the component's docstring (or of a base class's): ``- ``key``: meaning``,
  several keys sharing one as ``- ``a`` / ``b``: meaning``;
- an ``Args:``, ``Keys:``, ``Attributes:`` or ``Parameters:`` section of that docstring,
  one entry per key (``key: meaning`` or ``key (type): meaning``, continued on lines
  indented deeper);
- for a dataclass field: the string right below the field (an attribute docstring), or
  the comment at the end of its line, or ``#:`` comments right above it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from p2pfl.core.options import _type_hints, _type_name, parameters


@dataclass
class Key:
    """One YAML key: its name (relative to its table), type, default and meaning."""

    name: str
    type: str
    default: str
    meaning: str


@dataclass
class Table:
    """The keys of one section or one component, under a heading."""

    title: str  # e.g. ``algorithm: fedavg``
    path: str  # the keys' prefix in a file, e.g. ``algorithm`` or ``network.churn``
    summary: str
    keys: list[Key] = field(default_factory=list)
    level: int = 3
    source: str = ""  # the object the keys come from, for a test's message


# --- docstrings -------------------------------------------------------------------------

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Keys|Attributes|Parameters):\s*$")
_ENTRY = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_BULLET = re.compile(r"^(\s*)[-*] ((?:``\w+``(?:\s*(?:/|,|and)\s*)?)+)\s*:\s*(.*)$")


def _join(lines: Iterable[str]) -> str:
    return " ".join(line.strip() for line in lines if line.strip())


def docstring_keys(doc: str | None) -> dict[str, str]:
    """The keys a docstring describes (bullets and ``Args:``-like sections): name -> meaning."""
    if not doc:
        return {}
    lines = inspect.cleandoc(doc).splitlines()
    out: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        bullet = _BULLET.match(line)
        section = _SECTION.match(line)
        if bullet:
            indent = len(bullet.group(1))
            body = [bullet.group(3)]
            i += 1
            while i < len(lines) and lines[i].strip() and _indent(lines[i]) > indent:
                body.append(lines[i])
                i += 1
            for name in re.findall(r"``(\w+)``", bullet.group(2)):
                out.setdefault(name, _join(body))
            continue
        if section:
            base = len(section.group(1))
            i += 1
            entry: tuple[str, list[str]] | None = None
            entry_indent = -1
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
                text = lines[i]
                match = _ENTRY.match(text.strip())
                if text.strip() and match and (entry is None or _indent(text) <= entry_indent):
                    if entry:
                        out.setdefault(entry[0], _join(entry[1]))
                    entry, entry_indent = (match.group(1), [match.group(2)]), _indent(text)
                elif entry and text.strip():
                    entry[1].append(text)
                i += 1
            if entry:
                out.setdefault(entry[0], _join(entry[1]))
            continue
        i += 1
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _field_docs(cls: type) -> dict[str, str]:
    """A class body's field descriptions: attribute docstrings, end-of-line comments and
    ``#:`` comments above a field."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string
    except (tokenize.TokenError, SyntaxError):
        pass
    lines = source.splitlines()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    out: dict[str, str] = {}
    for n, node in enumerate(body.body):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        name = node.target.id
        following = body.body[n + 1] if n + 1 < len(body.body) else None
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            out[name] = _join(inspect.cleandoc(following.value.value).splitlines())
            continue
        end = node.end_lineno or node.lineno
        trailing = comments.get(end)
        if trailing and lines[end - 1].strip().startswith("#") is False:
            out[name] = trailing.lstrip("#:").strip()
            continue
        above: list[str] = []
        row = node.lineno - 1
        while row >= 1 and lines[row - 1].strip().startswith("#:"):
            above.insert(0, lines[row - 1].strip()[2:])
            row -= 1
        if above:
            out[name] = _join(above)
    return out


@functools.cache
def key_docs(obj: Any) -> dict[str, str]:
    """Every key description of a component: its docstring's, then its bases' (a method's
    ``rounds`` is described once, in :class:`p2pfl.methods.base.Rounds`), then fields'."""
    out: dict[str, str] = {}
    chain = [c for c in inspect.getmro(obj) if c is not object] if inspect.isclass(obj) else [obj]
    for part in chain:
        for name, text in docstring_keys(part.__doc__).items():
            out.setdefault(name, text)
        if inspect.isclass(part):
            init = part.__dict__.get("__init__")
            if init is not None and not dataclasses.is_dataclass(part):
                for name, text in docstring_keys(init.__doc__).items():
                    out.setdefault(name, text)
            for name, text in _field_docs(part).items():
                out.setdefault(name, text)
    return out


def summary(obj: Any) -> str:
    """The first paragraph of a component's docstring, on one line."""
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and obj.__doc__ is None:
        return ""
    return _join(doc.split("\n\n", 1)[0].splitlines())


# --- keys from signatures ---------------------------------------------------------------


def _shown(value: Any) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    if value is None:
        return "—"
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return f"`{text.removesuffix('...').strip()}`"


def _default(fn: Any, p: inspect.Parameter) -> Any:
    if dataclasses.is_dataclass(fn):
        for f in dataclasses.fields(fn):
            if f.name == p.name and f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return p.default


def keys_of(
    fn: Any, skip: int = 0, docs: dict[str, str] | None = None, only: Iterable[str] | None = None
) -> list[Key]:
    """The keys of a component: its keyword parameters after the first ``skip``."""
    params = parameters(fn, skip)
    try:
        hints = _type_hints(fn)
    except Exception:  # an annotation that does not resolve: show none
        hints = {}
    described = key_docs(fn) | (docs or {})
    names = list(params) if only is None else [n for n in only if n in params]
    return [
        Key(
            name,
            _type_name(hints[name]) if name in hints else "any",
            _shown(_default(fn, params[name])),
            described.get(name, ""),
        )
        for name in names
    ]


# --- the YAML reference -----------------------------------------------------------------


def _registry_tables(
    section: str,
    registry: Any,
    skip: int,
    key: str = "name",
    drop: Iterable[str] = (),
) -> list[Table]:
    tables = []
    for name, fn in registry:
        table = Table(
            f"`{section}: {{{key}: {name}}}`",
            section,
            summary(fn),
            [k for k in keys_of(fn, skip) if k.name not in set(drop)],
            level=3,
            source=f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', name)}",
        )
        tables.append(table)
    return tables


def yaml_tables() -> list[Table]:
    """Every section of an experiment file and every registered component, as tables."""
    from p2pfl.app import config
    from p2pfl.app import sweep as sweep_module
    from p2pfl.data.datasets import DATASETS, take_subsets
    from p2pfl.data.federated import SplitOptions
    from p2pfl.data.partition import PARTITIONERS
    from p2pfl.learning.models import MODELS, _model_keys
    from p2pfl.learning.pans import Pans
    from p2pfl.learning.robust import AGGREGATORS
    from p2pfl.learning.training import TrainConfig
    from p2pfl.methods import METHODS
    from p2pfl.methods.attacks.base import ATTACKS
    from p2pfl.methods.attacks.base import _section as adversary_keys
    from p2pfl.methods.cost_only import COST_ONLY
    from p2pfl.methods.relaxed import RelaxedInit
    from p2pfl.network import dynamics
    from p2pfl.network.codecs import CODECS, KINDS
    from p2pfl.network.peers import build_population, resolve_peers
    from p2pfl.network.topology import GRAPHS, _shared_keys
    from p2pfl.reporting.matching import MatchingConfig
    from p2pfl.reporting.reporters import REPORTERS
    from p2pfl.runtime.setup import EvalConfig, StopConfig, TransportConfig

    top = docstring_keys(config.__doc__)
    tables: list[Table] = [
        Table(
            "Top level",
            "",
            "An experiment file is one YAML mapping with these keys.",
            [
                Key(
                    name,
                    "section" if name not in ("name", "seed", "plugins") else "",
                    "required"
                    if name in config.REQUIRED
                    else _shown(config.DEFAULTS.get(name, None)),
                    top.get(name, ""),
                )
                for name in (*config.SECTIONS, "sweep")
            ],
            level=2,
            source="p2pfl.app.config (module docstring)",
        )
    ]
    tables[0].keys[0].type, tables[0].keys[1].type = "string", "integer"
    tables[0].keys[[k.name for k in tables[0].keys].index("plugins")].type = "list of string"

    def common(title: str, path: str, fn: Any, skip: int = 0, **kw: Any) -> Table:
        return Table(title, path, summary(fn), keys_of(fn, skip, **kw), 3, fn.__qualname__)

    def section(name: str, text: str) -> Table:
        return Table(f"`{name}`", name, text, [], 2)

    tables.append(section("dataset", _doc(config, "dataset")))
    tables.append(common("Every dataset", "dataset", take_subsets, 2))
    tables += _registry_tables("dataset", DATASETS, 0)
    tables.append(section("partition", _doc(config, "partition")))
    tables.append(common("Every partitioner", "partition", SplitOptions))
    tables += _registry_tables("partition", PARTITIONERS, 3)
    tables.append(section("model", _doc(config, "model")))
    tables.append(common("Every model", "model", _model_keys))
    tables.append(common("`model.pans`", "model.pans", Pans))
    tables += _registry_tables("model", MODELS, 2)
    tables.append(section("topology", _doc(config, "topology")))
    shared = common("Every topology", "topology", _shared_keys)
    shared.keys.insert(0, Key("file", "string", "—", key_docs(_shared_keys).get("file", "")))
    tables.append(shared)
    tables += _registry_tables("topology", GRAPHS, 2, key="kind")
    peers = common("`peers`", "peers", build_population, 1)
    peers.level, peers.summary = 2, _doc(config, "peers")
    peers.keys.insert(1, Key("profile", "string", "—", key_docs(resolve_peers).get("profile", "")))
    tables.append(peers)
    tables.append(section("algorithm", _doc(config, "algorithm")))
    tables += _registry_tables("algorithm", METHODS, 0)
    tables.append(common("`algorithm.relaxed_init`", "algorithm.relaxed_init", RelaxedInit))
    tables += _registry_tables("algorithm.aggregator", AGGREGATORS, 0)
    cost_only = _registry_tables("algorithm", COST_ONLY, 0)
    for t in cost_only:
        t.title += " (`p2pfl cost` only)"
    tables += cost_only
    for name, fn, text in (
        ("train", TrainConfig, ""),
        ("eval", EvalConfig, ""),
        ("transport", TransportConfig, ""),
        ("stop", StopConfig, ""),
    ):
        t = common(f"`{name}`", name, fn)
        t.level, t.summary = 2, text or summary(fn)
        tables.append(t)
        if name == "eval":
            tables.append(common("`eval.matching`", "eval.matching", MatchingConfig))
            tables.append(
                Table(
                    "`eval.reporters`",
                    "eval.reporters",
                    "Where the rows of `metrics.csv` also go: a list of these names.",
                    [Key(r, "name", "—", summary(cls)) for r, cls in REPORTERS],
                    3,
                    "p2pfl.reporting.reporters.REPORTERS",
                )
            )
    tables.append(section("compression", _doc(config, "compression")))
    kinds = Table(
        "Message kinds",
        "compression",
        "Keys of `compression:` are message kinds, each a mapping `{codec: NAME, ...}`.",
        [Key(kind, "mapping", "—", f"the codec of `{kind}` messages") for kind in KINDS],
        3,
        "p2pfl.network.codecs.KINDS",
    )
    tables.append(kinds)
    tables += _registry_tables("compression.KIND", CODECS, 0, key="codec")
    network = common("`network`", "network", dynamics.NetworkConfig)
    network.level = 2
    tables.append(network)
    for path, cls in (
        ("network.churn", dynamics.Churn),
        ("network.churn.online", dynamics.Distribution),
        ("network.crashes", dynamics.Crashes),
        ("network.links", dynamics.LinkFaults),
        ("network.links.partitions[]", dynamics.Partition),
        ("network.graph", dynamics.GraphChanges),
    ):
        tables.append(common(f"`{path}`", path, cls))
    adversary = common("`adversary`", "adversary", adversary_keys)
    adversary.level, adversary.summary = 2, _doc(config, "adversary")
    tables.append(adversary)
    tables += _registry_tables("adversary.attack", ATTACKS, 0)
    tables.append(section("sweep", summary(sweep_module) + " " + _doc(config, "sweep")))
    return tables


def _doc(module: Any, name: str) -> str:
    """A top-level key's description from the module docstring of :mod:`p2pfl.app.config`."""
    return docstring_keys(module.__doc__).get(name, "")


def missing_descriptions(tables: Iterable[Table] | None = None) -> list[str]:
    """``path.key (source)`` for every key without a meaning, and every component without a
    summary: what the docs test fails on."""
    out = []
    for t in yaml_tables() if tables is None else tables:
        if t.level == 3 and t.title.startswith("`") and not t.summary:
            out.append(f"{t.title} has no docstring ({t.source})")
        out += [f"{t.path}.{k.name} ({t.source})" for k in t.keys if not k.meaning.strip()]
    return out


_ROLE = re.compile(r":\w+:`~?([^`]+)`")
_TYPES = {"str": "string", "dict": "mapping", "Any": "any", "bool": "true/false"}


def markdown(text: str) -> str:
    """Docstring text as Markdown: ````code```` and ``:mod:`x``` roles become `` `code` ``."""
    return _ROLE.sub(r"`\1`", text).replace("``", "`")


def _cell(text: str) -> str:
    return markdown(text).replace("|", "\\|").replace("\n", " ")


def _type(text: str) -> str:
    return re.sub(r"\b(str|dict|Any|bool)\b", lambda m: _TYPES[m.group(1)], text)


def yaml_reference() -> str:
    """The YAML reference page, in Markdown."""
    out = [
        "# Experiment files (YAML reference)",
        "",
        "Generated from the code by `p2pfl/app/reference.py` each time the site is built: every",
        "section of an experiment file and every key of every registered component (plug-ins",
        "included), with its type and default from the component's signature and its meaning",
        "from its docstring. A value shown as `—` is unset (`null`); `required` must be given.",
        "Any key can also be set from the command line with `--set section.key=value`.",
        "",
    ]
    for t in yaml_tables():
        out += ["#" * t.level + " " + t.title, ""]
        if t.summary:
            out += [markdown(t.summary[:1].upper() + t.summary[1:]), ""]
        if t.keys:
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
            out += [
                f"| `{k.name}` | {_cell(_type(k.type))} | {_cell(k.default)} | {_cell(k.meaning)} |"
                for k in t.keys
            ]
            out.append("")
    return "\n".join(out) + "\n"


# --- the command line -------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "." if text else ""


def cli_reference(parser_fn: Callable[[], argparse.ArgumentParser] | None = None) -> str:
    """The command-line reference page, in Markdown, from :func:`p2pfl.app.cli.parser`."""
    if parser_fn is None:
        from p2pfl.app.cli import parser as default_parser

        parser_fn = default_parser
    parser = parser_fn()
    helps = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
    out = [
        "# Command line",
        "",
        "Generated from the argument parser (`p2pfl/app/cli.py`) each time the site is built.",
        "`python -m p2pfl ...` is the same as `p2pfl ...`. Exit codes: `0` success; `2` a bad",
        "configuration or argument, one line `error: FILE: key.path: what is wrong`, before",
        "anything is written; `1` a run that started and failed (what it wrote stays, and",
        '`summary.json` says `"status": "failed"`); `130` interrupted (Ctrl-C or SIGTERM).',
        "",
    ]
    for name, sub in _subparsers(parser).items():
        usage = " ".join(sub.format_usage().split())
        out += [f"## `p2pfl {name}`", "", _sentence(helps.get(name, "")), ""]
        out += ["```", usage.removeprefix("usage: "), "```", ""]
        out += ["| argument | default | meaning |", "|---|---|---|"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = ", ".join(action.option_strings) or action.dest.upper()
            if action.option_strings and action.nargs != 0:
                flag += f" {action.metavar or action.dest.upper()}"
            default = action.default
            if action.nargs == 0 or default in (None, argparse.SUPPRESS, [], ()):
                default_text = "—"
            else:
                default_text = f"`{default}`"
            out.append(f"| `{_cell(flag)}` | {default_text} | {_cell(action.help or '')} |")
        out.append("")
    return "\n".join(out) + "\n"
