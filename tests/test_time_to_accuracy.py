"""Time to accuracy (``eval.targets``): ``summary.json``'s ``time_to_accuracy``, the sweep
tables' ``tta_*`` columns and ``p2pfl plot --x time|bytes``, each checked against the run's own
``metrics.csv`` and ``comm.csv`` rows, recomputed here independently."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import yaml

from conftest import AFTER_CUDA, ROOT, forks_refused, on_device, run_experiment
from p2pfl.app.cli import main
from p2pfl.reporting import plots, progress

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = {"model": {"name": "mlp", "hidden": [16]}, "peers": {"count": 4}}
FEDAVG = {"algorithm": {"name": "fedavg", "rounds": 4}} | SMALL
DFEDAVGM = {"topology": {"kind": "ring"}, "algorithm": {"name": "dfedavgm", "rounds": 4}} | SMALL
WALL = ("wall_time_s", "compute_wall_s")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models train much faster on one thread, above all on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def accuracies(run: Path, peer: str) -> list[tuple[float, int, float]]:
    """(time, round, value) of ``peer``'s accuracy rows, in file order."""
    return [
        (float(r["time"]), int(r["round"]), float(r["value"]))
        for r in rows(run / "metrics.csv")
        if r["peer"] == peer and r["metric"] == "accuracy"
    ]


def peers_mean(run: Path) -> list[tuple[float, int, float]]:
    """Per round: (latest time, round, mean accuracy) of the peers' own rows."""
    by_round: dict[int, list[tuple[float, float]]] = {}
    for r in rows(run / "metrics.csv"):
        if r["metric"] == "accuracy" and r["peer"] not in ("server", "final", "run"):
            by_round.setdefault(int(r["round"]), []).append((float(r["time"]), float(r["value"])))
    return [
        (max(t for t, _ in v), k, sum(a for _, a in v) / len(v))
        for k, v in sorted(by_round.items())
    ]


def expected(run: Path, series: list[tuple[float, int, float]], target: float) -> dict | None:
    """The first point of ``series`` (then the final row) at or above ``target``, with the
    bytes of every comm.csv row sent at or before its time."""
    points = sorted(series, key=lambda p: p[0]) + accuracies(run, "final")
    for t, k, value in points:
        if value >= target:
            sent = sum(int(r["bytes"]) for r in rows(run / "comm.csv") if float(r["time"]) <= t)
            return {"time_s": t, "bytes": sent, "round": k}
    return None


@pytest.fixture(scope="module")
def fedavg(tmp_path_factory) -> dict[str, Path]:
    """FedAvg on a star, run without targets, then again with targets read off the first
    run's server scores: the best one (reached first at a later round, exactly equal to a
    row's value), one below every score, and 1.0 (never reached by a 4-round digits MLP)."""
    root = tmp_path_factory.mktemp("fedavg")
    run_experiment(root / "plain", **FEDAVG)
    scores = [v for _, _, v in accuracies(root / "plain", "server")]
    targets = [max(scores), 1.0, min(scores) / 2]
    run_experiment(root / "targets", eval={"targets": targets}, **FEDAVG)
    return {"plain": root / "plain", "targets": root / "targets"}


def test_fedavg_times_bytes_and_rounds_are_the_server_rows_and_the_comm_rows(fedavg):
    run = fedavg["targets"]
    summary = json.loads((run / "summary.json").read_text())
    best, _, low = yaml.safe_load((run / "config.yaml").read_text())["eval"]["targets"]
    tta = summary["time_to_accuracy"]
    assert list(tta) == [repr(low), repr(best), "1.0"]  # ascending, keyed by str(target)
    server = accuracies(run, "server")
    assert len(server) == 4
    for target in (low, best, 1.0):
        assert tta[repr(target)] == expected(run, server, target), target
    assert tta["1.0"] is None
    assert tta[repr(low)]["round"] == 1 and tta[repr(low)]["time_s"] == server[0][0]
    first_best = next(k for _, k, v in server if v == best)
    assert tta[repr(best)]["round"] == first_best > 1  # the row equal to the target reaches it
    assert 0 < tta[repr(low)]["bytes"] < tta[repr(best)]["bytes"] <= summary["comm"]["total_bytes"]
    # the function reads the files: any target gives what the independent count gives
    for target in sorted({v for _, _, v in server} | {0.01, 0.999}):
        assert progress.time_to_accuracy(run, [target])[repr(target)] == expected(
            run, server, target
        )


