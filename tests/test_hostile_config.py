"""Hostile configuration, files and arguments (issue 19): each case is refused with one
``error:`` line and exit code 2, before anything is written and before any data is loaded;
none hangs, none prints a traceback. The catalogue goes on in test_hostile_run.py (output
directories, signals, transport bounds) and test_hostile_frames.py (what arrives over sockets)."""

from __future__ import annotations

import copy
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from conftest import BASE
from p2pfl.app.cli import main
from p2pfl.core.options import check_type
from p2pfl.core.yaml_io import MAX_FILE_BYTES, MAX_NODES

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)  # 9**9 leaves from 90 written ones: "billion laughs"


def exp_file(tmp_path: Path, text: str | bytes | None = None, **sections: Any) -> Path:
    """BASE (sections replaced, ``None`` drops one) as YAML, or ``text`` as given."""
    path = tmp_path / "exp.yaml"
    if text is None:
        config = copy.deepcopy(BASE) | sections
        text = yaml.safe_dump({k: v for k, v in config.items() if v is not None})
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)
    return path


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> str:
    """The CLI (in this process) exits 2 with one ``error:`` line holding ``needle``."""
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0], lines[0]
    return lines[0]


def run_refused(tmp_path: Path, capsys: Any, path: Path, argv: list[str], needle: str) -> str:
    out = tmp_path / "out"
    line = refused(capsys, ["run", str(path), "--out", str(out), "--quiet", *argv], needle)
    assert not out.exists()
    return line


# --- 1. Numbers that are not numbers: NaN and infinities, wherever a float is read ---------
FLOAT_KEYS = [
    "train.lr",
    "train.momentum",
    "train.weight_decay",
    "topology.link.latency_s",
    "topology.link.bandwidth_bps",
    "peers.speed",
    "peers.flops_per_s",
    "peers.speed_sigma",
    "transport.timeout_s",
    "transport.startup_timeout_s",
    "partition.val_fraction",
    "algorithm.participation",
    "compression.model.fraction",
]
NON_FINITE = [".nan", ".inf", "-.inf"]


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_a_non_finite_float_is_refused_naming_its_key(tmp_path, capsys, key, value):
    sets = [f"{key}={value}"]
    if key.startswith("compression"):
        sets = ["compression.model.codec=topk", *sets]
    line = run_refused(tmp_path, capsys, exp_file(tmp_path), [f"--set={s}" for s in sets], key)
    assert "finite" in line


NESTED_FLOATS = [  # (sections, the key the error names)
    ({"partition": {"name": "dirichlet", "alpha": float("nan")}}, "partition.alpha"),
    ({"algorithm": {"name": "fedprox", "rounds": 2, "mu": float("inf")}}, "algorithm.mu"),
    ({"network": {"links": {"loss": float("nan")}}}, "network.links.loss"),
    (
        {"network": {"churn": {"offline": {"mean_s": float("inf")}}}},
        "network.churn.offline.mean_s",
    ),
    ({"network": {"crashes": {"at": {0: float("nan")}}}}, "network.crashes.at"),
    ({"network": {"crashes": {"between_s": [0, float("inf")]}}}, "network.crashes.between_s"),
    ({"network": {"churn": {"offline_fraction": float("nan")}}}, "network.churn.offline_fraction"),
    ({"topology": {"kind": "star", "link": {"latency_s": float("-inf")}}}, "topology.link"),
]


@pytest.mark.parametrize("sections,key", NESTED_FLOATS, ids=[k for _, k in NESTED_FLOATS])
def test_a_non_finite_float_deep_in_a_section_is_refused(tmp_path, capsys, sections, key):
    run_refused(tmp_path, capsys, exp_file(tmp_path, **sections), [], key)


@given(st.floats() | st.integers(min_value=-(2**1100), max_value=2**1100))
def test_check_type_takes_every_finite_number_and_no_other(x):
    if isinstance(x, float) and math.isfinite(x) or isinstance(x, int) and abs(x) < 2**1000:
        assert check_type(x, float) == float(x) and check_type(x, float | None) == float(x)
    else:
        for tp in (float, float | None, list[float]):
            with pytest.raises(TypeError, match="must be a finite number"):
                check_type([x] if tp == list[float] else x, tp)


