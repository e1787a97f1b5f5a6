"""Pictures of finished runs, sweeps and cost tables (PNG and SVG, matplotlib's object API).

``p2pfl plot RUN_DIR... [--out DIR]`` takes run directories and sweep directories (a sweep
stands for its finished cells, and cells that differ only in ``seed`` form one line, the
mean over those runs). It writes:

- ``accuracy``: test accuracy against round, against bytes delivered and against simulated
  time. Against round, a round's point is the mean of the accuracies logged for that round
  (one per peer for decentralized methods: the legend then says "mean over peers").
  Against time and bytes, the points are the run's accuracy series, the one
  ``time_to_accuracy`` reads (see below), in time order, with the bytes of every message
  that had arrived by then; a line's runs are averaged point by point.
- ``traffic``: each line's topology, every link drawn with width and colour by the bytes it
  carried (both directions; the mean over a line's runs), from ``comm.csv`` and
  ``config.yaml``.
- ``partition-I``: the samples-per-class heat-map of every distinct partition (I = 1, 2, ...;
  the title names the first run that has it).
- ``availability`` (when a run has a ``network:`` section, which writes
  ``availability.csv``): the accuracy series against simulated time on top and, under it on the
  same time axis, the number of peers online (a step function of the online intervals; the
  mean over a line's runs; every peer for a run without the section).

With ``--x time`` or ``--x bytes`` (either or both) it writes only ``accuracy-time`` or
``accuracy-bytes``: each run's accuracy series (:mod:`p2pfl.reporting.progress`: the
``eval.every_s`` probes, else the server's scores, else the mean over peers per round, then
the final score) as a step function of simulated time or of the bytes sent by then, one
curve per run (a sweep's cells each their own, named by their line and seed), and each
run's ``eval.targets`` as horizontal lines: a curve crosses a target's line at its
``time_to_accuracy``.
"""

from __future__ import annotations

import functools
import json
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from p2pfl.core.collector import collector_paused
from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import derive_seed
from p2pfl.core.yaml_io import read_yaml
from p2pfl.network.topology import Topology, build_topology
from p2pfl.reporting.heatmap import LABEL_MAX, heatmap_figure
from p2pfl.reporting.progress import SOURCES, Sent, accuracy_series
from p2pfl.reporting.reporters import ended_well
from p2pfl.reporting.tables import Table, read_table

FORMATS = ("png", "svg")
LINES = ("-", "--", ":", "-.")  # line i gets style i, so identical curves stay visible
MARKERS = ("o", "s", "^", "D", "v")
DRAWN_MAX = 1000
"""Nodes up to which the traffic figure draws the graph; beyond, a histogram of the links'
traffic (100,000 nodes drawn took minutes and showed a grey ring)."""


@dataclass
class Run:
    """A finished run directory's outputs."""

    path: Path
    config: dict[str, Any]
    metrics: Table
    comm: Table
    availability: list[tuple[int, float, float]] | None = None
    """``availability.csv`` as (peer, online from, online to) rows; None without the file."""
    partition: tuple[tuple[int, ...], ...] = ()
    """``partition.csv``: samples per peer (rows) and class (columns)."""
    summary: dict[str, Any] = field(default_factory=dict)
    """``summary.json``."""


METRICS = {"time": float, "round": int, "peer": str, "metric": str, "value": float}
COMM = {"src": str, "dst": str, "bytes": int, "arrival": float}
AVAILABILITY = {"peer": int, "online_from": float, "online_to": float}
PARTITION = {"peer": int, "total": int}  # between them class_0, class_1, ...: all ints
CELLS = {"cell": str, "status": str}
"""The columns each file must have, and how each is read: a file that breaks them is a
one-line error naming it, before anything is drawn."""


def _partition(path: Path) -> tuple[tuple[int, ...], ...]:
    """``partition.csv``'s samples per peer and class, checked."""
    table = read_table(path, PARTITION, rest=int)
    classes = [c for c in table.header if c not in PARTITION] if len(table) else []
    if not classes:
        raise ConfigError("", f"{path}: no peer or no class column")
    return tuple(zip(*(table.ints(c).tolist() for c in classes), strict=True))


