"""Heterogeneous devices: per-peer compute speed and uplink/downlink bandwidth from seeded
spreads or a ``devices`` CSV file, ``peers.csv``, and a message from i to j at
min(up_i, down_j) in simulation and in ``p2pfl cost`` alike."""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from conftest import BASE, ROOT, experiment
from p2pfl.app.cli import main
from p2pfl.app.config import read_experiment, resolve
from p2pfl.app.cost import comm_time, make_plan, transfers
from p2pfl.app.experiment import build, run
from p2pfl.core.errors import ConfigError
from p2pfl.core.seeding import numpy_rng
from p2pfl.network.peers import Lognormal, Pareto, build_population

QUICKSTART_COMM_SHA = "2bd44d65677416529b9931267856d0676df05d68f0de8b862b24b90aafeb06b5"
OLD_PEER_KEYS = [
    "count", "device", "speed", "flops_per_s", "compute", "link", "speed_sigma",
    "slow_fraction", "slow_factor", "batched", "uplink",
]  # fmt: skip


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --- Without the new keys nothing changes -------------------------------------------------


def test_the_quickstart_without_the_new_keys_is_byte_identical(tmp_path):
    """comm.csv is the one pinned before per-peer bandwidths existed (sha-256), config.yaml
    lists the peers keys it always did, and no peers.csv is written."""
    out = tmp_path / "q"
    assert (
        main(["run", str(ROOT / "experiments/quickstart.yaml"), "--out", str(out), "--quiet"]) == 0
    )
    assert hashlib.sha256((out / "comm.csv").read_bytes()).hexdigest() == QUICKSTART_COMM_SHA
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sim_time_s"] == 0.6240418112000004
    assert list(yaml.safe_load((out / "config.yaml").read_text())["peers"]) == OLD_PEER_KEYS
    assert not (out / "peers.csv").exists()


def old_speeds(seed: int, count: int, sigma: float, fraction: float, factor: float) -> list[float]:
    """The speeds ``build_population`` drew before speed_dist existed, as it drew them."""
    rng = numpy_rng(seed, "peer-speeds")
    speeds = 1.0 * rng.lognormal(0.0, sigma, size=count)
    speeds[rng.permutation(count)[: round(fraction * count)]] *= factor
    return [float(s) for s in speeds]


def speeds(population: Any) -> list[float]:
    return [p.speed for p in population.profiles]


def test_speed_sigma_draws_what_it_drew_and_speed_dist_lognormal_draws_the_same():
    old = old_speeds(7, 50, 0.5, 0.2, 0.1)
    keys = {"count": 50, "slow_fraction": 0.2, "slow_factor": 0.1}
    assert speeds(build_population(7, **keys, speed_sigma=0.5)) == old
    same = build_population(7, **keys, speed_dist={"name": "lognormal", "sigma": 0.5})
    assert speeds(same) == old
    assert same.up_bps == same.down_bps == ()  # no per-peer bandwidth: the links' own


# --- Seeded draws ---------------------------------------------------------------------------

SPREADS = {
    "speed_dist": {"name": "pareto", "alpha": 1.5},
    "up_bps": 6e6,
    "up_dist": {"name": "lognormal", "sigma": 1.0},
    "down_bps": 1.3e7,
    "down_dist": {"name": "pareto", "alpha": 2.0},
}


def test_the_draws_are_seeded_and_each_quantity_has_its_own_stream():
    a = build_population(3, count=200, **SPREADS)
    assert a == build_population(3, count=200, **SPREADS)
    other = build_population(4, count=200, **SPREADS)
    assert speeds(other) != speeds(a) and other.up_bps != a.up_bps and other.down_bps != a.down_bps
    # leaving the bandwidths out, or spreading only one side, changes no other draw
    alone = build_population(3, count=200, speed_dist=SPREADS["speed_dist"])
    assert speeds(alone) == speeds(a)
    up_only = build_population(3, count=200, up_bps=6e6, up_dist=SPREADS["up_dist"])
    assert up_only.up_bps == a.up_bps and up_only.down_bps == ()
    flat = build_population(3, count=200, up_bps=6e6, down_bps=1.3e7)
    assert flat.up_bps == (6e6,) * 200 and flat.down_bps == (1.3e7,) * 200
    assert a.heterogeneous and flat.heterogeneous
    assert not build_population(3, count=200).heterogeneous


