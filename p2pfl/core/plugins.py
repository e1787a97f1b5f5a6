"""Plug-ins: the user's own modules, whose ``@REGISTRY.register("name")`` calls extend p2pfl.

Two ways in (docs/extending.md):

- an experiment's ``plugins: [...]`` list names Python modules (dotted names, importable from
  ``sys.path`` or found next to the experiment file) or ``.py`` files, found like
  ``topology.file``: as given, next to the experiment file, or one directory above it;
- every installed distribution that declares an entry point in the group ``p2pfl.plugins``
  (its value a module name) is imported once per process, so a package extends p2pfl with
  no YAML at all.

A file is imported the way Python imports a script's neighbours: the directory above its
enclosing packages goes to the end of ``sys.path`` and the file is imported under its
dotted name. So a file is executed once per process however often it is named (by path or
by name, once per sweep cell), and it may import its own helper modules.

:func:`load_plugins` returns the list resolved for the run's ``config.yaml`` (module names
as given, files as absolute paths), from which ZeroMQ children, ``p2pfl peer`` on other
hosts, sweep cells and ``p2pfl cost`` import the same plug-ins. Every failure (a missing
file, a syntax error, an exception at import, ``sys.exit`` at import, a name registered
twice) is a one-line ``ConfigError`` on the key ``plugins``. An import that lasts more than
:data:`SLOW_IMPORT_S` is named on stderr; Ctrl-C ends it as an interrupt that names it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from p2pfl.core.errors import ConfigError
from p2pfl.core.yaml_io import find_file

GROUP = "p2pfl.plugins"
"""The entry-point group of installed plug-ins."""
SLOW_IMPORT_S = 5.0
"""After this long importing one plug-in, stderr says which (one that never ends would hang
with no word)."""

_installed_loaded = False


def load_plugins(entries: Any, experiment: Path) -> list[str]:
    """Import the installed plug-ins (once per process), then ``entries``, the ``plugins:``
    list of the experiment file ``experiment``; return the list as ``config.yaml`` records it."""
    load_installed()
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(
            "plugins", f"must be a list of module names or .py files, got {entries!r}"
        )
    return [_load(entry, experiment) for entry in entries]


def load_installed() -> None:
    """Import every module named in the ``p2pfl.plugins`` entry-point group, once per process."""
    global _installed_loaded
    if _installed_loaded:
        return
    for ep in importlib.metadata.entry_points(group=GROUP):
        where = f"entry point {ep.name} = {ep.value} of {getattr(ep.dist, 'name', '?')}"
        try:
            with _importing(where):
                ep.load()
        except ConfigError as e:
            raise ConfigError("plugins", f"{where}: {e.message}") from None
        except Exception as e:
            raise ConfigError("plugins", f"{where}: {_describe(e)}") from None
    _installed_loaded = True


def _load(entry: str, experiment: Path) -> str:
    """Import one ``plugins:`` entry; return its resolved form."""
    try:
        with _importing(entry):
            return _find_and_import(entry, experiment)
    except ConfigError as e:  # ours, or a plug-in registering a name that exists
        raise ConfigError("plugins", f"{entry}: {e.message}") from None
    except Exception as e:
        raise ConfigError("plugins", f"{entry}: {_describe(e)}") from None


@contextmanager
def _importing(what: str) -> Iterator[None]:
    """Around one plug-in's import: named on stderr if it lasts :data:`SLOW_IMPORT_S`; its
    ``sys.exit`` is an error (a run would end with exit 0 and nothing written); Ctrl-C or
    SIGTERM end it as an interrupt that names it."""
    timer = threading.Timer(SLOW_IMPORT_S, _say_slow, (what,))
    timer.daemon = True
    timer.start()
    try:
        yield
    except SystemExit as e:
        raise ConfigError("", f"called sys.exit({e.code!r}) while imported") from None
    except KeyboardInterrupt as e:
        raise KeyboardInterrupt(f"{str(e) or 'SIGINT'} while importing plug-in {what}") from None
    finally:
        timer.cancel()


def _say_slow(what: str) -> None:
    sys.stderr.write(
        f"p2pfl: still importing plug-in {what} after {SLOW_IMPORT_S:g} s (Ctrl-C stops it)\n"
    )
    sys.stderr.flush()


def _find_and_import(entry: str, experiment: Path) -> str:
    """Find one ``plugins:`` entry (a file, or a module) and import it."""
    if entry.endswith(".py"):
        path = find_file(entry, experiment)
        if path is None:
            raise ConfigError(
                "", "no such file (looked in ., next to the experiment file and above)"
            )
        return _import_file(path.resolve())
    if not all(part.isidentifier() for part in entry.split(".")):
        raise ConfigError("", "neither a .py file nor a dotted module name")
    if _on_sys_path(entry):
        importlib.import_module(entry)
        return entry
    rel = Path(*entry.split("."))
    path = find_file(f"{rel}.py", experiment) or find_file(str(rel / "__init__.py"), experiment)
    if path is None:
        raise ConfigError(
            "", f"no module named {entry!r} on sys.path or next to the experiment file"
        )
    return _import_file(path.resolve())


def _on_sys_path(name: str) -> bool:
    """Whether the module ``name`` can be imported from ``sys.path`` as it is."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _import_file(path: Path) -> str:
    """Import the ``.py`` file ``path`` (absolute) under its dotted name; return ``path``."""
    parts = [] if path.name == "__init__.py" else [path.stem]
    root = path.parent
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    if str(root) not in sys.path:
        sys.path.append(str(root))
    name = ".".join(parts)
    module = importlib.import_module(name)
    found = getattr(module, "__file__", None)
    if found is None or Path(found).resolve() != path:
        raise ConfigError("", f"the module name {name!r} is taken by {found}; rename the file")
    return str(path)


def _describe(e: Exception) -> str:
    """An import failure in one line: the exception and where in the user's code it arose."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
    if frames and not isinstance(e, SyntaxError):  # a SyntaxError names its line itself
        text += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return text
