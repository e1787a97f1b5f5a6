"""The analytic cost table: the FedELMY paper's Figure 5 to the byte, and analytic = measured
(every message's round, ends, kind and bytes) for every registered method on digits."""

from __future__ import annotations

import csv
from typing import Any

import pytest
import torch

from conftest import experiment, run_experiment, thousand_peers
from p2pfl.app import cost
from p2pfl.app.cli import main
from p2pfl.app.experiment import build
from p2pfl.core.errors import ConfigError
from p2pfl.methods import METHODS
from p2pfl.network.topology import build_topology

M = 46_200_000  # the paper's ResNet-18 message (Fig. 5)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models train much faster on one thread, above all on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def table(methods: str, kinds: str, peers: int = 10, **sections: Any) -> dict[tuple, dict]:
    setup = build(experiment(peers={"count": peers}, **sections))
    rows = cost.analyse(setup, cost.parse_methods(methods), kinds.split(","), M)
    return {(r["method"], r["topology"]): r for r in rows}


def test_figure5_numbers_to_the_byte():
    rows = table(
        "fedelmy,fedseq,metafed,dense,fedov,dfedavgm:rounds=1,dfedsam:rounds=1,"
        "fedelmy:variant=parallel",
        "ring,mesh,star",
    )
    n = 10
    expected = {
        ("fedelmy", "ring"): (n - 1) * M,  # 415.8 MB
        ("fedseq", "ring"): (n - 1) * M,
        ("metafed", "ring"): (2 * n - 1) * M,  # 877.8 MB
        ("dense", "star"): n * M,  # 462 MB
        ("fedov", "star"): n * M,
        ("dfedavgm:rounds=1", "ring"): 2 * n * M,  # 924 MB
        ("dfedavgm:rounds=1", "mesh"): n * (n - 1) * M,  # 4158 MB
        ("dfedsam:rounds=1", "mesh"): n * (n - 1) * M,
        ("fedelmy:variant=parallel", "mesh"): n * (n - 1) * M,
    }
    for key, total in expected.items():
        assert rows[key]["total_bytes"] == total, key
    assert rows[("fedseq", "ring")]["total_bytes"] == 415_800_000
    assert rows[("metafed", "ring")]["total_bytes"] == 877_800_000
    assert rows[("dense", "star")]["total_bytes"] == 462_000_000
    assert rows[("dfedavgm:rounds=1", "mesh")]["total_bytes"] == 4_158_000_000
    assert rows[("dfedavgm:rounds=1", "ring")]["total_bytes"] == 924_000_000
    assert rows[("metafed", "ring")]["note"] == "cost only (not runnable)"
    na = rows[("fedseq", "star")]
    assert na["status"] == "n/a" and "serverless" in na["note"]


def test_model_bytes_exclude_headers_and_scale_statistics():
    rows = table("fedavg:weighting=samples,maecho", "star", peers=4)
    fedavg = rows[("fedavg:weighting=samples", "star")]
    assert fedavg["model_bytes"] == 2 * 2 * 4 * M  # the experiment's 2 rounds, 4 peers, down and up
    assert fedavg["control_bytes"] == 0  # sample counts and stops carry no tensors
    maecho = rows[("maecho", "star")]
    assert maecho["model_bytes"] == 2 * 4 * M
    assert maecho["statistics_bytes"] > 0