def read_run(path: Path, summary: dict[str, Any] | None = None) -> Run:
    """A finished run's outputs, checked (``ConfigError`` naming a missing or broken file);
    ``summary``: its ``summary.json``, where the caller has read it already."""
    try:
        config = read_yaml(path / "config.yaml", "run config")
        if summary is None:
            summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError("", f"not a finished run: {path / 'summary.json'}: {e}") from None
    if not isinstance(summary, dict):
        raise ConfigError("", f"{path / 'summary.json'}: not a run summary")
    peers, topology = config.get("peers"), config.get("topology")
    if not (
        isinstance(config.get("seed"), int)
        and isinstance(topology, dict)
        and isinstance(peers, dict)
        and isinstance(peers.get("count"), int)
    ):
        raise ConfigError("", f"{path / 'config.yaml'}: not a run's config (seed, topology, peers)")
    try:
        run = Run(
            path, config, read_table(path / "metrics.csv", METRICS),
            read_table(path / "comm.csv", COMM),
            partition=_partition(path / "partition.csv"), summary=summary,
        )  # fmt: skip
    except OSError as e:
        raise ConfigError("", f"not a finished run: {e.strerror}: {e.filename}") from None
    if (path / "availability.csv").is_file():
        run.availability = [
            (int(r["peer"]), float(r["online_from"]), float(r["online_to"]))
            for r in read_table(path / "availability.csv", AVAILABILITY)
        ]
    return run


def line_name(keys: list[str], labels: dict[str, Any]) -> str:
    """A sweep combination's name: its labels, a dotted key's as ``LEAF=LABEL``; no seed."""
    parts = [f"{k.rsplit('.', 1)[-1]}={labels[k]}" if "." in k else str(labels[k]) for k in keys]
    return " · ".join(p for k, p in zip(keys, parts, strict=True) if k != "seed") or "all"


def expand(paths: list[Path]) -> list[tuple[str, list[Run]]]:
    """(label, runs) lines: a run is its own line; a sweep's finished cells (``ok`` or
    ``done`` in ``cells.csv``, and a ``summary.json`` that says ``ok``: an interrupted re-run
    of a cell leaves the old ``cells.csv`` saying ``done``) are grouped by every sweep key but
    ``seed`` (named after the sweep too when there are several paths)."""
    lines = []
    for path in paths:
        prefix = f"{path.name}: " if len(paths) > 1 else ""
        if (path / "summary.json").is_file():
            lines.append((path.name, [read_run(path)]))
        elif (path / "cells.csv").is_file():
            rows = read_table(path / "cells.csv", CELLS)
            keys = rows.header[: rows.header.index("cell")]
            groups: dict[str, list[Run]] = {}
            for row in rows:
                if Path(row["cell"]).name != row["cell"] or row["cell"] in ("", ".", ".."):
                    raise ConfigError("", f"{path / 'cells.csv'}: {row['cell']!r} is not a cell")
                cell = path / row["cell"]  # one that is gone: read_run names it
                if row["status"] not in ("ok", "done"):
                    continue
                summary = ended_well(cell)
                if summary is not None or not cell.is_dir():
                    name = prefix + line_name(keys, row)
                    groups.setdefault(name, []).append(read_run(cell, summary))
            lines += groups.items()
        else:
            raise ConfigError("", f"{path} is neither a run (summary.json) nor a sweep (cells.csv)")
    if not lines:
        raise ConfigError("", "no finished runs to plot")
    return lines


def curve(run: Run) -> tuple[np.ndarray, bool]:
    """Per evaluated round: [round, mean accuracy, time of the round's last evaluation]; and
    whether several peers were averaged in a round. The run's model's ``eval.every_s``
    probes are not a round's: they are left out."""
    points: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in run.metrics:
        if r["metric"] == "accuracy" and r["peer"] not in ("final", "run"):
            points[int(r["round"])].append((float(r["value"]), float(r["time"])))
    out = []
    for rnd in sorted(points):
        acc, when = zip(*points[rnd], strict=True)
        out.append([rnd, math.fsum(acc) / len(acc), max(when)])  # as accuracy_series
    per_peer = any(len(p) > 1 for p in points.values())
    return np.array(out, dtype=float).reshape(-1, 3), per_peer