def test_without_targets_nothing_changes(fedavg):
    plain, targets = (json.loads((fedavg[k] / "summary.json").read_text()) for k in fedavg)
    assert "time_to_accuracy" not in plain
    del targets["time_to_accuracy"]
    for summary in (plain, targets):
        for key in WALL:
            del summary[key]
    assert json.dumps(plain, indent=2) == json.dumps(targets, indent=2)
    assert list(plain) == list(targets)  # the same keys in the same order
    for name in ("metrics.csv", "comm.csv"):
        assert (fedavg["plain"] / name).read_bytes() == (fedavg["targets"] / name).read_bytes()
    # the keys a summary had before eval.targets existed, in their order
    assert list(plain) == [
        "experiment", "algorithm", "topology", "num_peers", "seed", "status", "transport",
        "final", "per_peer", "comm", "sim_time_s",
    ]  # fmt: skip


def test_a_serverless_run_uses_the_mean_over_peers_per_round(tmp_path):
    run = tmp_path / "dfedavgm"
    summary = run_experiment(run, eval={"targets": [0.05, 1.0]}, **DFEDAVGM)
    means = peers_mean(run)
    assert [k for _, k, _ in means] == [1, 2, 3, 4] and not accuracies(run, "server")
    assert summary["time_to_accuracy"] == {
        "0.05": expected(run, means, 0.05), "1.0": None,
    }  # fmt: skip
    assert summary["time_to_accuracy"]["0.05"]["round"] == 1
    # every value a peer has, and a hair below and above each round's mean: the series is
    # the mean (not a peer's best, nor its first row's time)
    values = {v for _, _, v in accuracies_of_peers(run)}
    values |= {m + d for _, _, m in means for d in (-1e-9, 1e-9)}
    for target in sorted(v for v in values if 0 < v <= 1):
        assert progress.time_to_accuracy(run, [target])[repr(target)] == expected(
            run, means, target
        ), target
    # a target between a round's mean and its best peer is not reached in that round
    mean1 = means[0][2]
    best1 = max(v for _, k, v in accuracies_of_peers(run) if k == 1)
    if best1 > mean1:
        between = (mean1 + best1) / 2
        assert progress.time_to_accuracy(run, [between])[repr(between)]["round"] > 1


def accuracies_of_peers(run: Path) -> list[tuple[float, int, float]]:
    return [
        (float(r["time"]), int(r["round"]), float(r["value"]))
        for r in rows(run / "metrics.csv")
        if r["metric"] == "accuracy" and r["peer"].isdigit()
    ]


def test_the_series_prefers_run_probes_then_the_server_then_the_peers_and_ends_final(tmp_path):
    """The rows of ``eval.every_s``'s probes (peer ``run``) come first, as metrics.csv holds
    them; a server's rows next; the final row always last."""
    (tmp_path / "metrics.csv").write_text(
        "time,round,peer,metric,value\n"
        "0.1,1,0,accuracy,0.9\n0.2,1,1,accuracy,0.5\n"  # round 1's mean: 0.7 at 0.2
        "0.15,1,server,accuracy,0.6\n0.3,2,server,accuracy,0.8\n"
        "0.25,0,run,accuracy,0.55\n0.05,0,run,accuracy,0.4\n0.5,3,run,loss,0.1\n"
        "0.9,3,final,accuracy,0.95\n"
    )
    (tmp_path / "comm.csv").write_text(
        "time,round,src,dst,kind,bytes,arrival,fate\n"
        "0,1,server,0,model,100,0.01,delivered\n0.05,1,server,1,model,10,0.06,lost\n"
        "0.3,2,0,server,model,1000,0.31,delivered\n"
    )
    metrics = rows(tmp_path / "metrics.csv")
    series, source = progress.accuracy_series(metrics)
    assert source == "run"
    assert [(p.time, p.round, p.accuracy) for p in series] == [
        (0.05, 0, 0.4), (0.25, 0, 0.55), (0.9, 3, 0.95),
    ]  # fmt: skip
    assert progress.time_to_accuracy(tmp_path, [0.4, 0.5, 0.96]) == {
        "0.4": {"time_s": 0.05, "bytes": 110, "round": 0},  # lost bytes count: they were sent
        "0.5": {"time_s": 0.25, "bytes": 110, "round": 0},
        "0.96": None,
    }
    series, source = progress.accuracy_series([r for r in metrics if r["peer"] != "run"])
    assert source == "server"
    assert [(p.time, p.accuracy) for p in series] == [(0.15, 0.6), (0.3, 0.8), (0.9, 0.95)]
    only_peers = [r for r in metrics if r["peer"] not in ("run", "server")]
    series, source = progress.accuracy_series(only_peers)
    assert source == "peers"
    assert [(p.time, p.round) for p in series] == [(0.2, 1), (0.9, 3)]
    assert series[0].accuracy == pytest.approx(0.7)


