"""Sweeps: one experiment file, a grid of values, one run per cell, one comparison table.

An experiment with a top-level ``sweep:`` mapping runs once per combination of its values
(the Cartesian product, keys varying left to right, the last fastest). A key is a section
name (``algorithm``, ``topology``, ``seed``, ...) or a dotted key path as in ``--set``
(``algorithm.alpha``). For a section, a mapping value replaces the whole section and a
string is shorthand for ``{kind: VALUE}`` (topology) or ``{name: VALUE}`` (every other
section); dotted keys are set after the sections. Every cell is resolved and built (the
validation phase of :func:`p2pfl.app.experiment.build`) before any runs or anything is
written: a bad cell stops the sweep at once, naming the cell and the key (exit code 2).
Only a cell whose method does not fit its topology is skipped, with the reason; a cell
whose run fails is reported and the sweep goes on (exit code 1 at the end).

Cell ``i`` runs in ``OUT/KEY=LABEL,KEY=LABEL,...``; it is resumable: a cell whose
``summary.json`` says ``ok`` and whose ``config.yaml`` is the cell's config is not run
again. At the end the sweep writes ``cells.csv`` (one row per cell), ``sweep.csv`` (one
row per combination of the non-seed keys: mean ± sample std over its runs of final
accuracy, total bytes and simulated time; with ``eval.targets``, the time to accuracy:
:func:`tta_columns`), prints that table, and draws its figures
(:mod:`p2pfl.reporting.plots`). With ``workers`` > 1 (``--workers N``) the cells run that
many at a time, each in a process forked from this one; the tables come out the same.
"""

from __future__ import annotations

import copy
import csv
import functools
import itertools
import json
import math
import os
import re
import signal
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from p2pfl.app.config import SECTIONS, Resolved, read_experiment, resolve, set_path
from p2pfl.app.experiment import build, empty, run
from p2pfl.core.errors import ConfigError, RunError, TopologyMisfit
from p2pfl.data.datasets import loaded_once
from p2pfl.reporting.progress import target_key
from p2pfl.reporting.reporters import ended_well

SHORTHAND = {"topology": "kind"}
"""The key a string value of a section stands for (``name`` for the other sections)."""
CELL_COLUMNS = ["cell", "status", "reason", "accuracy", "total_bytes", "sim_time_s", "wall_time_s"]
STATS = ("accuracy", "total_bytes", "sim_time_s")
MAX_NAME_BYTES = 255  # a file name, on every file system we know
REASON_CHARS = 2000
"""A failed cell's reason as a forked cell reports it, at most: its row stays well inside the
64 KiB a pipe holds, so the cell's one write never waits for the sweep to read."""
MAX_CELLS = 10_000
"""The most cells one sweep may have. Each is checked as a run is built (10 to 50 ms on a
laptop: minutes for 10,000) and is then a run and a directory of its own: a larger grid is
a typo, or work for several sweeps (each resumable) or a cluster's scheduler."""
PROGRESS_DELAY_S = 2.0
"""A sweep's check shows its bar on stderr once it has lasted this long (short ones stay quiet)."""
STOP_GRACE_S = 10.0
"""How long a stopped sweep waits for its running cells, all together, to write their outputs
and end."""


@dataclass
class Cell:
    """One point of the grid: the value of every sweep key, and its resolved experiment."""

    values: dict[str, Any]
    labels: dict[str, str]
    experiment: Resolved = field(init=False)

    @property
    def name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.labels.items())


