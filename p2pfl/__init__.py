"""p2pfl: a peer-to-peer federated-learning simulator.

Methods are written once as peer behaviours (:mod:`p2pfl.methods.effects`); runtimes
(:mod:`p2pfl.runtime`) run them on a simulated network or over sockets. From Python,
``p2pfl.run``, ``p2pfl.sweep`` and ``p2pfl.cost`` do what the command line does
(:mod:`p2pfl.app.library`); they are loaded on first use, so ``import p2pfl`` (and
``import p2pfl.core...``) stays light and imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pfl.app.library import Result, SweepResult, cost, run, sweep
    from p2pfl.core.errors import ConfigError, RunError

__version__ = "0.1.0"
__all__ = ["ConfigError", "Result", "RunError", "SweepResult", "cost", "run", "sweep"]

_LAZY = {
    "run": "p2pfl.app.library", "sweep": "p2pfl.app.library", "cost": "p2pfl.app.library",
    "Result": "p2pfl.app.library", "SweepResult": "p2pfl.app.library",
    "ConfigError": "p2pfl.core.errors", "RunError": "p2pfl.core.errors",
}  # fmt: skip
"""Each public name's module, imported when the name is first asked for."""


def __getattr__(name: str) -> Any:
    """``p2pfl.run`` and the rest of :data:`__all__`, imported on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module 'p2pfl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