@given(st.integers())
def test_check_type_takes_every_64_bit_integer_and_no_other(n):
    if abs(n) < 2**63:
        assert check_type(n, int) == n
    else:
        with pytest.raises(TypeError, match="below 2"):
            check_type(n, int | None)


# --- 2. Sizes and counts that would take minutes or gigabytes before anything says no -----
SIZES = [
    ({"peers": {"count": 10_000_000}}, "peers.count"),
    ({"peers": {"count": 10**30}}, "peers.count"),
    ({"peers": {"count": -5}}, "peers.count"),
    ({"peers": {"count": 2.5}}, "peers.count"),
    ({"peers": {"count": "many"}}, "peers.count"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 2.0}, "seed"),
    ({"algorithm": {"name": "fedavg", "rounds": 2**70}}, "algorithm.rounds"),
    ({"train": {"epochs": 2**64}}, "train.epochs"),
    ({"train": {"batch_size": 0}}, "train.batch_size"),
    ({"transport": {"timeout_s": 1e7}}, "transport.timeout_s"),
    ({"transport": {"max_message_bytes": 2**50}}, "transport.max_message_bytes"),
    ({"model": {"name": "mlp", "hidden": [10**9]}}, "model: has 75,000,000,010 parameters"),
    ({"model": {"name": "mlp", "hidden": [10**5, 10**5]}}, "model: has 10,007,600,010"),
    # convolutions too large to size even their flatten width: their own count, "or more"
    ({"model": {"name": "cnn3", "width": 10**5}}, "model: has 180,001,200,000 parameters or more"),
]


@pytest.mark.parametrize("sections,key", SIZES, ids=[f"{k}-{i}" for i, (_, k) in enumerate(SIZES)])
def test_an_absurd_size_is_refused_before_anything_is_built(tmp_path, capsys, sections, key):
    run_refused(tmp_path, capsys, exp_file(tmp_path, **sections), [], key)


ARGUMENTS = [
    (["--seed", str(2**63)], "seed"),
    (["--seed", "-1"], "seed"),
    (["--seed", "1e3"], "--seed"),
    (["--set", "peers.count=1e7"], "peers.count"),
    (["--set", "=3"], "--set"),
    (["--set", "train..lr=3"], "--set"),
    (["--set", "train.lr"], "--set"),
    (["--set", "name=" + "n" * 300], "name"),
    (["--set", "train.lr=*nope"], "train.lr"),
    (["--set", "train.lr=!!python/object/apply:os.system [true]"], "train.lr"),
    (["--transport", "tcp"], "--transport"),
    (["--set", "peers.uplink=lifo"], "peers.uplink"),
    (["--set", "peers.uplink=[fifo]"], "peers.uplink"),
    (["--bogus"], "unrecognized"),
]


@pytest.mark.parametrize("argv,key", ARGUMENTS, ids=[" ".join(a)[:40] for a, _ in ARGUMENTS])
def test_a_bad_argument_is_one_error_line(tmp_path, capsys, argv, key):
    run_refused(tmp_path, capsys, exp_file(tmp_path), argv, key)


def test_a_long_name_is_refused_before_the_default_directory_is_made(tmp_path, capsys, monkeypatch):
    path = exp_file(tmp_path, name="n" * 300)
    monkeypatch.chdir(tmp_path)  # os.chdir left every later test in tmp_path
    refused(capsys, ["run", str(path), "--quiet"], "name")
    assert not (tmp_path / "runs").exists()


LONG_SWEEPS = [
    {"sweep": {"name": ["x" * 300]}},
    {"sweep": {"train.lr": [0.1], "algorithm": [{"name": "fedavg", "rounds": 2, "x": "y" * 300}]}},
]


@pytest.mark.parametrize("sections", LONG_SWEEPS, ids=["long-value", "long-mapping"])
def test_a_sweep_cell_too_long_for_a_file_name_is_refused(tmp_path, capsys, sections):
    run_refused(tmp_path, capsys, exp_file(tmp_path, **sections), [], "sweep")


BAD_SWEEP_KEYS = [  # (--set, what the error names)
    ("sweep={1: [a]}", "sweep.1: must be a section or a dotted key path"),
    ("sweep={train..lr: [0.1]}", "sweep.train..lr: must be a section or a dotted key path"),
    ("sweep={train.lr: [2020-01-01]}", "train.lr (sweep cell train.lr=2020-01-01): must be num"),
    ("sweep={train.lr: [!!set {a}]}", "train.lr (sweep cell train.lr="),
]


