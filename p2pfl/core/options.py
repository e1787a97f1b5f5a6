"""Bind YAML option dicts to the keyword arguments of registered components.

A component (dataset loader, partitioner, model, method, ...) is a plain function or class
whose keyword arguments *are* its YAML keys: names, defaults and types come from its
signature. ``bind`` rejects unknown keys and wrong types with a :class:`ConfigError` that
names the key, so every component gets the same checks without writing them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, Generic, Literal, TypeVar, get_args, get_origin, get_type_hints

from p2pfl.core.errors import ConfigError

T = TypeVar("T", bound=Callable[..., Any])


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    return {type(None): "null", float: "number", int: "integer", bool: "true/false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


class _OutOfRange(TypeError):
    """The right kind of value, out of what any option accepts (NaN, 2**64)."""


def check_type(value: Any, tp: Any) -> Any:
    """Return ``value`` converted to ``tp`` (int -> float, list -> tuple), or raise TypeError."""
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise TypeError(f"must be one of {', '.join(repr(a) for a in get_args(tp))}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        bound: _OutOfRange | None = None
        for arg in get_args(tp):
            try:
                return check_type(value, arg)
            except _OutOfRange as e:
                bound = e
            except TypeError:
                continue
        raise bound or TypeError(f"must be {_type_name(tp)}, got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"must be {_type_name(tp)}, got {value!r}")
        (inner, *_) = get_args(tp) or (Any,)
        items = [check_type(v, inner) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise TypeError(f"must be a mapping, got {value!r}")
        if not get_args(tp):
            return value
        kt, vt = get_args(tp)
        return {check_type(k, kt): check_type(v, vt) for k, v in value.items()}
    if tp is type(None):
        if value is None:
            return None
        raise TypeError(f"must be null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if isinstance(value, float) or abs(value) < 2**1000 else math.inf
            if not math.isfinite(number):  # NaN passes every ``x <= 0`` check
                shown = f"{value:.3g}" if isinstance(value, float) else "an integer beyond 2**1000"
                raise _OutOfRange(f"must be a finite number, got {shown}")
            return number
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) >= 2**63:  # numpy and torch take 64-bit integers
                raise _OutOfRange(f"must be an integer below 2**63, got {value}")
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(value, tp):
        return value
    raise TypeError(f"must be {_type_name(tp)}, got {value!r}")


def parameters(fn: Callable[..., Any], skip: int = 0) -> dict[str, inspect.Parameter]:
    """The keyword options of ``fn``: its parameters after the first ``skip`` positional ones."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    return {p.name: p for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


@functools.cache
def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """The annotations of ``fn``'s keywords (a dataclass's fields), resolved once per
    component: resolving them compiles each string annotation anew, about 70 µs a bind (a
    run binds its model's keys for every model it builds, a method's overrides for every
    training)."""
    if dataclasses.is_dataclass(fn):
        return get_type_hints(fn)
    return get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)


def bind(
    fn: Callable[..., Any], options: dict[str, Any], skip: int = 0, also: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Check ``options`` against ``fn``'s signature and return the full keyword dict.

    Missing keys take their defaults; a key without a default must be given. Errors name
    the key relative to the section (the caller adds the prefix with ``ConfigError.within``);
    an unknown key's error lists the valid ones, with ``also``: keys of the section that the
    caller handles itself (``name``, ``kind``, an included ``file``).
    """
    params, hints = parameters(fn, skip), _type_hints(fn)
    unknown = sorted(set(options) - set(params), key=str)
    if unknown:
        raise unknown_key(unknown[0], [*params, *also])
    out: dict[str, Any] = {}
    for name, p in params.items():
        if name in options:
            try:
                out[name] = check_type(options[name], hints.get(name, Any))
            except TypeError as e:
                raise ConfigError(name, str(e)) from None
        elif p.default is inspect.Parameter.empty:
            raise ConfigError(name, "missing required key")
        else:
            out[name] = p.default
    return out


def bind_with_common(
    fn: Callable[..., Any],
    common: Callable[..., Any],
    options: dict[str, Any],
    skip: int = 0,
    common_skip: int = 0,
    also: tuple[str, ...] = ("name",),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Bind one YAML section whose keys belong partly to ``fn`` and partly to ``common``.

    ``options`` excludes the keys in ``also`` (``name``). Returns the keyword dicts for
    ``fn`` and ``common``; an unknown key names every valid key of the section, not just
    one side's.
    """
    own, shared = parameters(fn, skip), parameters(common, common_skip)
    unknown = sorted(set(options) - set(own) - set(shared), key=str)
    if unknown:
        raise unknown_key(unknown[0], [*own, *shared, *also])
    mine = {k: v for k, v in options.items() if k in own}
    theirs = {k: v for k, v in options.items() if k in shared}
    return bind(fn, mine, skip), bind(common, theirs, common_skip)


def unknown_key(key: str, valid: list[str]) -> ConfigError:
    """The error for a key a section does not have, listing the keys it has."""
    listed = ", ".join(sorted(set(valid), key=str)) or "(none)"
    return ConfigError(key, f"unknown key; valid keys are: {listed}")


class Registry(Generic[T]):
    """Named components of one kind (``"dataset"``, ``"model"``, ...), open to plug-ins.

    ``@REGISTRY.register("name")`` adds a function or class under its YAML name and, for a
    class, sets its ``name`` attribute, so the name is written once.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(fn: T) -> T:
            if name in self._items:
                where = getattr(self._items[name], "__module__", "?")
                raise ConfigError("", f"{self.kind} {name!r} is already registered (by {where})")
            if inspect.isclass(fn):
                fn.name = name  # type: ignore[attr-defined]
            self._items[name] = fn
            return fn

        return deco

    def get(self, name: Any) -> T:
        if not isinstance(name, str) or name not in self._items:
            raise ConfigError(
                "name", f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            )
        return self._items[name]

    def resolve(self, option: str | dict[str, Any], skip: int = 0) -> dict[str, Any]:
        """A component named, or a mapping with ``name`` and its keys, checked against the
        registered component's signature (its first ``skip`` parameters are not keys):
        ``{name, **keys}`` with the defaults filled in — what ``config.yaml`` holds."""
        if isinstance(option, str):
            option = {"name": option}
        if "name" not in option:
            raise ConfigError("name", f"missing; choose one of: {', '.join(self.names())}")
        fn = self.get(option["name"])
        rest = {k: v for k, v in option.items() if k != "name"}
        return {"name": option["name"]} | bind(fn, rest, skip, also=("name",))

    def names(self) -> list[str]:
        return sorted(self._items)

    def __iter__(self) -> Iterator[tuple[str, T]]:
        return iter(sorted(self._items.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._items