@pytest.mark.parametrize(
    "value, why",
    [
        ("[1.5]", "each target must be an accuracy in (0, 1], got 1.5"),
        ("[-0.1]", "each target must be an accuracy in (0, 1], got -0.1"),
        ("[0]", "each target must be an accuracy in (0, 1], got 0.0"),
        ("[a]", "must be number, got 'a'"),
        ("[0.7, 0.8, 0.7]", "0.7 is given twice"),
        ("[1, 1.0]", "1.0 is given twice"),
        ("0.7", "must be list of number, got 0.7"),
    ],
)
def test_bad_targets_are_one_line_exit_2_and_nothing_written(tmp_path, capsys, value, why):
    file = tmp_path / "exp.yaml"
    raw = {"name": "t", "dataset": {"name": "digits"}, "topology": {"kind": "star"}} | FEDAVG
    file.write_text(yaml.safe_dump(on_device(raw)))
    out = tmp_path / "out"
    argv = ["run", str(file), "--out", str(out), "--quiet", "--set", f"eval.targets={value}"]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: {file}: eval.targets: {why}\n"
    assert not out.exists()


def test_a_sweep_table_has_the_time_to_each_target(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plots, "sweep_chart", lambda *args: [])
    base = {"name": "tta", "dataset": {"name": "digits"}, "topology": {"kind": "star"}}
    raw = on_device(base | FEDAVG | {"eval": {"targets": [1.0, 0.05]}, "sweep": {"seed": [0, 1]}})
    file = tmp_path / "sweep.yaml"
    file.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = tmp_path / "out"
    assert main(["run", str(file), "--out", str(out), "--quiet"]) == 0
    cells = rows(out / "cells.csv")
    assert list(cells[0])[-4:] == ["tta_0.05_s", "tta_0.05_bytes", "tta_1.0_s", "tta_1.0_bytes"]
    for cell in cells:
        tta = json.loads((out / cell["cell"] / "summary.json").read_text())["time_to_accuracy"]
        assert float(cell["tta_0.05_s"]) == tta["0.05"]["time_s"]
        assert int(cell["tta_0.05_bytes"]) == tta["0.05"]["bytes"]
        assert cell["tta_1.0_s"] == cell["tta_1.0_bytes"] == ""
    (row,) = rows(out / "sweep.csv")
    assert list(row) == [
        "runs", "accuracy_mean", "accuracy_std", "total_bytes_mean", "total_bytes_std",
        "sim_time_s_mean", "sim_time_s_std", "tta_0.05_s", "tta_0.05_bytes", "tta_0.05_reached",
        "tta_1.0_s", "tta_1.0_bytes", "tta_1.0_reached", "note",
    ]  # fmt: skip
    assert float(row["tta_0.05_s"]) == pytest.approx(
        sum(float(c["tta_0.05_s"]) for c in cells) / 2, rel=1e-12
    )
    assert float(row["tta_0.05_bytes"]) == sum(int(c["tta_0.05_bytes"]) for c in cells) / 2
    assert (row["tta_0.05_reached"], row["tta_1.0_reached"]) == ("2", "0")
    assert row["tta_1.0_s"] == row["tta_1.0_bytes"] == ""
    printed = capsys.readouterr().out
    assert "time to 0.05 (s)" in printed and "time to 1.0 (s)" in printed and "never" in printed