@pytest.mark.parametrize(("assignment", "needle"), BAD_SWEEP_KEYS)
def test_a_bad_sweep_key_or_value_is_one_error_line(tmp_path, capsys, assignment, needle):
    run_refused(tmp_path, capsys, exp_file(tmp_path), ["--set", assignment], needle)


# --- 3. Files that are not what they claim ------------------------------------------------
def _yaml(**sections: Any) -> str:
    config = copy.deepcopy(BASE) | sections
    return yaml.safe_dump({k: v for k, v in config.items() if v is not None})


FILES = [
    ("utf16", _yaml().encode("utf-16"), "UTF-8"),
    ("latin1", ("name: caf\xe9\n" + _yaml()).encode("latin-1"), "UTF-8"),
    ("binary", bytes(range(256)) * 4, "UTF-8"),
    ("nul", b"name: a\x00b\n", "#x0000"),
    ("empty", b"", "missing required section"),
    ("list", b"- 1\n- 2\n", "mapping"),
    ("scalar", b"just words\n", "mapping"),
    ("tabs", b"name:\tx\n\tseed: 1\n", "YAML"),
    ("unclosed", b"train: {lr: 0.1\n", "YAML"),
    ("python-tag", b"name: !!python/object/apply:os.system [true]\n", "YAML"),
    ("python-name", b"seed: !!python/name:os.system\n", "YAML"),
    ("unknown-tag", b"seed: !mine 3\n", "YAML"),
    ("dup-top", (_yaml() + "seed: 3\n").encode(), "duplicate key 'seed'"),
    ("dup-nested", b"train: {lr: 0.1, lr: 0.2}\n" + _yaml(train=None).encode(), "duplicate"),
    ("dup-sweep", (_yaml() + "sweep: {seed: [0], seed: [1]}\n").encode(), "duplicate"),
    ("bomb-top", (BOMB + _yaml()).encode(), "aliases"),
    ("bomb-sweep", (BOMB + _yaml() + "sweep: {dataset.x: *i}\n").encode(), "aliases"),
    ("bomb-value", (BOMB + _yaml(train=None) + "train: {lr: *i}\n").encode(), "aliases"),
    ("deep", ("a: " + "[" * 100_000 + "]" * 100_000 + "\n").encode(), "nested more than"),
    ("deep-map", ("a: " + "{a: " * 2000 + "}" * 2000 + "\n").encode(), "nested more than"),
    # 900 levels: libyaml 0.2.5 refuses 1,000 block levels itself, older ones parse them
    ("deep-block", "".join(" " * i + "a:\n" for i in range(900)).encode(), "a: unknown"),
    ("long-int", b"seed: 1" + b"0" * 5000 + b"\n", "digits"),
    ("merge-loop", b"a: &a {<<: *a}\n", "unknown top-level key"),
    ("self-loop", b"a: &a [*a]\n", "aliases"),
]


@pytest.mark.parametrize("name,content,needle", FILES, ids=[f[0] for f in FILES])
def test_a_malformed_file_is_one_error_line(tmp_path, capsys, name, content, needle):
    path = exp_file(tmp_path, content)
    line = run_refused(tmp_path, capsys, path, [], needle)
    assert str(path) in line


def test_a_huge_file_is_refused_before_it_is_parsed(tmp_path, capsys):
    path = exp_file(tmp_path, _yaml() + "#" * (MAX_FILE_BYTES + 1) + "\n")
    run_refused(tmp_path, capsys, path, [], "MB")


def test_a_yaml_bomb_within_the_node_bound_still_loads(tmp_path, capsys):
    """The alias bound is far above any real experiment: a sweep of 1,000 values passes."""
    assert MAX_NODES >= 100_000
    path = exp_file(tmp_path, _yaml() + f"sweep: {{seed: {list(range(1000))}}}\n")
    out = tmp_path / "out"  # 1,000 cells: refused as too many? no: let the dry check pass
    from p2pfl.app.sweep import load

    raw, grid = load(str(path), [], None)
    assert len(grid) == 1 and len(next(iter(grid.values()))) == 1000
    assert not out.exists()