def mean_curve(runs: list[Run]) -> tuple[np.ndarray, bool]:
    """The runs' curves averaged point by point over the rounds they all have."""
    curves = [curve(r) for r in runs]
    common = set.intersection(*(set(c[:, 0]) for c, _ in curves))
    rows = [c[np.isin(c[:, 0], sorted(common))] for c, _ in curves]
    return np.mean(rows, axis=0), any(p for _, p in curves)


def series(run: Run) -> tuple[np.ndarray, str]:
    """The run's accuracy series before its final score (:func:`accuracy_series`, the one
    ``time_to_accuracy`` reads), in time order, as [time, accuracy, bytes delivered by then,
    round]; and its source (``run``, ``server`` or ``peers``)."""
    points, source = accuracy_series(r for r in run.metrics if r["peer"] != "final")
    comm = run.comm
    delivered = (  # lost ones never arrived
        np.array([f == "delivered" for f in comm.column("fate")], dtype=bool)
        if "fate" in comm.header
        else np.ones(len(comm), dtype=bool)
    )
    arrived = Sent(comm.floats("arrival")[delivered], comm.ints("bytes")[delivered])
    out = [[p.time, p.accuracy, arrived.by(p.time), p.round] for p in points]
    return np.array(out, dtype=float).reshape(-1, 4), source


def mean_series(runs: list[Run]) -> tuple[np.ndarray, str]:
    """The runs' series averaged point by point, in the order of their mean times: the
    probes of ``eval.every_s`` over the times every run has (they fall at the same times
    in each), else a round's points over the rounds every run has; and the source."""
    got = [series(r) for r in runs]
    source = got[0][1]
    key = 0 if source == "run" else 3
    common = sorted(set.intersection(*(set(s[:, key]) for s, _ in got)))
    kept = [s[np.isin(s[:, key], common)] for s, _ in got]
    mean = np.mean([s[np.argsort(s[:, key], kind="stable")] for s in kept], axis=0)
    return mean[np.argsort(mean[:, 0], kind="stable")], source


def save(fig: Figure, out: Path, stem: str) -> list[Path]:
    paths = [out / f"{stem}.{fmt}" for fmt in FORMATS]
    for path in paths:
        fig.savefig(path, dpi=110)
    return paths


def peers_mean(run: Run) -> str:
    """What a run's per-round peer mean is over: every peer, or ``eval.peers``' sample."""
    section = run.config.get("eval")
    k = section.get("peers") if isinstance(section, dict) else None
    if not isinstance(k, int) or isinstance(k, bool):
        return SOURCES["peers"]
    return f"mean over a sample of {k} peer{'s' * (k != 1)}"