def split(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """An experiment mapping without its ``sweep:`` section, and that section checked
    (empty when there is none)."""
    if "sweep" not in raw:
        return raw, {}
    base = {k: v for k, v in raw.items() if k != "sweep"}
    grid = raw["sweep"]
    if not isinstance(grid, dict) or not grid:
        raise ConfigError("sweep", "must be a non-empty mapping of key: [values]")
    for key, values in grid.items():
        parts = str(key).split(".")
        if not isinstance(key, str) or key == "name" or parts[0] not in SECTIONS or "" in parts:
            raise ConfigError(f"sweep.{key}", "must be a section or a dotted key path")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.{key}", "must be a non-empty list of values")
    size = math.prod(len(values) for values in grid.values())
    if size > MAX_CELLS:
        raise ConfigError(
            "sweep", f"{size:,} cells; the limit is {MAX_CELLS:,}: split the grid into sweeps"
        )
    return base, grid


def base_config(raw: dict[str, Any], file: Path) -> Resolved:
    """A sweep file read as one experiment (``p2pfl cost``, ``p2pfl peer``): its base, the
    file without ``sweep:``, resolved once every cell has been checked as a sweep checks it."""
    base, grid = split(raw)
    with loaded_once():
        checked(base, grid, file, "sim")
    return resolve(base, file)


def load(
    path: str | Path,
    sets: Sequence[str | tuple[str, Any]] = (),
    seed: int | None = None,
    given: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The experiment's raw mapping (``--set``/``--seed`` applied) and its ``sweep:``
    section (empty when there is none); ``given``: the file's contents from Python."""
    raw = read_experiment(path, sets, seed, given)
    try:
        return split(raw)
    except ConfigError as e:
        e.file = e.file or str(path)
        raise


def label(value: Any) -> str:
    """A value as a directory-name part: a mapping as its name (or kind) then ``_KEY-VALUE``."""
    if isinstance(value, dict):
        head = value.get("name", value.get("kind", ""))
        rest = [f"{k}-{label(v)}" for k, v in value.items() if k not in ("name", "kind")]
        text = "_".join([str(head), *rest]) if head else "_".join(rest)
    elif isinstance(value, list):
        text = "-".join(label(v) for v in value)
    else:
        text = str(value)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)


def apply(raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with one cell's values: whole sections first, then dotted keys (each value as
    it is, for the checks to judge: a YAML date is no JSON, and no ``--set`` text either)."""
    out = copy.deepcopy(raw)
    for key, value in sorted(values.items(), key=lambda kv: "." in kv[0]):
        if "." in key:
            set_path(out, key, copy.deepcopy(value))  # the path made (or refused) as --set
        elif isinstance(value, str) and key != "seed":
            out[key] = {SHORTHAND.get(key, "name"): value}
        else:
            out[key] = copy.deepcopy(value)
    return out


def checked(
    raw: dict[str, Any],
    grid: dict[str, list[Any]],
    file: Path,
    transport: str,
    progress: bool = False,
) -> tuple[list[Cell], dict[str, str]]:
    """Every cell resolved, then built once (the validation phase); the cells, and those
    whose method does not fit the topology with the reason (:func:`misfits`). With
    ``progress``, a check that lasts over :data:`PROGRESS_DELAY_S` shows bars on stderr."""
    count = functools.partial(
        tqdm, unit="cell", delay=PROGRESS_DELAY_S, leave=False, disable=not progress
    )
    todo = cells(raw, grid, file, count)
    return todo, misfits(count(todo, desc="checking cells"), file, transport)


def cells(
    raw: dict[str, Any],
    grid: dict[str, list[Any]],
    file: Path,
    count: Callable[..., Iterable[Any]] = lambda items, **_: items,
) -> list[Cell]:
    """Every cell of the grid with its resolved config; a bad cell is a ``ConfigError``.
    ``count`` wraps the cells as they are resolved (a progress bar)."""
    for key, choices in grid.items():
        names = [label(v) for v in choices]
        if len(set(names)) != len(names):
            raise ConfigError(
                f"sweep.{key}", f"two values share a directory label: {names}", str(file)
            )
    out = []
    combos = itertools.product(*grid.values())
    total = math.prod(map(len, grid.values()))
    for combo in count(combos, total=total, desc="resolving cells"):
        values = dict(zip(grid, combo, strict=True))
        cell = Cell(values, {k: label(v) for k, v in values.items()})
        if len(cell.name.encode()) > MAX_NAME_BYTES:  # refused, not hashed: names stay readable
            raise ConfigError(
                "sweep",
                f"cell directory name {cell.name[:40]}... is {len(cell.name.encode())} bytes; "
                f"the limit is {MAX_NAME_BYTES}: use shorter values",
                str(file),
            )
        try:
            cell.experiment = resolve(apply(raw, values), file)
        except ConfigError as e:
            raise _in_cell(e, cell, file) from None
        out.append(cell)
    return out


def _in_cell(e: ConfigError, cell: Cell, file: Path) -> ConfigError:
    """``e`` naming the sweep file and the cell."""
    return ConfigError(f"{e.key} (sweep cell {cell.name})", e.message, e.file or str(file))


def misfits(todo: Iterable[Cell], file: Path, transport: str) -> dict[str, str]:
    """Build every cell once (the validation phase); return the cells whose method does not
    fit the topology, with the reason. Any other bad cell is a ``ConfigError`` naming it."""
    skipped = {}
    for cell in todo:
        try:
            build(cell.experiment, transport)
        except TopologyMisfit as e:
            skipped[cell.name] = str(e)
        except ConfigError as e:
            raise _in_cell(e, cell, file) from None
    return skipped


def finished(out: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """The cell's summary if it already ran to the end with exactly this config."""
    summary = ended_well(out)
    if summary is None:
        return None
    try:
        same = (out / "config.yaml").read_text() == yaml.safe_dump(config, sort_keys=False)
    except (OSError, ValueError):
        return None
    return summary if same else None


def run_cell(
    cell: Cell, out: Path, progress: bool, transport: str, misfit: str | None = None
) -> dict[str, Any]:
    """One cell's row for ``cells.csv``: run it unless it is done or does not fit (``misfit``
    is then why)."""
    row: dict[str, Any] = {"cell": cell.name, "reason": ""}
    if misfit is not None:
        return row | {"status": "skipped", "reason": misfit}
    summary = finished(out, cell.experiment.config)
    if summary is not None:
        row["status"] = "done"
    else:
        if out.is_dir():  # run before (failed, or another config): none of its files may stay
            empty(out)
        try:
            summary = run(build(cell.experiment, transport), out, progress, transport)
            row["status"] = "ok"
        except RunError as e:
            return row | {"status": "failed", "reason": str(e)}
    row |= {
        "accuracy": summary["final"]["accuracy"],
        "total_bytes": summary["comm"]["total_bytes"],
        "sim_time_s": summary["sim_time_s"],
        "wall_time_s": summary["wall_time_s"],
    }
    for key, first in summary.get("time_to_accuracy", {}).items():
        row[f"tta_{key}_s"] = None if first is None else first["time_s"]
        row[f"tta_{key}_bytes"] = None if first is None else first["bytes"]
    return row


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single run)."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def targets_of(todo: Iterable[Cell]) -> list[str]:
    """The keys (``"0.7"``) of the accuracies any cell's ``eval.targets`` names, ascending."""
    values = {float(t) for cell in todo for t in cell.experiment.eval.targets}
    return [target_key(t) for t in sorted(values)]