# A tiny digits run per method (keys, topology); others get their defaults on the first
# topology that fits.
TINY: dict[str, tuple[dict[str, Any], str]] = {
    "fedavg": ({"rounds": 2, "participation": 0.5}, "star"),
    "fedprox": ({"rounds": 1, "weighting": "uniform"}, "star"),
    "fedseq": ({"cycles": 2, "order": "random"}, "mesh"),
    "dfedavgm": ({"rounds": 2}, "ring"),
    "dfedsam": ({"rounds": 1}, "mesh"),
    "fedelmy": ({"pool_size": 1, "warmup_epochs": 1}, "ring"),
    "fedfisher": ({"fisher": "diag", "steps": 20, "val_every": 10}, "star"),
    "fisher_merge": ({"placement": "mesh"}, "mesh"),
    "regmean": ({"placement": "mesh"}, "mesh"),
    "maecho": ({"tau": 2}, "star"),
}
EXTRA = [
    ("fedelmy", {"variant": "parallel", "pool_size": 1, "warmup_epochs": 0}, "mesh", {}),
    ("maecho", {"tau": 1, "placement": "mesh", "rank": 3}, "mesh", {}),
    (
        "fedfisher",
        {"fisher": "kfac", "steps": 20, "val_every": 10, "compress": True, "baselines": []},
        "star",
        {"model": {"codec": "int8"}, "statistics": {"codec": "fp16"}},
    ),
    ("fedavg", {"rounds": 2}, "star", {"model": {"codec": "topk", "fraction": 0.1}}),
    ("dfedavgm", {"rounds": 1}, "mesh", {"model": {"codec": "fp16"}}),
]


def fitting(name: str) -> tuple[dict[str, Any], str]:
    if name in TINY:
        return TINY[name]
    for kind in ("star", "ring", "mesh"):
        try:
            METHODS.get(name)().check(build_topology({"kind": kind}, 3, 0), 0)
            return {}, kind
        except ConfigError:
            continue
    pytest.fail(f"{name} runs on none of star, ring, mesh; add it to TINY")


def measured_vs_analytic(tmp_path, name, keys, kind, compression) -> None:
    sections = {
        "model": {"name": "mlp", "hidden": [16]},
        "topology": {"kind": kind},
        "peers": {"count": 3},
        "algorithm": {"name": name, **keys},
        "compression": compression,
    }
    summary = run_experiment(tmp_path, **sections)
    assert summary["status"] == "ok"
    setup = build(experiment(**sections))
    plan = cost.transfers(setup.method, cost.make_plan(setup, setup.topology, None))
    named = setup.topology.name
    analytic = sorted((t.round, named(t.src), named(t.dst), t.kind, t.bytes) for t in plan)
    with (tmp_path / "comm.csv").open() as f:
        rows = list(csv.DictReader(f))
    ledger = sorted((int(r["round"]), r["src"], r["dst"], r["kind"], int(r["bytes"])) for r in rows)
    assert analytic == ledger
    row = cost.summarize(plan, setup.topology)
    assert row["messages"] == summary["comm"]["messages"]
    assert row["total_bytes"] == summary["comm"]["total_bytes"]
    for kind_, counts in summary["comm"]["by_kind"].items():
        assert row[f"{kind_}_bytes"] == counts["bytes"]


@pytest.mark.parametrize("name", METHODS.names())
def test_analytic_equals_measured_for_every_method(tmp_path, name):
    keys, kind = fitting(name)
    measured_vs_analytic(tmp_path, name, keys, kind, {})


@pytest.mark.parametrize(("name", "keys", "kind", "compression"), EXTRA)
def test_analytic_equals_measured_for_variants_and_compression(
    tmp_path, name, keys, kind, compression
):
    measured_vs_analytic(tmp_path, name, keys, kind, compression)


@pytest.mark.parametrize(
    ("algorithm", "kind"),
    [({"name": "fedavg", "rounds": 2}, "star"), ({"name": "fedseq"}, "ring"),
     ({"name": "dfedavgm", "rounds": 2}, "mesh")],
)  # fmt: skip
def test_comm_time_is_the_simulated_time_when_compute_is_free(tmp_path, algorithm, kind):
    sections = {
        "topology": {"kind": kind, "link": {"latency_s": 0.02, "bandwidth_bps": 1e6}},
        "peers": {"count": 4, "flops_per_s": 1e30},
        "algorithm": algorithm,
    }
    summary = run_experiment(tmp_path, **sections)
    setup = build(experiment(**sections))
    plan = cost.transfers(setup.method, cost.make_plan(setup, setup.topology, None))
    assert cost.comm_time(plan, setup.topology) == pytest.approx(summary["sim_time_s"], rel=1e-9)


