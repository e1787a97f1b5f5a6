"""Pictures: valid PNG and SVG files, and curves that read the run's own numbers."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_experiment
from p2pfl.app.cli import main
from p2pfl.core.errors import ConfigError
from p2pfl.reporting import plots
from p2pfl.reporting.tables import Table

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two tiny finished runs: FedAvg on a star, DFedAvgM on a ring."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models train much faster on one thread
    root = tmp_path_factory.mktemp("runs")
    common = {"model": {"name": "mlp", "hidden": [8]}, "peers": {"count": 4}}
    run_experiment(root / "fedavg", algorithm={"name": "fedavg", "rounds": 2}, **common)
    run_experiment(
        root / "dfedavgm", topology={"kind": "ring"}, algorithm={"name": "dfedavgm", "rounds": 2},
        **common,
    )  # fmt: skip
    torch.set_num_threads(threads)
    return {"fedavg": root / "fedavg", "dfedavgm": root / "dfedavgm"}


def valid(path: Path) -> bool:
    if path.suffix == ".png":
        return path.read_bytes().startswith(PNG)
    return ET.parse(path).getroot().tag.endswith("svg")


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def copy_run(run: Path, to: Path) -> Path:
    """A copy of ``run``'s files (not its plots) in ``to``, to break."""
    to.mkdir()
    for f in run.iterdir():
        if f.is_file():
            (to / f.name).write_bytes(f.read_bytes())
    return to