def tta_columns(targets: Sequence[str], table: bool = False) -> list[str]:
    """The time-to-accuracy columns per target key ``A`` (none without targets):
    ``tta_A_s`` and ``tta_A_bytes``, a cell's ``time_to_accuracy`` (empty where it never
    reached ``A``); in ``sweep.csv`` (``table``), the mean over the combination's runs when
    every one of them reached ``A`` (else empty), and ``tta_A_reached``, how many did."""
    extra = ("reached",) if table else ()
    return [f"tta_{key}_{part}" for key in targets for part in ("s", "bytes", *extra)]


def table(
    grid: dict[str, list[Any]], rows: list[dict[str, Any]], targets: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """``sweep.csv``'s rows: cells grouped by every key but ``seed``, in grid order (with
    the time to each of ``targets``: :func:`tta_columns`)."""
    keys = [k for k in grid if k != "seed"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    out = []
    for group, members in groups.items():
        ran = [r for r in members if r["status"] in ("ok", "done")]
        entry: dict[str, Any] = dict(zip(keys, group, strict=True)) | {"runs": len(ran)}
        entry["note"] = "; ".join(
            dict.fromkeys(f"{r['status']}: {r['reason']}" for r in members if r not in ran)
        )
        for stat in STATS:
            if ran:
                entry[f"{stat}_mean"], entry[f"{stat}_std"] = mean_std([r[stat] for r in ran])
        for key in targets:
            firsts = [r for r in ran if r.get(f"tta_{key}_s") is not None]
            entry[f"tta_{key}_reached"] = len(firsts)
            if ran and len(firsts) == len(ran):
                for part in ("s", "bytes"):
                    entry[f"tta_{key}_{part}"] = statistics.fmean(
                        r[f"tta_{key}_{part}"] for r in ran
                    )
        out.append(entry)
    return out


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def format_table(keys: list[str], rows: list[dict[str, Any]], targets: Sequence[str] = ()) -> str:
    """``sweep.csv`` as aligned text: accuracy, total bytes and sim time as mean ± std; the
    mean time to each of ``targets`` (``never``, or ``K/N runs`` when only K reached it)."""
    tta = [f"time to {key} (s)" for key in targets]
    lines = [[*keys, "runs", "accuracy", "total bytes", "sim time (s)", *tta, "note"]]
    for r in rows:
        stats = ["-"] * (3 + len(targets))
        if r["runs"]:
            stats = [
                f"{r['accuracy_mean']:.4f} ± {r['accuracy_std']:.4f}",
                f"{r['total_bytes_mean']:,.0f} ± {r['total_bytes_std']:,.0f}",
                f"{r['sim_time_s_mean']:.3f} ± {r['sim_time_s_std']:.3f}",
                *(_tta_text(r, key) for key in targets),
            ]
        lines.append([*(str(r[k]) for k in keys), str(r["runs"]), *stats, r["note"]])
    width = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, width, strict=True)).rstrip() for line in lines
    )


