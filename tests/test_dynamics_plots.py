"""The availability figure: written for a run with churn, and its online count is the
network's own (``Network.online``), read back from ``availability.csv``."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import experiment
from p2pfl.app.cli import main
from p2pfl.app.experiment import build, run
from p2pfl.reporting import plots

PNG = b"\x89PNG\r\n\x1a\n"
CHURN = {
    "churn": {"online": {"dist": "weibull", "mean_s": 0.6, "shape": 0.6}, "offline_fraction": 0.4},
    "crashes": {"at": {2: 1.5}},
}
SECTIONS = {
    "model": {"name": "mlp", "hidden": [8]},
    "peers": {"count": 8},
    "algorithm": {"name": "fedavg", "rounds": 6, "participation": 0.5, "deadline_s": 0.5},
    "network": CHURN,
}


@pytest.fixture(scope="module")
def churned(tmp_path_factory) -> Path:
    """A small FedAvg-with-deadline run on digits whose peers churn and one crashes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("churn") / "run"
    run(build(experiment(**SECTIONS)), out)
    torch.set_num_threads(threads)
    return out


def test_plot_draws_availability_under_accuracy_for_a_churn_run(churned, tmp_path):
    out = tmp_path / "plots"
    assert main(["plot", str(churned), "--out", str(out)]) == 0
    for fmt in ("png", "svg"):
        path = out / f"availability.{fmt}"
        assert path.is_file()
        if fmt == "png":
            assert path.read_bytes().startswith(PNG)
        else:
            assert ET.parse(path).getroot().tag.endswith("svg")


def test_a_run_without_a_network_section_gets_no_availability_figure(tmp_path):
    out = tmp_path / "run"
    run(build(experiment(model=SECTIONS["model"], algorithm={"name": "fedavg", "rounds": 1})), out)
    assert main(["plot", str(out), "--out", str(tmp_path / "plots")]) == 0
    assert not (tmp_path / "plots" / "availability.png").exists()


def test_the_online_count_is_the_networks(churned):
    """At times between the switches, the count read from availability.csv equals the number
    of peers ``Network.online`` says are online (the crashed peer 2 included: offline)."""
    network = build(experiment(**SECTIONS)).network
    assert network is not None
    run_ = plots.read_run(churned)
    end = plots.run_end(run_)
    times, online = plots.online_curve([run_])
    assert times[0] == 0 and times[-1] == end and len(times) > 10  # it does churn
    probes = np.linspace(0.01, end - 0.01, 97)
    peers = network.topology.peers
    expected = [sum(network.online(p, t) for p in peers) for t in probes]
    intervals = [(a, b) for _, a, b in run_.availability or []]
    assert list(plots.online_count(intervals, probes)) == expected
    # the plotted step function: the value from each time to the next
    steps = online[np.searchsorted(times, probes, side="right") - 1]
    assert list(steps) == expected
    # up to the run's end (the last stops in the file are the end itself, to 9 digits)
    tail = (times[-2] + end) / 2
    assert online[-1] == online[-2] == sum(network.online(p, tail) for p in peers) > 0
    assert min(expected) < len(peers) - 1  # some peers were offline at once
    assert all(not network.online(2, t) for t in probes if t >= 1.5)
    assert max(b for p, _, b in run_.availability or [] if p == 2) <= 1.5


def test_the_mean_over_runs_is_the_mean_of_their_counts(churned):
    """A line of several runs: at every time, the mean of the runs' counts."""
    one = plots.read_run(churned)
    shifted = plots.Run(one.path, one.config, one.metrics, one.comm,
                        [(p, a + 0.3, b + 0.3) for p, a, b in one.availability or []],
                        summary=one.summary)  # fmt: skip
    times, mean = plots.online_curve([one, shifted])
    for t, m in zip(times[:-1], mean[:-1], strict=True):
        counts = [
            plots.online_count([(a, b) for _, a, b in r.availability or []], np.array([t]))[0]
            for r in (one, shifted)
        ]
        assert m == pytest.approx(sum(counts) / 2)