@pytest.mark.parametrize(
    "dist",
    [Lognormal(sigma=1.0), Lognormal(sigma=0.3), Pareto(alpha=1.5), Pareto(alpha=3.0)],
    ids=str,
)
def test_ten_thousand_draws_have_the_analytic_quantiles(dist):
    """Deciles 1, 5 and 9 of 10,000 draws within 5% of the analytic ones (the sampling
    error of a decile is about 1.5% of it here); the median is the typical value."""
    options = {"name": type(dist).__name__.lower()} | vars(dist)
    pop = build_population(11, count=10_000, speed=2.0, speed_dist=options)
    drawn = np.array(speeds(pop)) / 2.0
    for q in (0.1, 0.5, 0.9):
        assert np.quantile(drawn, q) == pytest.approx(dist.quantile(q), rel=0.05), q
    assert dist.quantile(0.5) == pytest.approx(1.0)


def test_the_pareto_tail_is_slow_peers_and_bounded_on_the_fast_side():
    """Pareto(alpha): no peer over 2^(1/alpha) times faster than the median; k^-alpha / 2 of
    them over k times slower (10,000 draws: 1.58% at alpha 1.5, k 10; within 3 standard
    errors)."""
    alpha = 1.5
    up = np.array(
        build_population(
            5, count=10_000, up_bps=1e7, up_dist={"name": "pareto", "alpha": alpha}
        ).up_bps
    )
    m = up / 1e7
    assert m.max() <= 2 ** (1 / alpha)
    share = float((m < 1 / 10).mean())
    expected = 10**-alpha / 2
    assert abs(share - expected) < 3 * math.sqrt(expected * (1 - expected) / 10_000)
    assert np.median(m) == pytest.approx(1.0, rel=0.05)


def test_the_shipped_phone_profile_has_the_medians_it_cites():
    """peers/phones.yaml: LTE medians 13 Mbit/s down and 6 Mbit/s up (Huang et al. 2012)."""
    raw = copy.deepcopy(BASE) | {"peers": {"count": 2000, "profile": "peers/phones.yaml"}}
    pop = resolve(raw, ROOT / "experiments" / "test.yaml").population
    assert np.median(pop.down_bps) == pytest.approx(1.3e7, rel=0.1)
    assert np.median(pop.up_bps) == pytest.approx(6e6, rel=0.1)
    assert np.median(speeds(pop)) == pytest.approx(1.0, rel=0.1)


# --- The devices file -----------------------------------------------------------------------

HEADER = "peer,flops_per_s,up_bps,down_bps\n"
# three peers whose pairs are limited by the sender's uplink (0->1: 1e6 < 1.5e6), the
# receiver's downlink (1->0: 3e6 < 4e6), or each in turn
DEVICES = (
    HEADER + "# a comment, then rows in any order\n2,2e9,2e6,8e6\n0,5e8,1e6,3e6\n1,1e9,4e6,1.5e6\n"
)
UP = {0: 1e6, 1: 4e6, 2: 2e6}
DOWN = {0: 3e6, 1: 1.5e6, 2: 8e6}
FLOPS = {0: 5e8, 1: 1e9, 2: 2e9}
MESH = {"kind": "mesh", "link": {"latency_s": 0.01, "bandwidth_bps": 1e8}}


def devices_file(tmp_path: Path, text: str = DEVICES) -> Path:
    path = tmp_path / "devices.csv"
    path.write_text(text)
    return path