def valid(path: Path) -> bool:
    if path.suffix == ".png":
        return path.read_bytes().startswith(PNG)
    return ET.parse(path).getroot().tag.endswith("svg")


def test_plot_draws_each_runs_series_against_time_and_bytes(fedavg, tmp_path):
    serverless = tmp_path / "ring"
    run_experiment(serverless, eval={"targets": [0.5]}, **DFEDAVGM)
    runs = [fedavg["targets"], serverless]
    for x in ("time", "bytes"):
        out = tmp_path / f"plots-{x}"
        assert main(["plot", *map(str, runs), "--x", x, "--out", str(out)]) == 0
        assert sorted(p.name for p in out.iterdir()) == [f"accuracy-{x}.png", f"accuracy-{x}.svg"]
        assert all(valid(p) for p in out.iterdir())
    out = tmp_path / "both"
    assert main(["plot", *map(str, runs), "--x", "bytes", "--x", "time", "--out", str(out)]) == 0
    assert len(list(out.iterdir())) == 4
    # the curves are the series, x the time or the bytes sent by then; one per run
    series = [
        sorted(accuracies(fedavg["targets"], "server")) + accuracies(fedavg["targets"], "final"),
        peers_mean(serverless) + accuracies(serverless, "final"),
    ]
    targets = yaml.safe_load((fedavg["targets"] / "config.yaml").read_text())["eval"]["targets"]
    for x in ("time", "bytes"):
        (ax,) = plots.progress_figure(plots.expand(runs), x).axes
        curves = [line for line in ax.lines if line.get_label()[0] != "_"]
        assert [c.get_label() for c in curves] == ["targets (server)", "ring (mean over peers)"]
        for curve, points, run in zip(curves, series, runs, strict=True):
            comm = rows(run / "comm.csv")
            xs = [
                t
                if x == "time"
                else sum(int(r["bytes"]) for r in comm if float(r["time"]) <= t) / 1e6
                for t, _, _ in points
            ]
            assert list(curve.get_xdata()) == pytest.approx(xs, rel=1e-12)
            assert list(curve.get_ydata()) == pytest.approx([v for _, _, v in points], rel=1e-12)
        lines = [line for line in ax.lines if line.get_label()[0] == "_"]
        assert sorted(line.get_ydata()[0] for line in lines) == sorted({*targets, 0.5})
    assert plots.progress_figure(plots.expand(runs), "bytes").axes[0].get_xscale() == "log"


def test_a_zmq_run_and_its_merge_report_the_same_from_their_files(tmp_path):
    if forks_refused():
        pytest.skip(AFTER_CUDA)
    file = tmp_path / "exp.yaml"
    raw = {"name": "z", "dataset": {"name": "digits"}, "topology": {"kind": "star"}} | FEDAVG
    raw |= {"eval": {"targets": [0.05, 1.0]}, "transport": {"timeout_s": 60}}
    file.write_text(yaml.safe_dump(on_device(raw)))
    out = tmp_path / "zmq"
    cmd = [sys.executable, "-m", "p2pfl", "run", str(file), "--out", str(out), "--quiet"]
    done = subprocess.run([*cmd, "--transport", "zmq"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["transport"] == "zmq"
    server = accuracies(out, "server")
    assert summary["time_to_accuracy"] == {
        "0.05": expected(out, server, 0.05), "1.0": None,
    }  # fmt: skip
    assert main(["merge", str(out), "--force"]) == 0  # the nodes' files merged again
    merged = json.loads((out / "summary.json").read_text())
    assert merged["time_to_accuracy"] == {
        "0.05": expected(out, accuracies(out, "server"), 0.05), "1.0": None,
    }  # fmt: skip
