"""p2pfl from Python: :func:`run`, :func:`sweep` and :func:`cost` do what ``p2pfl run`` and
``p2pfl cost`` do, through the same code (:func:`p2pfl.app.cli.execute`,
:func:`p2pfl.app.cli.cost_table`), and hand back the outputs as Python objects (pandas
DataFrames read from the files the run wrote) instead of printing them.

- The experiment is a file path (``str`` or ``Path``), YAML text (a ``str`` holding a line
  break) or a mapping as a file would hold it (written out as YAML and read back, so it gives
  what the same text gives). Text and mappings are read as if from a file ``<yaml>`` or
  ``<dict>`` in the current directory: their relative paths (``topology.file``,
  ``peers.profile``, ``plugins``, ...) are found from the current directory, and errors name
  ``<yaml>`` or ``<dict>`` where the command line names the file.
- Overrides are keyword arguments: a dotted key path as ``--set`` takes it, written with
  ``__`` for each dot (``algorithm__rounds=3`` is ``--set algorithm.rounds=3``;
  ``**{"algorithm.rounds": 3}`` is the same). Values are Python values, set as given (a
  ``--set`` reads its text as YAML first). ``seed=`` is ``--seed``; ``transport=`` is
  ``--transport`` (the ``transport:`` section's keys are ``transport__KEY=...``).
- ``out=None`` writes to a fresh temporary directory (``Result.out``; removed again if the
  experiment is refused before anything was written). An existing ``out`` follows the command
  line's rules: one that holds anything is refused unless ``force=True`` (``--force``, which
  empties it only if it holds a p2pfl run or sweep and nothing else).
- Errors raise :class:`~p2pfl.core.errors.ConfigError` (bad config or arguments) or
  :class:`~p2pfl.core.errors.RunError` (a run that failed), ``str(e)`` being the line the
  command line prints after ``error:``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from p2pfl.app import cli
from p2pfl.core.errors import ConfigError
from p2pfl.core.yaml_io import parse_mapping, parse_yaml

Experiment = str | os.PathLike[str] | Mapping[str, Any]
"""A file path, YAML text, or a mapping (see the module's docstring)."""
AVAILABILITY_COLUMNS = ["peer", "online_from", "online_to"]
"""``availability.csv``'s header (:func:`p2pfl.app.experiment.save_availability`)."""


@dataclass(frozen=True)
class Result:
    """A finished run's outputs, read from its directory ``out``."""

    out: Path
    summary: dict[str, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        summary = json.loads((self.out / "summary.json").read_text())
        object.__setattr__(self, "summary", summary)

    @cached_property
    def config(self) -> dict[str, Any]:
        """The resolved configuration (``config.yaml``)."""
        return yaml.safe_load((self.out / "config.yaml").read_text())

    @cached_property
    def metrics(self) -> pd.DataFrame:
        """``metrics.csv``: one row per evaluation."""
        return pd.read_csv(self.out / "metrics.csv")

    @cached_property
    def comm(self) -> pd.DataFrame:
        """``comm.csv``: one row per message."""
        return pd.read_csv(self.out / "comm.csv")

    @cached_property
    def availability(self) -> pd.DataFrame:
        """``availability.csv`` (with churn); without it, an empty table of its columns."""
        path = self.out / "availability.csv"
        return pd.read_csv(path) if path.is_file() else pd.DataFrame(columns=AVAILABILITY_COLUMNS)

    def plot(self, out: str | os.PathLike[str] | None = None) -> list[Path]:
        """Draw the run's figures as ``p2pfl plot`` does (into ``out``, default
        ``OUT/plots``); the files written."""
        return _plot(self.out, out)


@dataclass(frozen=True)
class SweepResult:
    """A finished sweep's outputs: ``table`` (``sweep.csv``: mean ± std per combination of
    the non-seed keys), ``cells`` (``cells.csv``: one row per cell, its ``status`` ``ok``,
    ``done``, ``skipped`` or ``failed``), and ``runs``, the Result of each cell that ran, by
    cell name. A failed cell (the command line's exit code 1) raises nothing: its row says so."""

    out: Path
    table: pd.DataFrame
    cells: pd.DataFrame
    runs: dict[str, Result]

    def plot(self, out: str | os.PathLike[str] | None = None) -> list[Path]:
        """Draw the sweep's figures as ``p2pfl plot`` does (into ``out``, default
        ``OUT/plots``); the files written."""
        return _plot(self.out, out)


def run(
    experiment: Experiment,
    *,
    out: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    transport: str = "sim",
    workers: int = 1,
    shard: bool = False,
    shard_events: bool = False,
    force: bool = False,
    progress: bool = False,
    **overrides: Any,
) -> Result:
    """Run one experiment (``p2pfl run``); ``progress`` shows its progress bar; ``shard``
    (with ``workers`` > 1) gives each rank its own share of the peers' models, and
    ``shard_events`` its own share of their events too (``--shard-events``)."""
    done = _execute(
        experiment, out, seed, transport, workers, force, progress, overrides, False,
        shard, shard_events,
    )  # fmt: skip
    return Result(done.out)


def sweep(
    experiment: Experiment,
    *,
    out: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    transport: str = "sim",
    workers: int = 1,
    force: bool = False,
    progress: bool = False,
    **overrides: Any,
) -> SweepResult:
    """Run a sweep (``p2pfl run`` on an experiment with a ``sweep:`` section; it prints a
    line per cell and the table, as the command line does); ``workers`` cells at a time."""
    done = _execute(experiment, out, seed, transport, workers, force, progress, overrides, True)
    cells = pd.read_csv(done.out / "cells.csv", dtype={"reason": str}).fillna({"reason": ""})
    runs = {
        name: Result(done.out / name)
        for name, status in zip(cells["cell"], cells["status"], strict=True)
        if status in ("ok", "done")
    }
    table = pd.read_csv(done.out / "sweep.csv", dtype={"note": str}).fillna({"note": ""})
    return SweepResult(done.out, table, cells, runs)


def cost(
    experiment: Experiment,
    *,
    methods: str | None = None,
    topologies: str = "ring,mesh,star",
    peers: int | None = None,
    model_bytes: int | None = None,
    out: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    **overrides: Any,
) -> pd.DataFrame:
    """The analytic communication cost (``p2pfl cost``): its table, ``cost.csv``, written
    with its chart to ``out`` (named by the frame's ``attrs["out"]``)."""
    options = {"methods": methods, "topologies": topologies, "peers": peers}
    args = _arguments(experiment, out, seed, overrides, model_bytes=model_bytes, **options)
    with _output(args):
        written = cli.cost_table(args)[2]
    table = pd.read_csv(written / "cost.csv")
    table.attrs["out"] = written
    return table


def _execute(
    experiment: Experiment,
    out: str | os.PathLike[str] | None,
    seed: int | None,
    transport: str,
    workers: int,
    force: bool,
    progress: bool,
    overrides: dict[str, Any],
    sweep: bool,
    shard: bool = False,
    shard_events: bool = False,
) -> cli.Done:
    """:func:`p2pfl.app.cli.execute` on the command line's arguments for these."""
    if transport not in ("sim", "zmq"):
        raise ConfigError("--transport", f"must be sim or zmq, got {transport!r}")
    options = {"transport": transport, "workers": workers, "force": force, "shard": shard}
    options["shard_events"] = shard_events
    args = _arguments(experiment, out, seed, overrides, quiet=not progress, **options)
    with _output(args):
        return cli.execute(args, sweep)


def _arguments(
    experiment: Experiment,
    out: str | os.PathLike[str] | None,
    seed: int | None,
    overrides: dict[str, Any],
    **options: Any,
) -> argparse.Namespace:
    """The arguments the command line's parser gives for an experiment, its overrides as
    ``--set`` pairs, and the command's ``options`` (``out=None``: none yet, :func:`_output`
    makes one)."""
    name, given = _source(experiment)
    keys = [key.replace("__", ".") for key in overrides]
    sets = [(key, _plain(v, key, name)) for key, v in zip(keys, overrides.values(), strict=True)]
    return argparse.Namespace(
        experiment=name,
        given=given,
        sets=sets,
        seed=seed,
        out=None if out is None else str(out),
        **options,
    )


def _source(experiment: Experiment) -> tuple[str, dict[str, Any] | None]:
    """The experiment's file name and, for text or a mapping, its contents."""
    if isinstance(experiment, Mapping):
        return "<dict>", parse_mapping(_yaml_text(dict(experiment), "", "<dict>"), "<dict>")
    if isinstance(experiment, str) and "\n" in experiment:
        return "<yaml>", parse_mapping(experiment, "<yaml>")
    if isinstance(experiment, str | os.PathLike):
        return os.fspath(experiment), None
    raise TypeError(f"an experiment is a path, YAML text or a mapping, not {type(experiment)}")


def _plain(value: Any, key: str, name: str) -> Any:
    """An override's value as YAML would read it back (what ``config.yaml`` records)."""
    return parse_yaml(_yaml_text(value, key, name))


def _yaml_text(value: Any, key: str, name: str) -> str:
    """``value`` as YAML text; a ``ConfigError`` if it holds what YAML cannot write."""
    try:
        return yaml.safe_dump(value, sort_keys=False)
    except yaml.YAMLError as e:
        held = e.args[-1] if e.args else None  # PyYAML's RepresenterError: (why, value)
        raise ConfigError(
            key, f"holds {type(held).__name__} {held!r}: use plain Python values", name
        ) from None


@contextmanager
def _output(args: argparse.Namespace) -> Iterator[None]:
    """``args.out`` set to a fresh temporary directory where none was given (removed again
    if the command fails having written nothing in it)."""
    if args.out is not None:
        yield
        return
    args.out = tempfile.mkdtemp(prefix="p2pfl-")
    try:
        yield
    except BaseException:
        if not any(Path(args.out).iterdir()):
            os.rmdir(args.out)
        raise


def _plot(run_dir: Path, out: str | os.PathLike[str] | None) -> list[Path]:
    """``p2pfl plot RUN_DIR [--out OUT]``."""
    from p2pfl.reporting.plots import plot_runs

    return plot_runs([run_dir], cli.output_dir(str(run_dir / "plots" if out is None else out)))