def _tta_text(row: dict[str, Any], key: str) -> str:
    reached = row[f"tta_{key}_reached"]
    if reached == row["runs"]:
        return f"{row[f'tta_{key}_s']:.4g}"
    return f"{reached}/{row['runs']} runs" if reached else "never"


def run_sweep(
    file: Path,
    raw: dict[str, Any],
    grid: dict[str, list[Any]],
    out: Path,
    progress: bool,
    transport: str = "sim",
    claim: Callable[[], AbstractContextManager[Any]] = nullcontext,
    workers: int = 1,
    threads: int = 0,
) -> int:
    """Check every cell, then (inside ``claim()``: the command line's lock on ``out``) run
    them under ``out``, ``workers`` at a time (each then in its own process, on ``threads``
    torch threads); write the tables and figures. Returns the exit code: 1 if a cell's run
    failed, else 0."""
    with loaded_once():  # every cell is built twice: checked first, then run
        todo, skipped = checked(raw, grid, file, transport, progress)
        with claim():
            done: Iterable[tuple[int, dict[str, Any]]]
            if workers > 1:
                done = _in_parallel(todo, skipped, out, transport, workers, threads)
            else:
                rows = (_cell_row(c, out, progress, transport, skipped) for c in todo)
                done = enumerate(rows)
            return _run_cells(todo, done, grid, out, workers)


def _cell_row(
    cell: Cell, out: Path, progress: bool, transport: str, skipped: dict[str, str]
) -> dict[str, Any]:
    """:func:`run_cell` for ``cell`` in its directory under ``out``."""
    return run_cell(cell, out / cell.name, progress, transport, skipped.get(cell.name))