INCLUDES = [  # an included file that is itself hostile names that file
    ("topology", {"topology": {"file": "inc.yaml"}}, b"kind: star\nkind: ring\n"),
    ("peers", {"peers": {"count": 4, "profile": "inc.yaml"}}, "speed: 1\n".encode("utf-16")),
    ("peers", {"peers": {"count": 4, "profile": "inc.yaml"}}, b"speed: .nan\n"),
    ("topology", {"topology": {"file": "inc.yaml"}}, BOMB.encode()),
]


@pytest.mark.parametrize("what,sections,content", INCLUDES)
def test_a_hostile_included_file_is_named(tmp_path, capsys, what, sections, content):
    (tmp_path / "inc.yaml").write_bytes(content)
    line = run_refused(tmp_path, capsys, exp_file(tmp_path, **sections), [], what)
    assert "inc.yaml" in line or f"{what}." in line


PATHS = [  # experiment "files" that are not regular files
    ("directory", lambda d: str(d), "no such experiment file"),
    ("missing", lambda d: str(d / "none.yaml"), "no such experiment file"),
    ("dev-zero", lambda d: "/dev/zero", "no such experiment file"),
    ("fifo", lambda d: (os.mkfifo(d / "f"), str(d / "f"))[1], "no such experiment file"),
]


@pytest.mark.parametrize("name,make,needle", PATHS, ids=[p[0] for p in PATHS])
def test_an_experiment_that_is_not_a_regular_file_is_refused_without_reading_it(
    tmp_path, capsys, name, make, needle
):
    out = tmp_path / "out"
    refused(capsys, ["run", make(tmp_path), "--out", str(out)], needle)
    assert not out.exists()


# --- 4. The other commands: cost, plot, keys, peer -----------------------------------------
COST = [
    (["--topologies", ","], "--topologies"),
    (["--topologies", "hypercube"], "hypercube"),
    (["--peers", "0"], "peers.count"),
    (["--peers", "-3"], "peers.count"),
    (["--peers", "100000000"], "peers.count"),
    (["--model-bytes", "-1"], "--model-bytes"),
    (["--model-bytes", "0"], "--model-bytes"),
    (["--methods", "nope"], "nope"),
    (["--methods", "fedprox:mu"], "--methods"),
    (["--methods", "fedprox:mu=.nan"], "mu"),
    (["--methods", ","], "--methods"),
    (["--set", "train.lr=.inf"], "train.lr"),
]


@pytest.mark.parametrize("argv,needle", COST, ids=[" ".join(a) for a, _ in COST])
def test_cost_refuses_bad_arguments(tmp_path, capsys, argv, needle):
    out = tmp_path / "out"
    refused(capsys, ["cost", str(exp_file(tmp_path)), "--out", str(out), *argv], needle)
    assert not out.exists()