def mesh_run(tmp_path: Path, name: str, devices: Path, **topology: Any) -> Path:
    out = tmp_path / name
    config = experiment(
        peers={"count": 3, "devices": str(devices)},
        topology=MESH | topology,
        algorithm={"name": "dfedavgm", "rounds": 2},
        model={"name": "mlp", "hidden": [8]},
    )
    run(build(config), out)
    return out


def test_a_message_from_i_to_j_goes_at_min_of_up_i_and_down_j(tmp_path):
    """Every message of a 3-peer DFedAvgM mesh, replayed through each sender's FIFO uplink
    at min(up_src, down_dst), arrives when comm.csv says; the edge a ``links:`` entry gives
    its own bandwidth (0-1 here) keeps it, both ways."""
    out = mesh_run(
        tmp_path, "mesh", devices_file(tmp_path), links=[{"between": [0, 1], "bandwidth_bps": 5e5}]
    )
    sent = rows(out / "comm.csv")
    assert len(sent) >= 12
    pinned = {frozenset((0, 1))}
    by_src: dict[int, list[dict[str, str]]] = {}
    for r in sent:
        by_src.setdefault(int(r["src"]), []).append(r)
    for src, mine in by_src.items():
        free = 0.0
        for r in sorted(mine, key=lambda r: (float(r["time"]), float(r["arrival"]))):
            dst = int(r["dst"])
            rate = 5e5 if frozenset((src, dst)) in pinned else min(UP[src], DOWN[dst])
            free = max(float(r["time"]), free) + 8.0 * int(r["bytes"]) / rate
            assert float(r["arrival"]) == pytest.approx(free + 0.01, rel=1e-8), r
    # the rule's both sides show: 1->2 at up_1 (4e6 < 8e6), 2->1 at down_1 (1.5e6 < 2e6)
    assert {(int(r["src"]), int(r["dst"])) for r in sent} >= {(1, 2), (2, 1), (0, 2), (2, 0)}
    peers = rows(out / "peers.csv")
    assert [
        (int(p["peer"]), float(p["flops_per_s"]), float(p["up_bps"]), float(p["down_bps"]))
        for p in peers
    ] == [(i, FLOPS[i], UP[i], DOWN[i]) for i in range(3)]
    assert [float(p["speed"]) for p in peers] == [FLOPS[i] / 5e9 for i in range(3)]


def test_each_peer_computes_at_its_own_flops(tmp_path):
    """The same run with every peer at 1 GFLOP/s and with 0.5, 1, 2: each peer's first
    model leaves when its training ends, 1/k as long at k times the FLOP/s."""
    same = HEADER + "0,1e9,1e6,3e6\n1,1e9,4e6,1.5e6\n2,1e9,2e6,8e6\n"
    a = mesh_run(tmp_path, "same", _write(tmp_path, "same.csv", same))
    b = mesh_run(tmp_path, "mixed", _write(tmp_path, "mixed.csv", DEVICES))
    first = {}
    for name, out in (("a", a), ("b", b)):
        first[name] = {}
        for r in rows(out / "comm.csv"):
            first[name].setdefault(int(r["src"]), float(r["time"]))
    for p in range(3):
        assert first["b"][p] == pytest.approx(first["a"][p] * 1e9 / FLOPS[p], rel=1e-8)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_p2pfl_cost_prices_a_transfer_at_min_of_up_and_down_as_the_simulation_does(tmp_path):
    """FedAvg on a 3-peer star: the server's round-1 models leave one after another, each
    at its receiver's downlink (the server's own is not limited). The analytic plan's
    first phase lasts exactly what the simulated phase lasts, and the whole plan's time is
    the FIFO sum at min(up, down) per message."""
    config = experiment(
        peers={"count": 3, "devices": str(devices_file(tmp_path))},
        topology={"kind": "star", "link": {"latency_s": 0.02, "bandwidth_bps": 1e8}},
        algorithm={"name": "fedavg", "rounds": 1},
        model={"name": "mlp", "hidden": [8]},
    )
    setup = build(config)
    plan = transfers(setup.method, make_plan(setup, setup.topology, None))
    phase1 = [t for t in plan if t.phase == 1]
    assert {t.src for t in phase1} == {3} and len(phase1) == 3
    out = tmp_path / "star"
    run(build(config), out)
    down = [
        r
        for r in rows(out / "comm.csv")
        if r["src"] == "server" and r["round"] == "1" and r["kind"] == "model"
    ]
    simulated = max(float(r["arrival"]) for r in down) - min(float(r["time"]) for r in down)
    assert comm_time(phase1, setup.topology) == pytest.approx(simulated, rel=1e-8)
    expected, server = 0.0, 3
    for phase in sorted({t.phase for t in plan}):
        end, busy = 0.0, {}
        for t in (t for t in plan if t.phase == phase):
            up = UP.get(t.src, math.inf)
            rate = min(up, DOWN.get(t.dst, math.inf))
            busy[t.src] = busy.get(t.src, 0.0) + 8.0 * t.bytes / rate
            end = max(end, busy[t.src] + 0.02)
        expected += end
    assert server not in UP
    assert comm_time(plan, setup.topology) == pytest.approx(expected, rel=1e-12)