def log_bytes_axis(ax: Axes, what: str) -> None:
    """A log axis of megabytes labelled in 1-2-5 steps, on which a point at 0 bytes is a
    gap (matplotlib would clip it to a tiny value: a segment in from the far left)."""
    for line in ax.get_lines():
        x = np.asarray(line.get_xdata(), dtype=float)
        line.set_xdata(np.where(x > 0, x, np.nan))
    ax.set(xlabel=f"{what} (MB, log scale; 0 not shown)", xscale="log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def accuracy_figure(lines: list[tuple[str, list[Run]]]) -> Figure:
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    delivered = False  # any bytes at all: a log axis needs a positive value
    for i, (name, runs) in enumerate(lines):
        c, per_peer = mean_curve(runs)
        s, source = mean_series(runs)
        notes = ([peers_mean(runs[0])] if per_peer else []) + (
            [f"against time and bytes: {SOURCES['run']}"] if source == "run" else []
        )
        notes += [f"mean of {len(runs)} runs"] if len(runs) > 1 else []
        text = f"{name} ({', '.join(notes)})" if notes else name
        style = {"linestyle": LINES[i % len(LINES)], "marker": MARKERS[i % len(MARKERS)]}
        axes[0].plot(c[:, 0], c[:, 1], markersize=3, label=text, **style)
        for ax, x in zip(axes[1:], (s[:, 2] / 1e6, s[:, 0]), strict=True):
            ax.plot(x, s[:, 1], markersize=3, **style)
        delivered |= bool((s[:, 2] > 0).any())
    axes[0].set(xlabel="round", ylabel="test accuracy")
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    if delivered:
        log_bytes_axis(axes[1], "bytes delivered")
    else:
        axes[1].set(xlabel="bytes delivered (MB; none)")
    axes[2].set(xlabel="simulated time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fit = max(1, 180 // max(len(label) for label in labels))  # long labels: fewer columns
    legend_below(fig, handles, labels, min(3, len(labels), fit), fontsize=8)
    fig.suptitle("Test accuracy against rounds, bytes delivered and simulated time")
    return fig


def topology_of(run: Run) -> Topology:
    """The run's graph, built again from its ``config.yaml``; the last few are kept (a
    random graph of 10⁵ nodes takes seconds to build, and a report draws it twice)."""
    c = run.config
    key = json.dumps([c["topology"], c["peers"]["count"], c["seed"]], sort_keys=True, default=repr)
    if key not in _TOPOLOGIES:
        seed = derive_seed(c["seed"], "topology")
        try:
            topology = build_topology(c["topology"], c["peers"]["count"], seed)
        except ConfigError as e:
            raise ConfigError("", f"{run.path / 'config.yaml'}: topology.{e}") from None
        if len(_TOPOLOGIES) >= 4:
            _TOPOLOGIES.clear()
        _TOPOLOGIES[key] = topology
    return _TOPOLOGIES[key]


_TOPOLOGIES: dict[str, Topology] = {}


def link_bytes(run: Run, topology: Topology) -> dict[frozenset[int], int]:
    """Bytes per link (both directions) from ``comm.csv``, summed by numpy over its columns
    (10⁶ messages in a fraction of a second)."""
    nodes = list(topology.graph.nodes)
    src, dst = node_indices(run, topology)
    links, where = np.unique(
        np.minimum(src, dst) * len(nodes) + np.maximum(src, dst), return_inverse=True
    )
    sums = np.zeros(len(links), dtype=np.int64)
    np.add.at(sums, where, run.comm.ints("bytes"))
    return {
        frozenset((nodes[k // len(nodes)], nodes[k % len(nodes)])): s
        for k, s in zip(links.tolist(), sums.tolist(), strict=True)
    }


def node_indices(run: Run, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """``comm.csv``'s ``src`` and ``dst`` as each node's index in the topology's node order;
    a message between unknown nodes is an error naming its first row."""
    index = {topology.name(n): i for i, n in enumerate(topology.graph.nodes)}
    src, dst = run.comm.column("src"), run.comm.column("dst")
    try:
        return (
            np.fromiter(map(index.__getitem__, src), np.int64, len(src)),
            np.fromiter(map(index.__getitem__, dst), np.int64, len(dst)),
        )
    except KeyError:
        row = next(r for r in run.comm if r["src"] not in index or r["dst"] not in index)
        raise ConfigError(
            "", f"{run.path / 'comm.csv'}: a message between unknown nodes {row}"
        ) from None


def layout(topology: Topology) -> dict[int, np.ndarray]:
    """Peers on a circle (from the top, clockwise), a star's centre in the middle."""
    n = topology.num_peers
    angles = np.pi / 2 - 2 * np.pi * np.arange(n) / n
    pos = {p: np.array([np.cos(a), np.sin(a)]) for p, a in zip(topology.peers, angles, strict=True)}
    if topology.server is not None:
        pos[topology.server] = np.zeros(2)
    return pos


def traffic_figure(lines: list[tuple[str, list[Run]]]) -> Figure:
    drawn = []
    for name, runs in lines:
        topology = topology_of(runs[0])
        per_run = [link_bytes(r, topology) for r in runs]
        edges = list(topology.graph.edges)
        links = [frozenset(e) for e in edges]
        values = list(np.mean([[b.get(k, 0) for k in links] for b in per_run], axis=0) / 1e6)
        drawn.append((name, topology, edges, values))
    top = float(max(max(v) for *_, v in drawn)) or 1.0
    norm, cmap = Normalize(0, top), colormaps["viridis"]
    cols = min(3, len(drawn))
    rows = -(-len(drawn) // cols)
    fig = Figure(figsize=(4.2 * cols + 1, 4.2 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for ax, (name, topology, edges, values) in zip(axes, drawn, strict=False):
        ax.set_title(f"{name}\n{sum(values):.3g} MB on {topology.kind} links", fontsize=8)
        if topology.graph.number_of_nodes() > DRAWN_MAX:
            _link_histogram(ax, values, norm, cmap)
            continue
        pos = layout(topology)
        idle = [e for e, v in zip(edges, values, strict=True) if v == 0]
        nx.draw_networkx_edges(
            topology.graph, pos, ax=ax, edgelist=idle, style=":", edge_color="#bbbbbb"
        )
        order = [i for i in np.argsort(values) if values[i] > 0]  # heavy links on top
        nx.draw_networkx_edges(
            topology.graph, pos, ax=ax, edgelist=[edges[i] for i in order],
            width=[1 + 6 * values[i] / top for i in order],
            edge_color=[cmap(norm(values[i])) for i in order],
        )  # fmt: skip
        nodes = topology.graph.number_of_nodes()
        size = 220 * min(1.0, LABEL_MAX / nodes)  # many nodes: smaller, so the circle shows
        nx.draw_networkx_nodes(topology.graph, pos, ax=ax, node_size=size, node_color="#dddddd")
        if nodes <= LABEL_MAX:  # more labels would overlap, and cost seconds each thousand
            labels = {n: "S" if n == topology.server else str(n) for n in topology.graph.nodes}
            nx.draw_networkx_labels(topology.graph, pos, labels, ax=ax, font_size=7)
        ax.set_axis_off()
    for ax in axes[len(drawn) :]:
        ax.set_axis_off()
    fig.colorbar(ScalarMappable(norm, cmap), ax=axes.tolist(), shrink=0.7, label="MB per link")
    fig.suptitle("Traffic per link, both directions, mean over runs (dotted: unused)", fontsize=9)
    return fig


def _link_histogram(ax: Any, values: list[Any], norm: Normalize, cmap: Any) -> None:
    """A topology too large to draw as a graph: how many links carried how many MB, each
    bar in the colour its links would have in the drawing (counts on a log axis)."""
    top = float(norm.vmax or 1.0)
    distinct, many = np.unique(np.asarray(values, dtype=float), return_counts=True)
    if len(distinct) <= 40:  # links carry whole messages: a bar per amount
        gap = float(np.diff(distinct).min()) if len(distinct) > 1 else top
        centres, counts, width = distinct, many, 0.8 * gap
    else:
        counts, bins = np.histogram(values, bins=40, range=(0.0, top))
        centres, width = (bins[:-1] + bins[1:]) / 2, bins[1] - bins[0]
    ax.bar(centres, counts, width=width, color=[cmap(norm(c)) for c in centres])
    ax.set_yscale("log")
    ax.set(xlabel="MB per link", ylabel="links")


def partition_figures(lines: list[tuple[str, list[Run]]]) -> dict[str, Callable[[], Figure]]:
    """``partition-I``: a heat-map per distinct ``partition.csv``, titled by its first run."""
    seen: dict[tuple[tuple[int, ...], ...], Path] = {}
    for _, runs in lines:
        for run in runs:
            seen.setdefault(run.partition, run.path)
    return {
        f"partition-{i}": functools.partial(_partition_figure, counts, path.name)
        for i, (counts, path) in enumerate(seen.items(), 1)
    }


def _partition_figure(counts: tuple[tuple[int, ...], ...], name: str) -> Figure:
    title = f"Samples per peer and class\n{name}"
    return heatmap_figure(np.array(counts), title, "class", "peer", colorbar="samples")


def online_count(intervals: list[tuple[float, float]], times: np.ndarray) -> np.ndarray:
    """How many of the online ``intervals`` [from, to) hold each of ``times``: the number of
    peers online then (one peer's intervals never overlap)."""
    starts = np.sort([a for a, _ in intervals])
    stops = np.sort([b for _, b in intervals])
    return np.searchsorted(starts, times, side="right") - np.searchsorted(stops, times, "right")


def run_end(run: Run) -> float:
    """The run's simulated end (``summary.json``), else the last online interval's end."""
    try:
        return float(run.summary["sim_time_s"])
    except (KeyError, TypeError, ValueError):
        return max((b for _, _, b in run.availability or []), default=0.0)


def online_curve(runs: list[Run]) -> tuple[np.ndarray, np.ndarray]:
    """(times, peers online): a step function (value from each time to the next) up to the
    shortest run's end, the mean over ``runs`` at every time any of them changes. A run
    without ``availability.csv`` (no ``network:`` section) has every peer online."""
    end = min(run_end(r) for r in runs)
    last = end - 1e-6 * max(1.0, end)  # availability.csv has 9 digits: its last stop is ~end
    edges = {t for r in runs for _, a, b in r.availability or [] for t in (a, b)}
    times = np.array(sorted({0.0} | {t for t in edges if 0 <= t < last}))
    counts = [
        online_count([(a, b) for _, a, b in r.availability], times)
        if r.availability is not None
        else np.full(len(times), int(r.config["peers"]["count"]))
        for r in runs
    ]
    values = np.mean(counts, axis=0)
    return np.append(times, end), np.append(values, values[-1])


def availability_figure(lines: list[tuple[str, list[Run]]]) -> Figure:
    """Accuracy against simulated time, and under it the peers online on the same axis."""
    fig = Figure(figsize=(9, 6.4), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    counts = set()
    for i, (name, runs) in enumerate(lines):
        s, source = mean_series(runs)
        notes = ([SOURCES["run"]] if source == "run" else []) + (
            [f"mean of {len(runs)} runs"] if len(runs) > 1 else []
        )
        text = f"{name} ({', '.join(notes)})" if notes else name
        style = {"linestyle": LINES[i % len(LINES)], "color": f"C{i % 10}"}
        top.plot(s[:, 0], s[:, 1], marker=MARKERS[i % len(MARKERS)], markersize=3, label=text,
                 **style)  # fmt: skip
        times, online = online_curve(runs)
        bottom.plot(times, online, drawstyle="steps-post", linewidth=1.2, **style)
        counts |= {int(r.config["peers"]["count"]) for r in runs}
    top.set(ylabel="test accuracy")
    bottom.set_ylim(0, 1.08 * max(counts))
    peers = f" (of {counts.pop()})" if len(counts) == 1 else ""
    bottom.set(xlabel="simulated time (s)", ylabel=f"peers online{peers}")
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    handles, labels = top.get_legend_handles_labels()
    fit = max(1, 150 // max(len(label) for label in labels))  # as progress_figure's
    legend_below(fig, handles, labels, min(2, len(labels), fit), fontsize=8)
    fig.suptitle("Test accuracy and peers online against simulated time")
    return fig


def figures(paths: list[Path]) -> dict[str, Callable[[], Figure]]:
    """Every figure of the runs (and sweeps) in ``paths`` by file stem, each drawn when
    called (a sweep on several workers draws them in as many processes)."""
    lines = expand(paths)
    drawn = {
        "accuracy": functools.partial(accuracy_figure, lines),
        "traffic": functools.partial(traffic_figure, lines),
    }
    if any(r.availability is not None for _, runs in lines for r in runs):
        drawn["availability"] = functools.partial(availability_figure, lines)
    return drawn | partition_figures(lines)


@collector_paused()  # 10⁶ rows, a 10⁵-node graph: collections took 6 of 16 s
def plot_runs(paths: list[Path], out: Path) -> list[Path]:
    """Every figure of the runs (and sweeps) in ``paths``, written to ``out``."""
    drawn = {stem: draw() for stem, draw in figures(paths).items()}
    out.mkdir(parents=True, exist_ok=True)  # only once every figure is drawn
    return [p for stem, fig in drawn.items() for p in save(fig, out, stem)]


def sent(run: Run) -> Sent:
    """Bytes sent by each time, from ``comm.csv``'s ``time`` and ``bytes`` columns (checked:
    a bad ``time`` is a one-line error naming the file and line)."""
    if "time" not in run.comm.header:
        raise ConfigError("", f"{run.path / 'comm.csv'}: no column time in its header")
    return Sent(run.comm.floats("time"), run.comm.ints("bytes"))


def targets_of(run: Run) -> set[float]:
    """The accuracies of the run's ``eval.targets`` (none for a run without)."""
    section = run.config.get("eval")
    given = section.get("targets") if isinstance(section, dict) else None
    return {
        float(t)
        for t in (given if isinstance(given, list) else [])
        if isinstance(t, (int, float)) and not isinstance(t, bool)
    }


def progress_figure(lines: list[tuple[str, list[Run]]], x: str) -> Figure:
    """``accuracy-time`` or ``accuracy-bytes`` (``x``): every run's accuracy series as a step
    function of simulated time or of bytes sent, with the runs' targets as horizontal lines."""
    fig = Figure(figsize=(9, 5.6), layout="constrained")
    ax = fig.subplots()
    targets: set[float] = set()
    positive = False  # any bytes at all: a log axis needs a positive value
    real = False  # a run over ZeroMQ: its times are wall seconds
    i = 0
    for name, runs in lines:
        for run in runs:
            series, source = accuracy_series(run.metrics)
            by = sent(run)
            xs = [p.time if x == "time" else by.by(p.time) / 1e6 for p in series]
            label = name if len(runs) == 1 else f"{name} · seed={run.config['seed']}"
            if source != "run":
                label += f" ({peers_mean(run) if source == 'peers' else SOURCES[source]})"
            ax.plot(
                xs, [p.accuracy for p in series], drawstyle="steps-post", label=label,
                linestyle=LINES[i % len(LINES)], marker=MARKERS[i % len(MARKERS)], markersize=3,
            )  # fmt: skip
            positive |= any(v > 0 for v in xs)
            real |= run.summary.get("transport", "sim") != "sim"
            targets |= targets_of(run)
            i += 1
    if x == "time":
        clock = "simulated time (s)" + ("; wall seconds for zmq runs" if real else "")
        ax.set(xlabel=clock, title="Test accuracy against time")
    elif positive:
        log_bytes_axis(ax, "bytes sent")
    else:
        ax.set(xlabel="bytes sent (MB; none)")
    for t in sorted(targets):  # after the axis: its gaps are the curves'
        ax.axhline(t, color="grey", linestyle=":", linewidth=1)
        ax.annotate(
            f"target {t:g}", (1, t), xycoords=("axes fraction", "data"), xytext=(-4, 2),
            textcoords="offset points", ha="right", va="bottom", fontsize=7, color="grey",
        )  # fmt: skip
    if x == "bytes":
        ax.set(title="Test accuracy against bytes sent")
    ax.set(ylabel="test accuracy")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if labels:
        fit = max(1, 150 // max(len(label) for label in labels))
        legend_below(fig, handles, labels, min(2, len(labels), fit), fontsize=8)
    return fig


@collector_paused()  # as plot_runs
def plot_progress(paths: list[Path], out: Path, axes: list[str]) -> list[Path]:
    """``accuracy-X`` for each X of ``axes`` (``time``, ``bytes``) of the runs (and sweeps)
    in ``paths``, written to ``out``."""
    lines = expand(paths)
    drawn = {f"accuracy-{x}": progress_figure(lines, x) for x in dict.fromkeys(axes)}
    out.mkdir(parents=True, exist_ok=True)  # only once every figure is drawn
    return [p for stem, fig in drawn.items() for p in save(fig, out, stem)]


LONG_NAME = 28
"""Bar names longer than this are numbered under the bars and spelled out in a legend below:
slanted under the bars, the names of a sweep over mappings (``algorithm: [{name: adpsgd,
reply_timeout_s: 1.0}, ...]``, 90 characters each) left the panels no height and were cut
off at the figure's edge."""


def bar_panels(
    fig: Figure, names: list[str], panels: list[tuple[str, list[float], list[float]]]
) -> None:
    """One bar per name in each (title, values, errors) panel; names longer than
    :data:`LONG_NAME` are numbered, with a legend below (the figure grows to hold it)."""
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    x = np.arange(len(names))
    colors = colormaps["tab10"](x % 10)
    numbered = max(len(name) for name in names) > LONG_NAME
    for ax, (title, values, errors) in zip(axes, panels, strict=True):
        ax.bar(x, values, yerr=errors, capsize=3, color=colors)
        if numbered:
            ax.set_xticks(x, [str(i + 1) for i in x], fontsize=8)
        else:
            ax.set_xticks(x, names, rotation=60, ha="right", fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if numbered:
        legend_below(
            fig, [Patch(facecolor=color) for color in colors],
            [f"{i + 1}: {name}" for i, name in enumerate(names)],
            1 if len(names) <= 8 else 2, fontsize=7, keep=fig.get_size_inches()[1],
        )  # fmt: skip


LEGEND_ROW = 0.18
"""Inches a row of a legend takes at font size 7 or 8."""


def legend_below(
    fig: Figure, handles: list[Any], labels: list[str], ncols: int, fontsize: int,
    keep: float = 3.6,
) -> None:  # fmt: skip
    """The figure's legend under its panels, in ``ncols`` columns. The figure grows by a
    row's height for each row beyond those that leave ``keep`` inches to the panels, their
    titles and labels: the 36 lines of eight sweeps in one figure had squeezed its panels
    to nothing."""
    rows = -(-len(labels) // ncols)
    width, height = fig.get_size_inches()
    fits = max(0, int((height - keep) / LEGEND_ROW))
    if rows > fits:
        fig.set_size_inches(width, height + LEGEND_ROW * (rows - fits))
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=fontsize)


def sweep_chart(keys: list[str], rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """``sweep``: mean ± std of accuracy, total bytes and simulated time per combination."""
    ran = [r for r in rows if r["runs"]]
    if not ran:
        return []
    names = [line_name(keys, r) for r in ran]
    fig = Figure(figsize=(max(9, 1.1 * len(ran) * 1.5), 4.8), layout="constrained")
    panels = [
        (title, [r[f"{stat}_mean"] / scale for r in ran], [r[f"{stat}_std"] / scale for r in ran])
        for stat, scale, title in (
            ("accuracy", 1, "final accuracy"),
            ("total_bytes", 1e6, "total MB sent"),
            ("sim_time_s", 1, "simulated time (s)"),
        )
    ]
    bar_panels(fig, names, panels)
    fig.suptitle("Sweep: mean ± sample std over seeds")
    return save(fig, out, "sweep")


def cost_chart(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """``cost``: total bytes and communication time (log scales where any bar is positive:
    matplotlib cannot draw a log axis without), one bar per topology in each method's
    group, "n/a" where the method does not fit the topology."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    kinds = list(dict.fromkeys(r["topology"] for r in rows))
    cell = {(r["method"], r["topology"]): r for r in rows}
    fig = Figure(figsize=(max(7.0, 1.1 * len(methods) + 2), 7), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    width = 0.8 / len(kinds)
    x = np.arange(len(methods))
    panels = [("total_bytes", 1e6, "total MB sent"), ("comm_time_s", 1.0, "communication time (s)")]
    for ax, (key, scale, title) in zip(axes, panels, strict=True):
        positive = False
        for j, kind in enumerate(kinds):
            pos = x - 0.4 + width * (j + 0.5)
            values = [cell[(m, kind)].get(key) for m in methods]
            heights = [np.nan if v is None else v / scale for v in values]
            positive |= any(h > 0 for h in heights)
            bars = ax.bar(pos, heights, width, label=kind)
            ax.bar_label(bars, fmt="%.4g", fontsize=6, rotation=90, padding=2)
            for p, v in zip(pos, values, strict=True):
                if v is None:
                    ax.text(p, 0.02, "n/a", transform=ax.get_xaxis_transform(), ha="center",
                            va="bottom", fontsize=7, rotation=90, color="grey")  # fmt: skip
        if positive:
            ax.set_yscale("log")
        else:
            ax.set_yticks([])  # only n/a bars (or zeros): no scale to read
        ax.margins(y=0.25)
        ax.set_ylabel(title)
        ax.grid(axis="y", alpha=0.3)
    only = {r["method"] for r in rows if r["note"].startswith("cost only")}
    names = [f"{m}\n(cost only)" if m in only else m for m in methods]
    axes[1].set_xticks(x, names, rotation=30, ha="right")
    axes[1].set_xlim(-0.5, len(methods) - 0.5)  # n/a bars have no extent of their own
    axes[0].legend(title="topology", fontsize=8)
    title = "Analytic communication cost per method and topology"
    if all(r.get("total_bytes") is None for r in rows):
        title += "\n(no method fits these topologies: every bar is n/a, cost.csv says why)"
    fig.suptitle(title)
    return save(fig, out, "cost")