def _in_parallel(
    todo: list[Cell],
    skipped: dict[str, str],
    out: Path,
    transport: str,
    workers: int,
    threads: int,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Run the cells ``workers`` at a time, each in a child forked from this process (which
    loaded the data and checked every cell: the children share that memory and start at
    once), on ``threads`` torch threads; yield ``(index, row)`` as they end. A child that
    dies without its row is a failed cell. Every child is stopped if this process is."""
    import matplotlib.figure  # noqa: F401 - once here: each cell draws its figures in its child

    from p2pfl.runtime.children import Forked, stop

    pending = list(enumerate(todo))
    running: dict[int, tuple[Forked, int]] = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                i, cell = pending.pop(0)
                if (
                    cell.name in skipped
                    or finished(out / cell.name, cell.experiment.config) is not None
                ):
                    yield i, _cell_row(cell, out, False, transport, skipped)  # nothing to run
                    continue
                read, write = os.pipe()
                main = functools.partial(_cell_child, cell, out, transport, skipped, threads, write)
                child = Forked(main, "p2pfl-cell")
                os.close(write)
                running[i] = (child, read)
            ended = [i for i, (child, _) in running.items() if child.poll() is not None]
            if not ended:
                time.sleep(0.02)
            for i in ended:
                child, read = running.pop(i)
                with os.fdopen(read, "rb") as pipe:
                    told = pipe.read()
                gone = {"cell": todo[i].name, "status": "failed"}
                gone["reason"] = f"its process ended with exit code {child.returncode}"
                yield i, json.loads(told) if told else gone
    finally:  # stopped (Ctrl-C, SIGTERM) or failed: the cells end as interrupted runs do
        stop([child for child, _ in running.values()], STOP_GRACE_S)
        for _, read in running.values():
            os.close(read)


def _cell_child(
    cell: Cell, out: Path, transport: str, skipped: dict[str, str], threads: int, write: int
) -> int:
    """One cell in its forked child: run it and send its row back through ``write``. Ctrl-C
    is the sweep's to handle: it stops its cells with SIGTERM, which a run ends on as on
    Ctrl-C (``summary.json`` says ``interrupted``)."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    row = _cell_row(cell, out, False, transport, skipped)
    row["reason"] = row["reason"][:REASON_CHARS]
    with os.fdopen(write, "wb") as pipe:  # read once this process has ended
        pipe.write(json.dumps(row).encode())
    return 0


def _run_cells(
    todo: list[Cell],
    done: Iterable[tuple[int, dict[str, Any]]],
    grid: dict[str, list[Any]],
    out: Path,
    workers: int,
) -> int:
    """Report each cell's row as it ends, then write the tables and figures (rows in the
    grid's order, however the cells ran; the figures on ``workers`` processes)."""
    from p2pfl.reporting import plots

    out.mkdir(parents=True, exist_ok=True)
    by_index: dict[int, dict[str, Any]] = {}
    for n, (i, row) in enumerate(done, 1):
        cell = todo[i]
        by_index[i] = row = row | cell.labels
        detail = f"accuracy {row['accuracy']:.4f}" if "accuracy" in row else row["reason"]
        print(f"[{n}/{len(todo)}] {cell.name}: {row['status']} ({detail})", flush=True)
    rows = [by_index[i] for i in range(len(todo))]
    targets = targets_of(todo)
    write_csv(out / "cells.csv", rows, [*grid, *CELL_COLUMNS, *tta_columns(targets)])
    summary = table(grid, rows, targets)
    keys = [k for k in grid if k != "seed"]
    columns = [*keys, "runs", *(f"{s}_{m}" for s in STATS for m in ("mean", "std"))]
    write_csv(out / "sweep.csv", summary, [*columns, *tta_columns(targets, True), "note"])
    print(format_table(keys, summary, targets))

    def save(stem: str, draw: Callable[[], Any]) -> None:
        plots.save(draw(), out, stem)

    drawings: list[Callable[[], object]] = [
        functools.partial(plots.sweep_chart, keys, summary, out)
    ]
    if any(r["status"] in ("ok", "done") for r in rows):
        drawings += [functools.partial(save, *item) for item in plots.figures([out]).items()]
    _spread(drawings, workers)
    print(f"wrote {out / 'sweep.csv'} and figures in {out}")
    return 1 if any(r["status"] == "failed" for r in rows) else 0


def _spread(calls: list[Callable[[], object]], workers: int) -> None:
    """Make ``calls``, spread over this process and ``workers - 1`` forked children (a
    sweep's figures: matplotlib draws on one core, and they took 2 of the 6 s of
    ``experiments/sweep-digits.yaml`` on two workers)."""
    from p2pfl.runtime.children import Forked

    def share(w: int) -> int:
        for call in calls[w::workers]:
            call()
        return 0

    children = [Forked(functools.partial(share, w), "p2pfl-figure") for w in range(1, workers)]
    try:
        share(0)
    finally:
        codes = [child.wait() for child in children]
    if failed := [c for c in codes if c]:
        raise RunError(f"drawing the sweep's figures failed (exit status {failed[0]})")


def load_experiment(
    path: str | Path,
    sets: Sequence[str | tuple[str, Any]] = (),
    seed: int | None = None,
    given: dict[str, Any] | None = None,
) -> Resolved:
    """Read, override and resolve an experiment file (a sweep file as its base, once every
    cell has resolved); errors carry the file name. ``given``: the file's contents from
    Python."""
    file = Path(path)
    raw = read_experiment(file, sets, seed, given)
    try:
        return base_config(raw, file) if "sweep" in raw else resolve(raw, file)
    except ConfigError as e:
        e.file = e.file or str(file)
        raise
