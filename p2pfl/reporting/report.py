"""One self-contained HTML page of finished runs and sweeps (``p2pfl report``).

``p2pfl report RUN_DIR [RUN_DIR ...] [--out FILE.html]`` reads run directories and sweep
directories as ``p2pfl plot`` does (:func:`p2pfl.reporting.plots.expand`: a sweep stands for
its finished cells, and cells that differ only in ``seed`` form one line) and writes one HTML
file that needs nothing else to be read: every figure is inline SVG (drawn by
:mod:`p2pfl.reporting.plots`, the same figures as ``p2pfl plot``), the style sheet is inline,
there is no script and no reference to anything outside the file. The page holds, in order:

- **Runs**: one row per run (its status, method, topology, peers, seed, final accuracy and
  loss, bytes, messages, simulated and wall time, its time to each of the runs'
  ``eval.targets``), each linked to its own section; with
  several runs, the config keys whose values differ between them, and, per line (a sweep's
  combination of its non-seed keys), the mean ± sample std over its runs with a bar chart;
  for a sweep directory, its ``cells.csv`` (cells skipped or failed, with their reason).
- **Accuracy**: test accuracy against round, bytes delivered and simulated time (``p2pfl
  plot``'s ``accuracy``); with ``eval.targets`` or ``eval.every_s`` in any run, also each
  run's accuracy series against simulated time and against bytes sent, targets drawn
  (``p2pfl plot --x time --x bytes``).
- **Traffic**: bytes per link on the topology (``traffic``); for one run, also the bytes
  from each node (row) to each node (column), from ``comm.csv``.
- **Availability** (where a run has ``availability.csv``, i.e. a ``network:`` section):
  accuracy and peers online against simulated time (``availability``); for one run, also
  each peer's online intervals.
- **Data**: the samples per peer and class of each distinct partition.
- One section per run: its ``summary.json`` as a table (nested keys dotted; ``per_peer`` as
  a table of its own) and its ``config.yaml`` as written.

Where the page goes: ``RUN_DIR/report.html`` for one directory (a run or a sweep); with
several, ``--out`` is required (no directory of theirs is more the page's than another's).
Every input is read and every figure drawn before the file is written, so a bad directory
(missing, not a run, an unreadable ``summary.json``) is one ``ConfigError`` and nothing is
written; the page is written to a temporary file beside ``--out`` and renamed over it.
"""

from __future__ import annotations

import csv
import datetime
import html
import importlib.metadata
import io
import json
import os
import re
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import rc_context
from matplotlib.figure import Figure

from p2pfl.core.collector import collector_paused
from p2pfl.core.errors import ConfigError
from p2pfl.reporting.heatmap import LABEL_MAX, heatmap_figure
from p2pfl.reporting.plots import (
    Run,
    accuracy_figure,
    availability_figure,
    bar_panels,
    expand,
    node_indices,
    partition_figures,
    progress_figure,
    run_end,
    topology_of,
    traffic_figure,
)

DEFAULT_NAME = "report.html"
CELLS_OPEN_MAX = 40
"""A sweep's table of cells is shown unfolded up to this many cells."""
TEXT_SHOWN = 300
"""A table shows this many characters of a longer text, the rest folded."""
TIMELINE_MAX_PEERS = 100
"""Beyond this many peers a run's per-peer online intervals are not drawn (the count online,
``availability``, still is)."""

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif;
       color: #1d1d1f; margin: 0; background: #fafafa; }