def test_plot_writes_valid_png_and_svg(runs, tmp_path, capsys):
    out = tmp_path / "plots"
    assert main(["plot", str(runs["fedavg"]), str(runs["dfedavgm"]), "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    stems = ("accuracy", "traffic", "partition-1")  # both runs share seed 0's partition
    assert names == {f"{s}.{fmt}" for s in stems for fmt in ("png", "svg")}
    assert all(valid(p) for p in out.iterdir())
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "neither a run" in capsys.readouterr().err


def test_plot_and_report_load_no_torch(runs, tmp_path):
    """Reading finished runs needs no torch (about 2 s to import): ``p2pfl plot`` and
    ``p2pfl report`` of the quick-start take half the time they took with it
    (benchmarks/startup.py)."""
    run, plots_dir, page = (str(p) for p in (runs["fedavg"], tmp_path / "p", tmp_path / "r.html"))
    code = (
        "import sys; from p2pfl.app.cli import main; "
        f"assert main(['plot', {run!r}, '--out', {plots_dir!r}]) == 0; "
        f"assert main(['report', {run!r}, '--out', {page!r}]) == 0; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
    assert valid(tmp_path / "p" / "accuracy.png") and (tmp_path / "r.html").is_file()


def test_default_output_is_the_first_run_plots_folder(runs):
    assert main(["plot", str(runs["fedavg"])]) == 0
    assert valid(runs["fedavg"] / "plots" / "accuracy.svg")


def test_a_default_output_that_is_a_file_is_a_one_line_error(runs, tmp_path, capsys):
    run = copy_run(runs["fedavg"], tmp_path / "run")
    (run / "plots").write_text("")
    assert main(["plot", str(run)]) == 2
    assert capsys.readouterr().err == f"error: --out: {run / 'plots'} is a file, not a directory\n"


@pytest.mark.parametrize(
    ("partition", "message"),
    [
        (None, "not a finished run: No such file or directory: {}"),
        ("peer,class_0,total\n0,x,3\n", "{} line 2: column 'class_0' is 'x', not a int"),
        ("peer,class_0,total\n0,3\n", "{} line 2: 2 fields; its header has 3"),
        ("peer,total\n0,3\n", "{}: no peer or no class column"),
    ],
)
def test_a_missing_or_broken_partition_is_a_one_line_error(
    runs, tmp_path, capsys, partition, message
):
    """Checked like the other CSV files, before anything is drawn or written."""
    run = copy_run(runs["fedavg"], tmp_path / "run")
    if partition is None:
        (run / "partition.csv").unlink()
    else:
        (run / "partition.csv").write_text(partition)
    assert main(["plot", str(run), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {message.format(run / 'partition.csv')}\n"
    assert not (tmp_path / "out").exists()


def test_a_sweep_leaves_out_a_cell_whose_run_did_not_finish(tmp_path):
    """An interrupted re-run of a finished cell leaves ``done`` in the old ``cells.csv``; its
    ``summary.json`` has the last word: the pictures are those of the other cell alone."""
    sweep = tmp_path / "sweep"
    file = tmp_path / "sweep.yaml"
    file.write_text(
        "name: mini\ndataset: {name: digits}\nmodel: {name: mlp, hidden: [8]}\n"
        "topology: {kind: star}\npeers: {count: 3}\nalgorithm: {name: fedavg, rounds: 2}\n"
        "sweep: {seed: [0, 1]}\n"
    )
    assert main(["run", str(file), "--out", str(sweep), "--quiet"]) == 0
    cells = rows(sweep / "cells.csv")
    assert [c["status"] for c in cells] == ["ok", "ok"]
    summary = sweep / cells[1]["cell"] / "summary.json"
    summary.write_text(json.dumps(json.loads(summary.read_text()) | {"status": "interrupted"}))
    [(_, kept)] = plots.expand([sweep])
    assert [r.path.name for r in kept] == [cells[0]["cell"]]
    assert main(["plot", str(sweep), "--out", str(tmp_path / "left-out")]) == 0
    lines = (sweep / "cells.csv").read_text().splitlines()
    (sweep / "cells.csv").write_text(f"{lines[0]}\n{lines[1]}\n")  # the finished cell alone
    assert main(["plot", str(sweep), "--out", str(tmp_path / "alone")]) == 0
    drawn = sorted(p.name for p in (tmp_path / "alone").iterdir() if p.suffix == ".png")
    assert drawn == ["accuracy.png", "partition-1.png", "traffic.png"]
    for name in drawn:
        assert (tmp_path / "left-out" / name).read_bytes() == (
            tmp_path / "alone" / name
        ).read_bytes()


def test_a_run_that_sent_nothing_is_drawn_without_a_log_axis(runs, tmp_path):
    """A bytes axis with no positive value cannot be logarithmic (matplotlib warns)."""
    run = copy_run(runs["fedavg"], tmp_path / "silent")
    header = (run / "comm.csv").read_text().splitlines()[0]
    (run / "comm.csv").write_text(header + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plots.accuracy_figure(plots.expand([run]))
    assert fig.axes[1].get_xscale() == "linear"
    assert list(fig.axes[1].get_lines()[0].get_xdata()) == [0.0, 0.0]  # drawn at 0
    assert plots.accuracy_figure(plots.expand([runs["fedavg"]])).axes[1].get_xscale() == "log"


@pytest.mark.parametrize("lines", [2, 36])
def test_a_long_legend_grows_the_figure_and_leaves_the_panels_their_height(runs, lines):
    """Eight sweeps in one figure gave 36 lines in one column of legend: the panels were
    squeezed to nothing (matplotlib warned that the layout collapsed). The figure now grows
    for what the legend needs beyond its own height; a short legend leaves it as it was."""
    run = plots.read_run(runs["dfedavgm"])
    named = [
        (f"sweep {i}: a combination with a long name, {'x' * 40}", [run]) for i in range(lines)
    ]
    for draw, size in (
        (plots.accuracy_figure, (15, 4.8)),
        (lambda ls: plots.progress_figure(ls, "time"), (9, 5.6)),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the layout's collapse is a warning
            fig = draw(named)
            fig.savefig(io.BytesIO(), format="png")
        width, height = fig.get_size_inches()
        panel = fig.axes[0].get_position().height * height
        assert width == size[0] and (height == size[1]) == (lines == 2) and panel > 2.0


def test_a_point_before_any_byte_is_left_out_of_the_log_axis():
    """On the log axis a point at 0 bytes is a gap: a segment to it would run in from the
    far left, a level the curve never had."""
    metrics = [
        {"time": t, "round": k, "peer": "0", "metric": "accuracy", "value": v}
        for t, k, v in ((1.0, 1, 0.2), (2.0, 2, 0.5), (3.0, 3, 0.6))
    ]
    comm = [{"time": 1.5, "src": "0", "dst": "1", "bytes": 10**6, "arrival": 1.5}]
    config = {"eval": {"targets": [0.5]}}
    run = plots.Run(Path("."), config, Table.of(metrics), Table.of(comm))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plots.accuracy_figure([("one", [run])])
        sent = plots.progress_figure([("one", [run])], "bytes").axes[0]
    x = fig.axes[1].get_lines()[0].get_xdata()
    assert np.isnan(x[0]) and list(x[1:]) == [1.0, 1.0]
    assert list(fig.axes[2].get_lines()[0].get_xdata()) == [1.0, 2.0, 3.0]
    x = sent.get_lines()[0].get_xdata()  # p2pfl plot --x bytes: bytes sent, the same axis
    assert sent.get_xscale() == "log" and np.isnan(x[0]) and list(x[1:]) == [1.0, 1.0]
    assert list(sent.get_lines()[1].get_xdata()) == [0, 1]  # the target's line, end to end


def test_curves_average_peers_and_count_delivered_bytes(runs):
    run = plots.read_run(runs["dfedavgm"])
    points, per_peer = plots.curve(run)
    assert per_peer
    for rnd, acc, when in points:
        logged = [
            (float(r["value"]), float(r["time"])) for r in run.metrics
            if r["metric"] == "accuracy" and r["peer"] != "final" and int(r["round"]) == rnd
        ]  # fmt: skip
        assert len(logged) == 4 and acc == pytest.approx(sum(a for a, _ in logged) / 4)
        assert when == max(t for _, t in logged)
    series, source = plots.series(run)  # a synchronous run's: its rounds in order
    assert source == "peers" and series[:, [3, 1, 0]].tolist() == points.tolist()
    for rnd, delivered in zip(points[:, 0], series[:, 2], strict=True):
        assert delivered == sum(int(r["bytes"]) for r in run.comm if int(r["round"]) <= rnd)
    fedavg, per_peer = plots.curve(plots.read_run(runs["fedavg"]))
    assert not per_peer and list(fedavg[:, 0]) == [1, 2]
    comm = rows(runs["fedavg"] / "comm.csv")
    first = plots.series(plots.read_run(runs["fedavg"]))[0][0]
    assert first[2] == sum(int(r["bytes"]) for r in comm if r["round"] == "1")


def test_an_asynchronous_run_is_drawn_forward_in_time(tmp_path):
    """AD-PSGD with one peer 10x slower, the run's model scored every 0.25 s: the slow
    peer's round 2 ends after the fast peers' round 20, so rounds are out of time order.
    Against time and bytes the figures draw the run's series (the one time_to_accuracy
    reads), forward in time; against rounds, the peers' means without the probes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run_experiment(
        tmp_path / "run", model={"name": "mlp", "hidden": [8]}, topology={"kind": "ring"},
        peers={"count": 4, "flops_per_s": 1e7, "slow_fraction": 0.25, "slow_factor": 0.1},
        algorithm={"name": "adpsgd"}, stop={"time_s": 3.0},
        eval={"every": 1, "per_peer": False, "every_s": 0.25},
    )  # fmt: skip
    torch.set_num_threads(threads)
    run = plots.read_run(tmp_path / "run")
    points, _ = plots.curve(run)
    assert (np.diff(points[:, 2]) < 0).any()  # the case: a round ends before an earlier one
    probes = [
        (float(r["time"]), float(r["value"])) for r in run.metrics
        if r["metric"] == "accuracy" and r["peer"] == "run"
    ]  # fmt: skip
    series, source = plots.series(run)
    assert source == "run" and series[:, :2].tolist() == [list(p) for p in probes]
    assert len(probes) == 11 and (np.diff(series[:, 0]) > 0).all()
    assert (np.diff(series[:, 2]) >= 0).all() and series[-1, 2] > 0
    fig = plots.accuracy_figure(plots.expand([tmp_path / "run"]))
    rounds, by_bytes, by_time = (ax.get_lines()[0] for ax in fig.axes[:3])
    assert list(rounds.get_xdata()) == list(points[:, 0])  # every round, probes left out
    assert list(rounds.get_ydata()) == list(points[:, 1])
    assert list(by_time.get_xdata()) == list(series[:, 0])
    assert list(by_bytes.get_xdata()) == list(series[:, 2] / 1e6)
    assert "the run's model" in fig.legends[0].get_texts()[0].get_text()
    assert plots.mean_series([run, run])[0].tolist() == series.tolist()


def test_a_line_averages_its_runs_round_by_round_or_probe_by_probe():
    """Seeds of an asynchronous run end their rounds at different times: a line's point is
    a round's (or a probe time's) mean over its runs, over what every run has, drawn in the
    order of the mean times."""

    def run(*points: tuple[float, int, str, float]) -> plots.Run:
        metrics = [
            {"time": t, "round": k, "peer": peer, "metric": "accuracy", "value": v}
            for t, k, peer, v in points
        ]
        comm = [{"src": "0", "dst": "1", "bytes": 10, "arrival": 1.0}]
        return plots.Run(Path("."), {}, Table.of(metrics), Table.of(comm))

    a = run((1.0, 1, "0", 0.2), (3.0, 1, "1", 0.4), (2.0, 2, "0", 0.5), (4.0, 2, "1", 0.7))
    b = run((1.0, 1, "0", 0.4), (1.0, 1, "1", 0.4), (2.0, 2, "0", 0.6), (2.0, 2, "1", 0.6),
            (2.5, 3, "0", 0.9), (2.5, 3, "1", 0.9))  # fmt: skip
    mean, source = plots.mean_series([a, b])
    assert source == "peers"  # rounds 1 and 2: (3 + 1) / 2 s and (4 + 2) / 2 s
    assert mean.ravel().tolist() == pytest.approx([2.0, 0.35, 10.0, 1.0, 3.0, 0.6, 10.0, 2.0])
    probes = run((0.5, 3, "run", 0.1), (1.0, 9, "run", 0.3), (0.5, 1, "0", 0.9))
    later = run((0.5, 1, "run", 0.3), (1.0, 2, "run", 0.5), (1.5, 4, "run", 0.9))
    mean, source = plots.mean_series([probes, later])
    assert source == "run"
    assert mean[:, :3].ravel().tolist() == pytest.approx([0.5, 0.2, 0.0, 1.0, 0.4, 10.0])


def test_traffic_counts_every_byte_on_its_link(runs):
    run = plots.read_run(runs["fedavg"])
    topology = plots.topology_of(run)
    per_link = plots.link_bytes(run, topology)
    total = json.loads((runs["fedavg"] / "summary.json").read_text())["comm"]["total_bytes"]
    assert sum(per_link.values()) == total
    assert set(per_link) == {frozenset((p, topology.server)) for p in topology.peers}
    # both directions of a link add up; a message between unknown nodes names its first row
    first = run.comm[0]
    there = dict(first, bytes="7")
    back = dict(first, src=first["dst"], dst=first["src"], bytes="5")
    names = {first["src"], first["dst"]}
    link = next(k for k in per_link if {topology.name(n) for n in k} == names)
    both = dataclasses.replace(run, comm=Table.of([there, back]))
    assert plots.link_bytes(both, topology) == {link: 12}
    stray = [there, dict(there, dst="nobody", bytes="1"), dict(there, src="nobody")]
    with pytest.raises(ConfigError, match="unknown nodes .*'dst': 'nobody', .*'bytes': '1'"):
        plots.link_bytes(dataclasses.replace(run, comm=Table.of(stray)), topology)


def test_cost_and_sweep_charts_are_valid(tmp_path):
    cost_rows = [
        {"method": "a", "topology": "ring", "total_bytes": 2e6, "comm_time_s": 0.5, "note": ""},
        {"method": "a", "topology": "star", "total_bytes": None, "comm_time_s": None,
         "note": "a runs on ring"},
    ]  # fmt: skip
    sweep_rows = [
        {"algorithm": "a", "runs": 2, "accuracy_mean": 0.5, "accuracy_std": 0.1,
         "total_bytes_mean": 1e6, "total_bytes_std": 0.0, "sim_time_s_mean": 1.0,
         "sim_time_s_std": 0.2},
        {"algorithm": "b", "runs": 0},
    ]  # fmt: skip
    written = plots.cost_chart(cost_rows, tmp_path) + plots.sweep_chart(
        ["algorithm"], sweep_rows, tmp_path
    )
    assert [p.name for p in written] == ["cost.png", "cost.svg", "sweep.png", "sweep.svg"]
    assert all(valid(p) for p in written)


def test_long_bar_names_are_numbered_with_a_legend_and_leave_the_panels_their_height():
    """A sweep over mappings names its lines with 90 characters: slanted under the bars they
    collapsed the panels (matplotlib warned, and cut them off); numbered, with a legend
    below, the panels keep most of the figure. Short names stay under their bars."""
    import io
    import warnings

    from matplotlib.figure import Figure

    long = [f"adpsgd_reply_timeout_s-1.0 · count-16_flops_per_s-300000000.0_case-{i}" * 2
            for i in range(6)]  # fmt: skip
    for names, ticks in ((long, [str(i) for i in range(1, 7)]), (["a", "b"], ["a", "b"])):
        fig = Figure(figsize=(9, 4.8), layout="constrained")
        panel = ("t", [1.0] * len(names), [0.1] * len(names))
        plots.bar_panels(fig, names, [panel] * 3)  # as sweep.png draws them
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "constrained_layout not applied ..." fails here
            fig.savefig(io.BytesIO(), format="png")
        for ax in fig.axes:
            assert [t.get_text() for t in ax.get_xticklabels()] == ticks
            assert ax.get_position().height > 0.4  # of the figure's height
        legends = fig.legends
        if names is long:
            assert [t.get_text() for t in legends[0].get_texts()] == [
                f"{i}: {name}" for i, name in enumerate(long, 1)
            ]
        else:
            assert not legends
    one = Figure(figsize=(4, 3), layout="constrained")
    plots.bar_panels(one, ["a"], [("t", [1.0], [0.0])])  # a single panel is one Axes
    assert len(one.axes) == 1


def test_a_heatmap_of_a_thousand_peers_stays_a_readable_size(tmp_path):
    """Beyond 60 rows the figure stops growing (1,000 peers once made a 40,000-pixel PNG
    with 1,000 tick labels, seconds of every large run); a small one keeps a tick a row."""
    import matplotlib.image

    from p2pfl.reporting.heatmap import save_heatmap

    counts = np.arange(10_000).reshape(1000, 10) % 97
    save_heatmap(counts, tmp_path / "big.png", "t", "class", "peer")
    save_heatmap(counts[:60], tmp_path / "sixty.png", "t", "class", "peer")
    big = matplotlib.image.imread(tmp_path / "big.png").shape
    sixty = matplotlib.image.imread(tmp_path / "sixty.png").shape
    assert big[:2] == sixty[:2] and big[0] < 2600


def test_a_topology_too_large_to_draw_gets_a_histogram_of_its_links_traffic(runs, monkeypatch):
    """Beyond ``DRAWN_MAX`` nodes the traffic figure is a histogram of the links' MB, not
    the graph (100,000 nodes drawn with their labels took 4.5 minutes): a bar per amount a
    link carried, its height the number of links, every link counted once."""
    run = plots.read_run(runs["dfedavgm"])
    topology = plots.topology_of(run)
    per_link = plots.link_bytes(run, topology)
    monkeypatch.setattr(plots, "DRAWN_MAX", topology.num_peers - 1)
    ax = plots.traffic_figure([("ring", [run])]).axes[0]
    assert ax.get_yscale() == "log" and not ax.texts  # no node labels, no graph
    bars = {round(p.get_x() + p.get_width() / 2, 9): p.get_height() for p in ax.patches}
    mb = [per_link[frozenset(e)] / 1e6 for e in topology.graph.edges]
    assert bars == {round(v, 9): mb.count(v) for v in set(mb)}
    assert sum(bars.values()) == topology.graph.number_of_edges()


def test_only_a_small_graph_is_drawn_with_node_labels(runs, monkeypatch):
    run = plots.read_run(runs["dfedavgm"])
    labelled = plots.traffic_figure([("ring", [run])]).axes[0]
    assert sorted(t.get_text() for t in labelled.texts) == ["0", "1", "2", "3"]
    monkeypatch.setattr(plots, "LABEL_MAX", 3)
    assert not plots.traffic_figure([("ring", [run])]).axes[0].texts


def test_a_sampled_runs_legends_say_its_mean_is_over_the_sample(runs, tmp_path):
    """``eval.peers``: the per-round mean is over the sample's peers, and both figures say so;
    a run that scores every peer keeps "mean over peers"."""
    sampled = tmp_path / "sampled"
    run_experiment(
        sampled, topology={"kind": "ring"}, algorithm={"name": "dfedavgm", "rounds": 2},
        model={"name": "mlp", "hidden": [8]}, peers={"count": 4}, eval={"peers": 2},
    )  # fmt: skip
    lines = plots.expand([runs["dfedavgm"], sampled])
    (ax, *_) = plots.accuracy_figure(lines).axes
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["dfedavgm (mean over peers)", "sampled (mean over a sample of 2 peers)"]
    (ax,) = plots.progress_figure(lines, "time").axes
    labels = [line.get_label() for line in ax.lines if line.get_label()[0] != "_"]
    assert labels == ["dfedavgm (mean over peers)", "sampled (mean over a sample of 2 peers)"]
    points, per_peer = plots.curve(plots.read_run(sampled))
    logged = [r for r in rows(sampled / "metrics.csv") if r["peer"].isdigit()]
    assert per_peer and len({r["peer"] for r in logged}) == 2
    assert points[-1, 1] == pytest.approx(
        np.mean(
            [float(r["value"]) for r in logged if r["metric"] == "accuracy" and r["round"] == "2"]
        )
    )