def test_cost_refuses_an_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    refused(capsys, ["cost", str(exp_file(tmp_path)), "--out", str(tmp_path / "file")], "--out")


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real finished run (digits, 4 peers, 1 round) that each plot case spoils a copy of."""
    tmp = tmp_path_factory.mktemp("finished")
    exp = exp_file(tmp, algorithm={"name": "fedavg", "rounds": 1})
    assert main(["run", str(exp), "--out", str(tmp / "run"), "--quiet"]) == 0
    return tmp / "run"


PLOTS = [  # (file of the finished run, what it is replaced by, what the error names)
    ("summary.json", b"{nope", "summary.json"),
    ("summary.json", b"[1, 2]", "summary.json"),
    ("summary.json", b"\xff\xfe", "summary.json"),
    ("config.yaml", b"seed: 0\n", "config.yaml"),
    ("config.yaml", b"- 1\n", "config.yaml"),
    ("config.yaml", BOMB.encode(), "aliases"),
    ("config.yaml", b"seed: 0\ntopology: {kind: hypercube}\npeers: {count: 4}\n", "config.yaml"),
    ("metrics.csv", bytes(range(256)), "metrics.csv"),
    ("metrics.csv", b"a,b\n1,2,3\n", "metrics.csv"),
    ("metrics.csv", b"time,round,peer,metric,value\nx,y,z,accuracy,w\n", "metrics.csv"),
    ("metrics.csv", b"time,round,peer,metric,value\n1,2,0,accuracy\n", "metrics.csv"),
    ("comm.csv", b"time,round,src,dst,kind,bytes,arrival\n0,1,server,0,model,-x,1\n", "comm.csv"),
    ("comm.csv", b"time,round,src,dst,kind,bytes,arrival\n0,1,mars,0,model,5,1\n", "unknown"),
    ("comm.csv", b"\x00\x00", "comm.csv"),
    ("availability.csv", b"peer,online_from,online_to\nzero,0,1\n", "availability.csv"),
]


@pytest.mark.parametrize(
    "name,content,needle", PLOTS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(PLOTS)]
)
def test_plot_refuses_a_spoilt_run_directory(tmp_path, capsys, finished, name, content, needle):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / name).write_bytes(content)
    out = tmp_path / "plots"
    refused(capsys, ["plot", str(run), "--out", str(out)], needle)
    assert not out.exists()


SWEEPS = [  # cells.csv of a sweep directory
    (b"\xff\xfe garbage", "cells.csv"),
    (b"a,b\n1,2\n", "cells.csv"),
    (b"seed,cell,status\n0,../../etc,ok\n", "not a cell"),
    (b"seed,cell,status\n0,missing,ok\n", "missing"),
    (b"seed,cell,status\n0,x,failed\n", "no finished runs"),
]


@pytest.mark.parametrize("content,needle", SWEEPS, ids=[n for _, n in SWEEPS])
def test_plot_refuses_a_spoilt_sweep_directory(tmp_path, capsys, content, needle):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "cells.csv").write_bytes(content)
    refused(capsys, ["plot", str(tmp_path / "sweep"), "--out", str(tmp_path / "plots")], needle)
    assert not (tmp_path / "plots").exists()


def test_plot_still_draws_the_unspoilt_run(tmp_path, capsys, finished):
    assert main(["plot", str(finished), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "accuracy.png").is_file()


def test_plot_refuses_an_out_that_is_a_file(tmp_path, capsys, finished):
    (tmp_path / "file").write_text("x")
    refused(capsys, ["plot", str(finished), "--out", str(tmp_path / "file")], "--out")


def test_plot_refuses_a_missing_run(tmp_path, capsys):
    refused(capsys, ["plot", str(tmp_path / "none")], "none")


KEYS = [
    (["--peers", "-1"], "--peers"),
    (["--peers", "0"], "--peers"),
    (["--peers", "1000000000"], "--peers"),
    (["--peers", "x"], "--peers"),
]


@pytest.mark.parametrize("argv,needle", KEYS, ids=[" ".join(a) for a, _ in KEYS])
def test_keys_refuses_bad_counts(tmp_path, capsys, argv, needle):
    refused(capsys, ["keys", str(tmp_path / "k"), *argv], needle)
    assert not (tmp_path / "k").exists()


def test_keys_refuses_a_directory_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    refused(capsys, ["keys", str(tmp_path / "file"), "--peers", "2"], "file")


PEER = [
    (["--peer", "99"], "--peer"),
    (["--peer", "-1"], "--peer"),
    (["--peer", "chief"], "--peer"),
    (["--peer", "0-99"], "--peer"),
    (["--peer", "3-1"], "empty range"),
    (["--peer", "0,1,0"], "named twice"),
    (["--peer", "0-2,1"], "named twice"),
    (["--peer", "0,,1"], "--peer"),
    (["--peer", "0", "--addresses", "none.yaml"], "addresses"),
]


@pytest.mark.parametrize("argv,needle", PEER, ids=[" ".join(a) for a, _ in PEER])
def test_peer_refuses_bad_arguments(tmp_path, capsys, argv, needle):
    if "--addresses" not in argv:
        argv = [*argv, "--addresses", str(tmp_path / "none.yaml")]
    out = tmp_path / "out"
    refused(capsys, ["peer", str(exp_file(tmp_path)), "--out", str(out), *argv], needle)
    assert not out.exists()


ADDRESSES = [
    ("not-mapping", b"- tcp://127.0.0.1:1\n", "mapping"),
    ("dup", b"0: tcp://127.0.0.1:1\n0: tcp://127.0.0.1:2\n", "duplicate"),
    ("bad-url", b"0: http://x\n1: tcp://127.0.0.1:2\n", "tcp://HOST:PORT"),
    ("bomb", BOMB.encode(), "aliases"),
]


@pytest.mark.parametrize("name,content,needle", ADDRESSES, ids=[a[0] for a in ADDRESSES])
def test_peer_refuses_a_hostile_address_file(tmp_path, capsys, name, content, needle):
    (tmp_path / "addr.yaml").write_bytes(content)
    out = tmp_path / "out"
    argv = [
        "peer",
        str(
            exp_file(
                tmp_path, topology={"kind": "ring"}, algorithm={"name": "dfedavgm", "rounds": 1}
            )
        ),
    ]
    refused(
        capsys,
        [*argv, "--peer", "0", "--addresses", str(tmp_path / "addr.yaml"), "--out", str(out)],
        needle,
    )
    assert not out.exists()


# --- 5. Output directories of yours: --force empties only what p2pfl wrote -----------------
YOURS = [  # (where a real run is copied into the directory, or None; files of yours in it)
    (None, {"config.yaml": "db: postgres\n", "notes.txt": "mine", "src/app.py": "x = 1\n"}),
    (None, {"config.yaml": "db: postgres\n"}),
    (None, {"metrics.csv": "a,b\n1,2\n", "notes.txt": "mine"}),
    (None, {"cells.csv": "cell,status\n", "plots/a.txt": "mine"}),
    (".", {"notes.txt": "mine"}),
    (".", {"src/app.py": "x = 1\n"}),
    ("seed=0", {"notes.txt": "mine"}),
    ("seed=0", {"seed=0/notes.txt": "mine"}),
]


def tree(path: Path) -> dict[str, bytes | None]:
    """Every file's bytes (a directory: None) under ``path``, by relative path."""
    return {
        str(p.relative_to(path)): None if p.is_dir() else p.read_bytes() for p in path.rglob("*")
    }


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
@pytest.mark.parametrize(
    ("run", "files"),
    YOURS,
    ids=["config", "lone-config", "metrics", "cells", "run-notes", "run-src", "cell", "in-cell"],
)
def test_force_never_empties_a_directory_of_yours(tmp_path, capsys, finished, run, files, sweep):
    out = tmp_path / "yours"
    out.mkdir()
    if run is not None:
        shutil.copytree(finished, out / run, dirs_exist_ok=True)
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    before = tree(out)
    exp = exp_file(tmp_path, sweep={"seed": [0]} if sweep else None)
    argv = ["run", str(exp), "--out", str(out), "--quiet", "--force"]
    line = refused(capsys, argv, "holds no p2pfl run")
    assert str(out) in line
    assert tree(out) == before