BAD_FILES = {
    "unknown-peer": (DEVICES + "3,1e9,1e6,1e6\n", "line 6: unknown peer '3': peers are 0..2"),
    "missing-peer": (
        HEADER + "0,1e9,1e6,1e6\n2,1e9,1e6,1e6\n",
        "lists no row for 1 of the 3 peers: 1",
    ),
    "twice": (DEVICES + "0,1e9,1e6,1e6\n", "line 6: peer 0 is listed twice (also line 4)"),
    "negative": (
        HEADER + "0,-1e9,1e6,1e6\n1,1e9,1e6,1e6\n2,1e9,1e6,1e6\n",
        "line 2: flops_per_s must be a positive number, got '-1e9'",
    ),
    "zero": (
        HEADER + "0,1e9,0,1e6\n1,1e9,1e6,1e6\n2,1e9,1e6,1e6\n",
        "line 2: up_bps must be a positive number, got '0'",
    ),
    "not-a-number": (
        HEADER + "0,1e9,1e6,fast\n1,1e9,1e6,1e6\n2,1e9,1e6,1e6\n",
        "line 2: down_bps must be a positive number, got 'fast'",
    ),
    "nan": (
        HEADER + "0,nan,1e6,1e6\n1,1e9,1e6,1e6\n2,1e9,1e6,1e6\n",
        "flops_per_s must be a positive number, got 'nan'",
    ),
    "bad-header": (
        "peer,flops,up,down\n0,1e9,1e6,1e6\n",
        "line 1: the header must be 'peer,flops_per_s,up_bps,down_bps'",
    ),
    "short-row": (HEADER + "0,1e9,1e6\n", "line 2: 3 fields; the header has 4"),
    "empty": ("# nothing\n", "is empty"),
    "not-utf8": (b"peer,flops_per_s,up_bps,down_bps\n0,1e9,1e6,\xff\n", "is not UTF-8 text"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_devices_file_is_one_error_line_and_nothing_is_written(tmp_path, capsys, case):
    text, needle = BAD_FILES[case]
    path = tmp_path / "devices.csv"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "out"
    exp = tmp_path / "exp.yaml"
    exp.write_text(
        yaml.safe_dump(copy.deepcopy(BASE) | {"peers": {"count": 3, "devices": "devices.csv"}})
    )
    code = main(["run", str(exp), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {exp}: peers.devices: "), err
    assert needle in err, err
    assert "Traceback" not in err
    assert not out.exists()


BAD_KEYS = {
    "no-file": ({"devices": "nowhere.csv"}, "peers.devices: no such devices file 'nowhere.csv'"),
    "with-sigma": (
        {"devices": "d.csv", "speed_sigma": 0.5},
        "peers.devices: gives every peer's compute and bandwidths; drop speed_sigma",
    ),
    "dist-name": (
        {"speed_dist": {"name": "weibull"}},
        "peers.speed_dist.name: must be lognormal or pareto, got 'weibull'",
    ),
    "no-sigma": (
        {"speed_dist": {"name": "lognormal"}},
        "peers.speed_dist.sigma: missing required key",
    ),
    "alpha-zero": (
        {"up_bps": 1e6, "up_dist": {"name": "pareto", "alpha": 0}},
        "peers.up_dist.alpha: must be in [0.1, 100], got 0",
    ),
    "extra-key": (
        {"speed_dist": {"name": "pareto", "alpha": 2, "sigma": 1}},
        "peers.speed_dist.sigma: unknown key",
    ),
    "no-median": (
        {"down_dist": {"name": "lognormal", "sigma": 1}},
        "peers.down_dist: needs down_bps, the median it spreads around",
    ),
    "negative-up": ({"up_bps": -5}, "peers.up_bps: must be > 0"),
    "both-speeds": (
        {"speed_sigma": 1, "speed_dist": {"name": "lognormal", "sigma": 1}},
        "peers.speed_dist: give speed_dist or speed_sigma, not both",
    ),
    "not-a-mapping": (
        {"speed_dist": "pareto"},
        "peers.speed_dist: must be mapping or null, got 'pareto'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_KEYS))
def test_a_bad_spread_or_devices_key_is_one_error_line(tmp_path, capsys, case):
    keys, needle = BAD_KEYS[case]
    (tmp_path / "d.csv").write_text(DEVICES)
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(copy.deepcopy(BASE) | {"peers": {"count": 3} | keys}))
    out = tmp_path / "out"
    code = main(["run", str(exp), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert needle in err, err
    assert not out.exists()


def test_the_command_line_refuses_a_bad_devices_file_in_a_process_of_its_own(tmp_path):
    """``python -m p2pfl run``: exit 2, one ``error:`` line on stderr, no run directory."""
    (tmp_path / "d.csv").write_text(HEADER + "0,1e9,1e6,1e6\n1,-2,1e6,1e6\n2,1e9,1e6,1e6\n")
    exp = tmp_path / "exp.yaml"
    exp.write_text(
        yaml.safe_dump(copy.deepcopy(BASE) | {"peers": {"count": 3, "devices": "d.csv"}})
    )
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "p2pfl", "run", str(exp), "--out", str(out), "--quiet"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: {exp}: peers.devices: {tmp_path / 'd.csv'}: line 3: flops_per_s must be a "
        "positive number, got '-2'"
    ]
    assert not out.exists()


def test_devices_in_the_resolved_config_is_an_absolute_path_and_the_run_replays(tmp_path):
    """config.yaml names the devices file absolutely (a run started elsewhere finds it),
    lists only the new keys that were given, and the population it builds is the file's."""
    devices_file(tmp_path)
    exp = tmp_path / "exp.yaml"
    exp.write_text(
        yaml.safe_dump(copy.deepcopy(BASE) | {"peers": {"count": 3, "devices": "devices.csv"}})
    )
    config = resolve(read_experiment(exp), exp).config
    assert config["peers"]["devices"] == str((tmp_path / "devices.csv").resolve())
    assert [k for k in config["peers"] if k not in OLD_PEER_KEYS] == ["devices"]
    pop = build_population(0, **config["peers"])
    assert [pop.peer_flops(p) for p in range(3)] == [FLOPS[p] for p in range(3)]
    with pytest.raises(ConfigError, match="drop speed"):
        build_population(0, **(config["peers"] | {"speed": 2.0}))