header { background: #24323f; color: #f4f4f4; padding: 14px 28px; }
header h1 { font-size: 22px; margin: 0 0 4px 0; }
header p { margin: 2px 0; font-size: 12px; color: #c9d1d9; }
header code { color: #f4f4f4; }
nav { position: sticky; top: 0; background: #eef1f4; border-bottom: 1px solid #d0d7de;
      padding: 6px 28px; font-size: 13px; z-index: 1; }
nav a { margin-right: 14px; color: #24323f; text-decoration: none; font-weight: 600; }
main { padding: 8px 28px 40px 28px; max-width: 1500px; }
h2 { border-bottom: 2px solid #24323f; padding-bottom: 3px; margin-top: 34px; }
h3 { margin: 22px 0 6px 0; }
p.note { color: #555; font-size: 12.5px; margin: 4px 0 10px 0; }
table { border-collapse: collapse; font-size: 12.5px; margin: 8px 0 14px 0; background: #fff; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #eef1f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fff1f0; }
pre { background: #fff; border: 1px solid #d0d7de; padding: 8px 10px; font-size: 12px;
      overflow-x: auto; max-height: 480px; }
figure { margin: 10px 0 18px 0; background: #fff; border: 1px solid #e1e4e8; padding: 6px;
         overflow-x: auto; }
figure svg { max-width: 100%; height: auto; display: block; }
figcaption { font-size: 12px; color: #555; margin-top: 4px; }
details { margin: 6px 0 10px 0; }
summary { cursor: pointer; font-weight: 600; }
.wrap { overflow-x: auto; }
.row { display: flex; flex-wrap: wrap; gap: 16px; align-items: flex-start; }
.row > div { flex: 1 1 480px; min-width: 0; }
"""


def default_path(paths: list[Path], out: Path | None) -> Path:
    """Where the page goes: ``out``, else ``RUN_DIR/report.html`` for one directory (a
    ``ConfigError`` for several without ``out``, and for an ``out`` that is a directory)."""
    if out is None:
        if len(paths) > 1:
            raise ConfigError(
                "--out",
                f"{len(paths)} run directories: name the page's file, e.g. --out report.html",
            )
        out = paths[0] / DEFAULT_NAME
    if out.is_dir():
        raise ConfigError(
            "--out", f"{out} is a directory; name the page's file, e.g. {out / DEFAULT_NAME}"
        )
    return out


@collector_paused()  # as plots.plot_runs
def write_report(paths: list[Path], out: Path, command: str = "") -> Path:
    """Read ``paths`` (runs and sweeps), draw the page and write it to ``out`` (its
    directory made if missing); nothing is written if any input is bad."""
    page = render(paths, command)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f".{out.name}.part")
    try:
        part.write_text(page, encoding="utf-8")
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)
    return out


# -- the page ---------------------------------------------------------------------------------


def render(paths: list[Path], command: str = "") -> str:
    """The whole page of the runs and sweeps in ``paths``, as HTML text."""
    lines = expand(paths)
    named = run_names(paths, lines)
    several = len(named) > 1
    sections: list[tuple[str, str, str]] = []  # (id, title, body)
    sections.append(("runs", "Runs", runs_section(paths, lines, named)))
    if not several:
        sections.append((run_id(0), "Summary and config", run_section(named[0][1], True)))
    sections.append(("accuracy", "Accuracy", accuracy_section(lines)))
    sections.append(("traffic", "Traffic", traffic_section(lines, named, several)))
    if any(r.availability is not None for _, r in named):
        sections.append(("availability", "Availability", availability_section(lines, named)))
    sections.append(("data", "Data", data_section(lines)))
    nav = "".join(f'<a href="#{i}">{html.escape(t)}</a>' for i, t, _ in sections)
    if several:
        nav += f'<a href="#{run_id(0)}">Each run</a>'
        for i, (name, run) in enumerate(named):
            sections.append((run_id(i), f"Run {name}", run_section(run, single=False)))
    title = ", ".join(str(p.resolve().name or p) for p in paths)
    body = "".join(f'<section id="{i}"><h2>{html.escape(t)}</h2>{b}</section>'
                   for i, t, b in sections)  # fmt: skip
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    made = f"<code>{html.escape(command)}</code>, " if command else ""
    where = ", ".join(f"<code>{html.escape(str(p.resolve()))}</code>" for p in paths)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>p2pfl report: {html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n"
        f"<body>\n<header><h1>p2pfl report: {html.escape(title)}</h1>"
        f"<p>{len(named)} run{'s' if several else ''} from {where}</p>"
        f"<p>made by {made}p2pfl {version()}, {now}</p></header>\n"
        f"<nav>{nav}</nav>\n<main>\n{body}\n</main>\n</body>\n</html>\n"
    )


def version() -> str:
    """The installed p2pfl's version ("unknown" where it is not installed, only on the path)."""
    try:
        return importlib.metadata.version("p2pfl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run_names(paths: list[Path], lines: list[tuple[str, list[Run]]]) -> list[tuple[str, Run]]:
    """Each run with its name: a run directory's name; a sweep's cell's directory name
    (after the sweep's name when several directories are given)."""
    prefix = len(paths) > 1
    named = []
    for _, runs in lines:
        for run in runs:
            name = run.path.resolve().name or str(run.path)
            if prefix and run.path.parent.resolve() in {p.resolve() for p in paths}:
                name = f"{run.path.parent.resolve().name}: {name}"
            named.append((name, run))
    return named


def run_id(i: int) -> str:
    return f"run-{i + 1}"


def figure_html(fig: Figure, caption: str) -> str:
    """``fig`` as inline SVG (no XML prolog, no metadata) with its caption."""
    buffer = io.BytesIO()
    # text stays text (the browser's fonts draw it; the page stays small and searchable), and
    # the ids of the SVGs' shared definitions are the same from one page to the next
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "p2pfl-report"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    svg = buffer.getvalue().decode("utf-8")
    svg = svg[svg.index("<svg") :]
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    return f"<figure>{svg}<figcaption>{html.escape(caption)}</figcaption></figure>\n"


def table_html(header: list[str], rows: Iterable[list[Any]], classes: Iterable[str] = ()) -> str:
    """A table; a number is right-aligned and formatted (:func:`cell`)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    rows = list(rows)
    for row, cls in zip(rows, [*classes] or [""] * len(rows), strict=True):
        cells = "".join(
            f'<td class="num">{cell(v)}</td>' if _number(v) else f"<td>{cell(v)}</td>" for v in row
        )
        attr = f' class="{cls}"' if cls else ""
        body.append(f"<tr{attr}>{cells}</tr>")
    return f'<div class="wrap"><table><tr>{head}</tr>{"".join(body)}</table></div>\n'


def _read_number(text: str) -> Any:
    """A CSV field as an int or a float where it is one, else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def cell(v: Any) -> str:
    """A value as a table shows it: integers with thousands separators, floats to 6
    significant digits, ``None`` as ``null``, an already built link as it is; a text longer
    than :data:`TEXT_SHOWN` (a deadlock's error) cut there, the whole of it folded."""
    if isinstance(v, Link):
        return v.html
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.6g}"
    text = str(v)
    if len(text) <= TEXT_SHOWN:
        return html.escape(text)
    return (
        f"{html.escape(text[:TEXT_SHOWN])}…<details><summary>all {len(text):,} characters"
        f"</summary>{html.escape(text)}</details>"
    )


class Link:
    """A table cell that links to a section of the page."""

    def __init__(self, target: str, text: str) -> None:
        self.html = f'<a href="#{target}">{html.escape(text)}</a>'


def note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>\n'


# -- sections ---------------------------------------------------------------------------------


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def runs_section(
    paths: list[Path], lines: list[tuple[str, list[Run]]], named: list[tuple[str, Run]]
) -> str:
    targets = sorted(
        {k for _, r in named for k in _get(r.summary, "time_to_accuracy") or {}}, key=_as_float
    )
    header = ["run", "status", "algorithm", "topology", "peers", "seed", "transport",
              "accuracy", "loss", "bytes", "messages", "sim time (s)", "wall time (s)",
              *(f"time to {t} (s)" for t in targets)]  # fmt: skip
    rows, classes = [], []
    for i, (name, run) in enumerate(named):
        s = run.summary
        reached = _get(s, "time_to_accuracy") or {}
        rows.append([
            Link(run_id(i), name), s.get("status"), s.get("algorithm"), s.get("topology"),
            s.get("num_peers"), s.get("seed"), s.get("transport"), _get(s, "final", "accuracy"),
            _get(s, "final", "loss"), _get(s, "comm", "total_bytes"),
            _get(s, "comm", "messages"), s.get("sim_time_s"), s.get("wall_time_s"),
            *(_get(reached, t, "time_s") if _get(reached, t) else
              ("never" if t in reached else "—") for t in targets),
        ])  # fmt: skip
        classes.append("" if s.get("status") == "ok" else "bad")
    out = [table_html(header, rows, classes)]
    if targets:
        out.append(note(
            "time to A: the simulated time at which the run's accuracy first reached A "
            "(summary.json's time_to_accuracy; never: not reached; —: not a target of the run)."
        ))  # fmt: skip
    if len(named) > 1:
        out.append(differences(named))
        out.append(lines_html(lines))
    for path in paths:
        if (path / "cells.csv").is_file():
            out.append(cells_html(path))
    return "".join(out)


def _as_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("inf")


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping's leaves by dotted key (a list is one leaf, as JSON)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= flat(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(value, (list, dict)):
        return {prefix: json.dumps(value, separators=(", ", ": "))}
    return {prefix: value}


def differences(named: list[tuple[str, Run]]) -> str:
    """The config keys whose values differ between the runs: a column each for the keys
    every run has (in the config's order), and one column for those only some runs have (a
    method's own keys, where the runs' methods differ) as ``key=value`` text."""
    configs = [flat(r.config) for _, r in named]
    keys = list(dict.fromkeys(k for c in configs for k in c))
    missing = object()
    differ = [k for k in keys if len({repr(c.get(k, missing)) for c in configs}) > 1]
    if not differ:
        return "<h3>What differs</h3>" + note("The runs' configs are the same.")
    shared = [k for k in differ if all(k in c for c in configs)]
    some = [k for k in differ if k not in shared]
    rows = []
    for i, ((name, _), c) in enumerate(zip(named, configs, strict=True)):
        own = ", ".join(f"{k}={cell_text(c[k])}" for k in some if k in c)
        rows.append([Link(run_id(i), name), *(c[k] for k in shared), *([own] if some else [])])
    header = ["run", *shared, *(["keys only some runs have"] if some else [])]
    return (
        "<h3>What differs</h3>"
        + note("The config keys (config.yaml) whose values are not the same in every run.")
        + table_html(header, rows)
    )


def cell_text(v: Any) -> str:
    """A value as plain text: a number, ``null`` or a bool as :func:`cell` shows it."""
    return str(v) if isinstance(v, str) else html.unescape(cell(v))


def _stat(runs: list[Run], *keys: str) -> tuple[float, float]:
    """Mean and sample std (0 for one run) of a summary value over ``runs`` (NaN if none)."""
    values = [float(v) for r in runs if _number(v := _get(r.summary, *keys))]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def lines_html(lines: list[tuple[str, list[Run]]]) -> str:
    """Per line: mean ± std of final accuracy, bytes and simulated time, a table and bars."""
    stats = [
        (name, len(runs), _stat(runs, "final", "accuracy"), _stat(runs, "comm", "total_bytes"),
         _stat(runs, "sim_time_s"))
        for name, runs in lines
    ]  # fmt: skip
    rows = [
        [name, n, f"{a[0]:.4f} ± {a[1]:.4f}", f"{b[0]:,.0f} ± {b[1]:,.0f}",
         f"{t[0]:.4g} ± {t[1]:.2g}"]
        for name, n, a, b, t in stats
    ]  # fmt: skip
    out = (
        "<h3>Side by side</h3>"
        + note(
            "Per line (runs that differ only in seed form one line): mean ± sample std over its "
            "runs of the final accuracy, total bytes sent and simulated time."
        )
        + table_html(["line", "runs", "accuracy", "bytes", "sim time (s)"], rows)
    )
    names = [name for name, *_ in stats]
    fig = Figure(figsize=(max(9, 1.4 * len(names)), 4.6), layout="constrained")
    bar_panels(fig, names, [
        ("final accuracy", [a[0] for *_, a, _, _ in stats], [a[1] for *_, a, _, _ in stats]),
        ("total MB sent", [b[0] / 1e6 for *_, b, _ in stats], [b[1] / 1e6 for *_, b, _ in stats]),
        ("simulated time (s)", [t[0] for *_, t in stats], [t[1] for *_, t in stats]),
    ])  # fmt: skip
    fig.suptitle("Mean ± sample std over each line's runs")
    return out + figure_html(fig, "Final accuracy, bytes and simulated time per line.")


def cells_html(path: Path) -> str:
    """A sweep's ``cells.csv``: every cell, its status and, for one not run, the reason."""
    try:
        with (path / "cells.csv").open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError("", f"{path / 'cells.csv'}: {e}") from None
    header = ["cell", "status", "reason", "accuracy", "total_bytes", "sim_time_s"]
    table = [[_read_number(r.get(h) or "") for h in header] for r in rows]
    bad = ["" if r.get("status") in ("ok", "done") else "bad" for r in rows]
    title = f"<h3>Sweep {html.escape(path.resolve().name)}: its cells</h3>"
    shown = " open" if len(rows) <= CELLS_OPEN_MAX else ""
    ran = sum(not b for b in bad)
    return (
        title
        + note(f"{path / 'cells.csv'}: every cell of the grid ({ran} of {len(rows)} ran).")
        + f"<details{shown}><summary>cells.csv</summary>{table_html(header, table, bad)}</details>"
    )


def accuracy_section(lines: list[tuple[str, list[Run]]]) -> str:
    out = figure_html(
        accuracy_figure(lines),
        "Test accuracy per round against round (the server's model, else the peers' mean); "
        "the run's accuracy series (the one time_to_accuracy reads) against bytes delivered "
        "by then and simulated time (a line's runs averaged round by round, or probe by probe).",
    )
    runs = [r for _, rs in lines for r in rs]
    if any(_get(r.config, "eval", "targets") or _get(r.config, "eval", "every_s") for r in runs):
        out += row(*(
            figure_html(
                progress_figure(lines, x),
                f"Each run's accuracy series (the one time_to_accuracy reads) against {what}; "
                "dotted lines: eval.targets.",
            )
            for x, what in (("time", "simulated time"), ("bytes", "bytes sent by then"))
        ))  # fmt: skip
    return out


def traffic_section(
    lines: list[tuple[str, list[Run]]], named: list[tuple[str, Run]], several: bool
) -> str:
    out = figure_html(
        traffic_figure(lines),
        "Bytes per link of the topology, both directions (comm.csv; a line's runs averaged).",
    )
    if not several:
        return row(out, figure_html(*direction_figure(named[0][1])))
    return out


DIRECTION_MAX = 500
"""Rows (and columns) of the by-direction matrix at most: a larger population's nodes are
taken in blocks of consecutive ids (10⁵ nodes one by one would be a 75 GiB matrix)."""


def direction_figure(run: Run) -> tuple[Figure, str]:
    """MB sent from each node (row) to each node (column): ``comm.csv`` by direction; from
    each block of nodes to each block where there are more than :data:`DIRECTION_MAX`."""
    topology = topology_of(run)
    nodes = sorted(topology.graph.nodes, key=lambda n: (n == topology.server, n))
    block = -(-len(nodes) // DIRECTION_MAX)  # nodes per row: 1 up to DIRECTION_MAX nodes
    position = {n: i for i, n in enumerate(nodes)}
    row = np.array([position[n] // block for n in topology.graph.nodes], dtype=np.int64)
    size = -(-len(nodes) // block)
    matrix = np.zeros((size, size))
    src, dst = (row[i] for i in node_indices(run, topology))
    np.add.at(matrix, (src, dst), run.comm.ints("bytes") / 1e6)  # in the file's order
    if block > 1:
        fig = heatmap_figure(
            matrix, f"MB sent, by direction, in blocks of {block:,} nodes",
            "to (block of node ids)", "from (block of node ids)", colorbar="MB",
        )  # fmt: skip
        fig.set_size_inches(8, 6.5)
        return fig, (
            f"Bytes sent from each block of {block:,} consecutive nodes (row) to each block "
            "(column), every message of comm.csv."
        )
    fig = heatmap_figure(matrix, "MB sent, by direction", "to", "from", colorbar="MB")
    if len(nodes) <= LABEL_MAX:
        names = ["S" if n == topology.server else str(n) for n in nodes]
        ax = fig.axes[0]
        ax.set_xticks(range(len(nodes)), names)
        ax.set_yticks(range(len(nodes)), names)
    else:  # no labels to fit: the size of a page's column, so that its text stays legible
        fig.set_size_inches(8, 6.5)
    return fig, "Bytes sent from each node (row) to each node (column), every message of comm.csv."


def availability_section(lines: list[tuple[str, list[Run]]], named: list[tuple[str, Run]]) -> str:
    out = figure_html(
        availability_figure(lines),
        "Test accuracy and the number of peers online against simulated time "
        "(availability.csv; a run without churn has every peer online).",
    )
    run = named[0][1]
    if (
        len(named) == 1
        and run.availability is not None
        and int(run.config["peers"]["count"]) <= TIMELINE_MAX_PEERS
    ):
        return row(out, figure_html(*timeline_figure(run)))
    return out


def timeline_figure(run: Run) -> tuple[Figure, str]:
    """Each peer's online intervals (``availability.csv``), one bar row per peer."""
    peers = int(run.config["peers"]["count"])
    fig = Figure(figsize=(9, 1.0 + 0.25 * peers), layout="constrained")
    ax = fig.subplots()
    for p in range(peers):
        spans = [(a, b - a) for q, a, b in run.availability or [] if q == p]
        ax.broken_barh(spans, (p - 0.35, 0.7), color="C2")
    ax.set(xlabel="simulated time (s)", ylabel="peer", xlim=(0, max(run_end(run), 1e-9)),
           ylim=(peers - 0.5, -0.5), title="Online intervals per peer")  # fmt: skip
    if peers <= LABEL_MAX:
        ax.set_yticks(range(peers))
    ax.grid(axis="x", alpha=0.3)
    online = sum(b - a for _, a, b in run.availability or [])
    share = online / (peers * run_end(run)) if run_end(run) > 0 else float("nan")
    return fig, f"Green: online (availability.csv); {share:.1%} of peer-time online."


def data_section(lines: list[tuple[str, list[Run]]]) -> str:
    parts = partition_figures(lines)
    return note(f"{len(parts)} distinct partition(s) among the runs.") + "".join(
        figure_html(draw(), "Samples per peer (row) and class (column), partition.csv.")
        for draw in parts.values()
    )


def run_section(run: Run, single: bool) -> str:
    """One run: its directory, its summary as a table and its config as written, side by
    side (open on the page of a single run, folded on a page of several)."""
    s = run.summary
    leaves = flat({k: v for k, v in s.items() if k != "per_peer"})
    state = " open" if single else ""
    summary = f"<details{state}><summary>summary.json</summary>"
    summary += table_html(["key", "value"], [[k, v] for k, v in leaves.items()])
    per_peer = s.get("per_peer")
    if isinstance(per_peer, list) and per_peer:
        columns = list(dict.fromkeys(k for p in per_peer if isinstance(p, dict) for k in p))
        summary += (
            "<details><summary>per_peer</summary>"
            + table_html(
                columns, [[p.get(c) for c in columns] for p in per_peer if isinstance(p, dict)]
            )
            + "</details>"
        )
    summary += "</details>"
    try:
        text = (run.path / "config.yaml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:  # read as YAML a moment ago
        raise ConfigError("", f"{run.path / 'config.yaml'}: {e}") from None
    config = f"<details{state}><summary>config.yaml</summary><pre>{html.escape(text)}</pre>"
    return note(str(run.path.resolve())) + row(summary, config + "</details>")


def row(*parts: str) -> str:
    """``parts`` side by side where the window is wide enough, else one under another."""
    return '<div class="row">' + "".join(f"<div>{p}</div>" for p in parts) + "</div>\n"