def test_force_replaces_a_run_with_what_p2pfl_added_to_it(tmp_path, capsys, finished):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    assert main(["plot", str(out)]) == 0  # plots/, as p2pfl plot draws by default
    (out / "summary.json.tmp").write_text("{")  # a run killed while it wrote summary.json
    for name in ("pool_distances.csv", "pool_distances.png"):  # FedELMY's artifact
        (out / name).write_text("")
    assert main(["run", str(exp_file(tmp_path)), "--out", str(out), "--quiet", "--force"]) == 0
    assert not (out / "plots").exists() and not (out / "summary.json.tmp").exists()
    assert not (out / "pool_distances.csv").exists()
    assert yaml.safe_load((out / "config.yaml").read_text())["algorithm"]["rounds"] == 2


# --- keys that are not strings, and --set values that are not UTF-8 -------------------------
@pytest.mark.parametrize(
    ("text", "argv", "needle"),
    [
        ("1: 2\n", [], ": 1: unknown top-level key"),
        ("", ["--set", "partition={name: iid, 1: 2, x: 3}"], "partition.1: unknown key"),
        ("", ["--set", "name=\udcff\udcfe"], "--set: is not valid UTF-8"),
    ],
    ids=["top-level", "partition", "non-utf8"],
)
def test_an_odd_key_or_undecodable_set_is_one_error_line(tmp_path, capsys, text, argv, needle):
    path = exp_file(tmp_path, yaml.safe_dump(BASE) + text)
    run_refused(tmp_path, capsys, path, argv, needle)