def star_fedavg(tmp_path) -> str:
    """A small FedAvg-on-a-star experiment file."""
    file = tmp_path / "exp.yaml"
    file.write_text(
        "dataset: {name: digits}\nmodel: {name: mlp, hidden: [16]}\ntopology: {kind: star}\n"
        "peers: {count: 4}\nalgorithm: {name: fedavg, rounds: 2}\n"
    )
    return str(file)


def test_cli_writes_table_csv_and_chart(tmp_path, capsys):
    file = star_fedavg(tmp_path)
    out = tmp_path / "cost"
    code = main(["cost", file, "--methods", "fedavg,fedseq,dense", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "n/a: fedavg runs on star, not on 'ring'" in printed
    assert {p.name for p in out.iterdir()} == {"cost.csv", "cost.png", "cost.svg"}
    with (out / "cost.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9 and rows[0]["method"] == "fedavg"
    assert main(["cost", file, "--methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_cli_where_no_method_fits_writes_the_n_a_table_and_says_so(tmp_path, capsys):
    """Every row n/a: no bar to put on a log axis (matplotlib once raised, after cost.csv was
    written); the table is printed and written, the chart says that nothing fits."""
    out = tmp_path / "cost"
    args = ["--methods", "fedavg", "--topologies", "ring,mesh", "--out", str(out)]
    assert main(["cost", star_fedavg(tmp_path), *args]) == 0
    printed = capsys.readouterr().out
    assert "n/a: fedavg runs on star, not on 'ring'" in printed
    assert "n/a: fedavg runs on star, not on 'mesh'" in printed
    assert {p.name for p in out.iterdir()} == {"cost.csv", "cost.png", "cost.svg"}
    with (out / "cost.csv").open() as f:
        assert [(r["topology"], r["status"]) for r in csv.DictReader(f)] == [
            ("ring", "n/a"), ("mesh", "n/a")
        ]  # fmt: skip
    assert "<!-- (no method fits these topologies" in (out / "cost.svg").read_text()
    assert (out / "cost.png").read_bytes().startswith(b"\x89PNG")


def test_methods_option_reads_yaml_values():
    assert cost.parse_methods("fedavg, regmean:offdiag=[0.1,0.5]:placement=mesh") == [
        ("fedavg", "fedavg", {}),
        (
            "regmean:offdiag=[0.1,0.5]:placement=mesh",
            "regmean",
            {"offdiag": [0.1, 0.5], "placement": "mesh"},
        ),
    ]
    with pytest.raises(ConfigError, match="expected NAME:KEY=VALUE"):
        cost.parse_methods("fedavg:rounds")
    with pytest.raises(ConfigError, match="--methods dfedavgm.rounds: must be integer"):
        cost.make_method("dfedavgm", {"rounds": "many"}, {"name": "fedavg"})


def test_a_mesh_too_large_to_list_is_an_n_a_row_decided_before_it_is_built(
    tmp_path, capsys, monkeypatch
):
    """A topology whose graph and messages would not fit in the free memory is an n/a row,
    and a mesh is counted, not built (10⁵ peers' default ring, mesh and star once took all
    24 GB and were killed); the other topologies are still priced."""
    from p2pfl.runtime import children

    built: list[str] = []
    real = cost.topology_for
    monkeypatch.setattr(cost, "topology_for", lambda s, kind: built.append(kind) or real(s, kind))
    monkeypatch.setattr(children, "available_memory", lambda: 256 * 2**20)
    file = thousand_peers(tmp_path / "exp.yaml", "ring")
    out = tmp_path / "cost"
    assert main(["cost", str(file), "--topologies", "ring,mesh", "--out", str(out)]) == 0
    assert "n/a: 1,000 peers on a mesh have 499,500 links" in capsys.readouterr().out
    assert built == ["ring"]
    with (out / "cost.csv").open() as f:
        rows = [(r["topology"], r["status"], r["messages"]) for r in csv.DictReader(f)]
    assert rows == [("ring", "ok", "2000"), ("mesh", "n/a", "")]
