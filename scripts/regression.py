#!/usr/bin/env python
"""Regression check: rerun a fixed list of experiments and compare their outputs, byte for byte.

The list: every experiment file under ``experiments/`` (the quick-start among them; a file
with a ``sweep:`` section runs as the sweep it is, through ``p2pfl run``) and
``scripts/regression-network-adversary.yaml`` (a ``network:`` + ``adversary:`` run: FedAvg
with a deadline and a robust aggregator, churn, a crash, lossy links, sign-flipping
attackers). Each run's outputs are fingerprinted by SHA-256: ``metrics.csv``, ``comm.csv``,
``partition.csv``, ``availability.csv`` and every other ``.csv`` a run writes (``peers.csv``,
a method's artifacts), and ``summary.json`` without its wall-clock keys (``WALL_CLOCK_KEYS``);
a sweep's ``cells.csv`` without its ``wall_time_s`` column, its ``sweep.csv``, and each
cell's files as above (``CELL/metrics.csv``, ...). ``config.yaml`` is the input, not an
output, and figures are not compared. The exit status of every run is compared too.

Usage (from the repository root, with the project's venv)::

    .venv/bin/python scripts/regression.py record FILE [--quick]   # fingerprints of this tree
    .venv/bin/python scripts/regression.py check FILE              # rerun, compare with FILE
    .venv/bin/python scripts/regression.py --base REV [--quick]    # REV against this tree

- ``record FILE`` writes a JSON of fingerprints (rewritten as each run ends), with the mode,
  the revision and what the numbers depend on (torch, its CPU kernels).
- ``check FILE`` reruns what FILE holds, in its mode, and prints a table run / file /
  ``same`` or ``DIFFERENT``; exit 1 on any difference (a file, an exit status, a run missing).
- ``--base REV`` checks REV out into a temporary ``git worktree``, runs both REV and this
  working tree (uncommitted changes included) with the same venv and the same inputs (the
  experiment files of this tree), compares them as ``check`` does, and removes the worktree.
  Each side's code is imported from its own tree (``PYTHONPATH``, and ``python -m p2pfl``
  from a directory that holds no package), checked before anything runs.
- ``--only REGEX`` selects the runs whose name (the file's stem: ``quickstart``,
  ``sweep-digits``, ``regression-network-adversary``) it matches (``re.search``);
  ``--jobs N`` runs N commands at a time (default 1); ``--work DIR`` keeps the runs' outputs
  (default ``runs/regression``: ``current/``, ``base/``, their fingerprints ``current.json``
  and ``base.json``, written as each run ends, and the table ``report.txt``).
- ``--quick`` shortens every run (``quick_sets``): at most 2 rounds (methods with ``rounds``),
  1 cycle (``cycles``: FedSeq, FedELMY), 1 local epoch and 1 warm-up epoch, FedFisher's
  server optimisation 100 steps, matching 2 epochs, Fashion-MNIST cut to 3,000 training and
  500 test samples (a fixed ``partition.samples_per_peer`` shrunk to fit them, and a
  population that would outnumber them cut to 1,000 peers, unless its peers draw their
  samples with ``replace``); a sweep
  keeps its first seed and, of every other key, its last value (the shipped sweeps end on
  their hardest setting: the most attackers, churn or loss), or all its values on digits.
  Without it, every experiment runs as shipped, full grids included.

Every run gets ``OMP_NUM_THREADS=1``: outputs are bit-identical only for the same threads per
process and the same CPU kernels, so a recorded file is compared on the machine it was made.

Measured on the 2-core development machine (2026-11-26, 45-48 runs), shared with other jobs:
``--quick`` took 3 min 14 s at load 1-2 (2 min 53 s of CPU), 1 min 42 s with ``--jobs 2``,
and 7 min 35 s at load 6-10; ``--base HEAD --quick --jobs 2`` (twice the runs) 11 min 23 s
at load 9. The full mode took 1 h 48 min with ``--jobs 1`` while the load fell from 9 to 2
(72 min of CPU; the sweeps weigh most: the six adversary sweeps 32 min, fedinit-cnn 9 min,
the three fedfisher-fmnist runs 16 min).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
EXTRA = ("scripts/regression-network-adversary.yaml",)
"""Runs besides ``experiments/*.yaml`` (paths from the repository root)."""

WALL_CLOCK_KEYS = frozenset({"wall_time_s", "compute_wall_s", "startup_wall_s", "start_spread_s"})
"""``summary.json`` keys that measure wall-clock time (left out wherever they occur): the
run's wall time, the time spent training (``compute_wall_s``: the trainer's busy time), and a
real run's start-up and start spread. Every other key is simulated or counted."""
WALL_CLOCK_COLUMNS = {"cells.csv": ("wall_time_s",)}
"""Columns of CSV files that measure wall-clock time (a sweep's cells' wall times)."""

QUICK_ROUNDS = 2
QUICK_CYCLES = 1
QUICK_EPOCHS = 1
QUICK_STEPS = 100  # FedFisher's server optimisation (default 2000)
QUICK_MATCHING_EPOCHS = 2
QUICK_SUBSET = 3000  # training samples of a dataset bigger than this (not digits: 1,797)
QUICK_TEST_SUBSET = 500
QUICK_PEERS = 1000  # a population whose peers split the data would outnumber the subset
SMALL_DATASETS = frozenset({"digits"})
"""Datasets small enough to run whole in ``--quick``."""

FORMAT = 1
"""Version of the fingerprint file's layout."""
MARKER = ".p2pfl-regression"
"""The file that says a ``--work`` directory is this script's to empty."""
ALL_SAME_ROWS = 8
"""A run with more files than this, all the same, is one row of the table."""


@dataclass(frozen=True)
class Experiment:
    """One entry of the fixed list: its name, its file (in this tree), whether a sweep."""

    name: str
    path: Path
    raw: dict[str, Any]

    @property
    def sweep(self) -> bool:
        return "sweep" in self.raw


@dataclass
class Outcome:
    """One run on one side: its exit status, its fingerprints, its last error line."""

    exit: int
    files: dict[str, str]
    seconds: float
    error: str = ""

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"exit": self.exit, "seconds": round(self.seconds, 1)}
        if self.error:
            out["error"] = self.error
        return out | {"files": self.files}


def experiments(root: Path = ROOT) -> list[Experiment]:
    """The fixed list, in order: ``experiments/*.yaml`` sorted, then ``EXTRA``."""
    paths = sorted((root / "experiments").glob("*.yaml"), key=lambda p: p.stem)
    paths += [root / p for p in EXTRA]
    out = []
    for path in paths:
        raw = yaml.safe_load(path.read_text())
        out.append(Experiment(path.stem, path, raw))
    return out


# --- --quick --------------------------------------------------------------------------------


def method_keys(name: str) -> dict[str, Any]:
    """The ``algorithm:`` keys of method ``name`` and their defaults (this tree's registry)."""
    sys.path.insert(0, str(ROOT))
    try:
        from p2pfl.methods import METHODS
    finally:
        sys.path.remove(str(ROOT))
    cls: Any = METHODS.get(name)
    return {
        f.name: (f.default if f.default is not dataclasses.MISSING else None)
        for f in dataclasses.fields(cls)
        if f.init
    }


def quick_algorithm(algorithm: dict[str, Any]) -> dict[str, Any]:
    """The keys ``--quick`` changes in an ``algorithm:`` mapping (only those it lowers)."""
    keys = method_keys(algorithm["name"])
    limits = {
        "rounds": QUICK_ROUNDS,
        "cycles": QUICK_CYCLES,
        "warmup_epochs": QUICK_EPOCHS,
        "steps": QUICK_STEPS,
    }
    out = {}
    for key, limit in limits.items():
        if key not in keys:
            continue
        now = algorithm.get(key, keys[key])
        if isinstance(now, int) and now > limit:
            out[key] = limit
    if "steps" in out and "val_every" in keys:  # FedFisher: an iterate every val_every steps
        out["val_every"] = min(algorithm.get("val_every", keys["val_every"]), QUICK_STEPS // 2)
    return out


def quick_sets(raw: dict[str, Any]) -> list[str]:
    """The ``--set`` options that make one experiment (or sweep) short."""
    sets: dict[str, Any] = {}
    algorithm = raw.get("algorithm", {})
    for key, value in quick_algorithm(algorithm).items():
        sets[f"algorithm.{key}"] = value
    train = raw.get("train") or {}
    if isinstance(train.get("epochs"), int) and train["epochs"] > QUICK_EPOCHS:
        sets["train.epochs"] = QUICK_EPOCHS
    dataset = raw.get("dataset") or {}
    if dataset.get("name") not in SMALL_DATASETS:
        for key, limit in (("subset", QUICK_SUBSET), ("test_subset", QUICK_TEST_SUBSET)):
            if dataset.get(key) is None or dataset[key] > limit:
                sets[f"dataset.{key}"] = limit
        partition = raw.get("partition") or {}
        count = (raw.get("peers") or {}).get("count")
        fits = QUICK_SUBSET // count if isinstance(count, int) and count > 0 else 0
        share = partition.get("samples_per_peer")  # the domain partition's fixed share
        if fits and isinstance(share, int) and share > fits:
            sets["partition.samples_per_peer"] = fits
        if isinstance(count, int) and count > QUICK_SUBSET and not partition.get("replace"):
            sets["peers.count"] = QUICK_PEERS  # each peer still gets samples of its own
    matching = (raw.get("eval") or {}).get("matching")
    if isinstance(matching, dict) and matching.get("epochs", 20) > QUICK_MATCHING_EPOCHS:
        sets["eval.matching.epochs"] = QUICK_MATCHING_EPOCHS
    if "sweep" in raw:
        sets["sweep"] = quick_grid(raw["sweep"], dataset.get("name") in SMALL_DATASETS)
    return [f"{k}={json.dumps(v)}" for k, v in sets.items()]


def quick_grid(grid: dict[str, list[Any]], small: bool) -> dict[str, list[Any]]:
    """A sweep's grid cut down: its first seed, and of every other key its last value (the
    shipped sweeps end on their hardest setting: the most attackers, churn or loss) or, on a
    ``small`` dataset, all its values; each swept ``algorithm`` shortened like the base's."""
    out = {}
    for key, values in grid.items():
        kept = values[:1] if key == "seed" else values if small else values[-1:]
        if key == "algorithm":
            kept = [
                (v := {"name": a} if isinstance(a, str) else dict(a)) | quick_algorithm(v)
                for a in kept
            ]
        out[key] = kept
    return out


# --- running and fingerprinting ---------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """A tree whose code runs: this working tree, or REV's worktree."""

    label: str  # "current" or "base"
    tree: Path
    work: Path  # where its runs write, one directory per experiment

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        env["OMP_NUM_THREADS"] = "1"
        env["MKL_NUM_THREADS"] = "1"
        return env

    def check_import(self) -> None:
        """Raise SystemExit (2) unless ``python -m p2pfl`` here imports this tree's code."""
        probe = subprocess.run(
            [sys.executable, "-c", "import p2pfl; print(p2pfl.__file__)"],
            cwd=self.work, env=self.env(), capture_output=True, text=True,
        )  # fmt: skip
        where = Path(probe.stdout.strip() or "?").resolve()
        if probe.returncode != 0 or not where.is_relative_to(self.tree.resolve()):
            fail(f"{self.label}: p2pfl is imported from {where}, not from {self.tree}")

    def run(self, ex: Experiment, sets: list[str]) -> Outcome:
        out = self.work / ex.name
        if out.exists():
            shutil.rmtree(out)
        command = [sys.executable, "-m", "p2pfl", "run", str(ex.path), "--out", str(out)]
        command += ["--quiet"] + [f"--set={s}" for s in sets]
        start = time.perf_counter()
        done = subprocess.run(
            command, cwd=self.work, env=self.env(), capture_output=True, text=True,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        (self.work / f"{ex.name}.log").write_text(done.stdout + done.stderr)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        files = fingerprint(out) if out.is_dir() else {}
        return Outcome(done.returncode, files, seconds, errors[-1] if errors else "")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def without_wall_clock(value: Any) -> Any:
    """``value`` (parsed JSON) without the ``WALL_CLOCK_KEYS``, at any depth, order kept."""
    if isinstance(value, dict):
        return {k: without_wall_clock(v) for k, v in value.items() if k not in WALL_CLOCK_KEYS}
    if isinstance(value, list):
        return [without_wall_clock(v) for v in value]
    return value


def summary_digest(path: Path, out: Path) -> str:
    """``summary.json`` without wall-clock keys, re-dumped in its own key order; the run
    directory's path (in a failed run's reason) stands as ``<out>``."""
    text = path.read_text().replace(str(out), "<out>")
    summary = without_wall_clock(json.loads(text))
    return sha256(json.dumps(summary, indent=1, allow_nan=True).encode())


def csv_digest(path: Path) -> str:
    """A CSV file's bytes, or its rows without the ``WALL_CLOCK_COLUMNS`` of its name."""
    data = path.read_bytes()
    drop = WALL_CLOCK_COLUMNS.get(path.name)
    if not drop:
        return sha256(data)
    rows = list(csv.reader(io.StringIO(data.decode())))
    keep = [i for i, name in enumerate(rows[0] if rows else []) if name not in drop]
    return sha256("\n".join(",".join(row[i] for i in keep) for row in rows).encode())


def run_files(run: Path, out: Path, prefix: str = "") -> dict[str, str]:
    """The fingerprints of one run directory: every ``.csv`` and ``summary.json``."""
    files = {}
    for path in sorted(run.iterdir()):
        if not path.is_file():
            continue
        if path.name == "summary.json":
            files[prefix + path.name] = summary_digest(path, out)
        elif path.suffix == ".csv":
            files[prefix + path.name] = csv_digest(path)
    return files


def fingerprint(out: Path) -> dict[str, str]:
    """A run's fingerprints, or a sweep's: its tables and each cell's (``CELL/FILE``)."""
    files = run_files(out, out)
    if (out / "cells.csv").is_file():
        for cell in sorted(p for p in out.iterdir() if p.is_dir() and p.name != "plots"):
            files |= run_files(cell, out, f"{cell.name}/")
    return files


# --- comparing --------------------------------------------------------------------------------


def compare(
    names: list[str], new: dict[str, dict[str, Any]], old: dict[str, dict[str, Any]], what: str
) -> tuple[list[tuple[str, str, str]], int]:
    """Rows run / file / verdict of ``new`` against ``old`` (``what`` names ``old``), and
    how many rows say DIFFERENT."""
    rows: list[tuple[str, str, str]] = []
    for name in names:
        if name not in old or name not in new:
            where = what if name not in old else "this tree"
            rows.append((name, "-", f"DIFFERENT: missing in {where}"))
            continue
        a, b = old[name]["files"], new[name]["files"]
        mine: list[tuple[str, str, str]] = []
        if old[name]["exit"] != new[name]["exit"]:
            change = f"{old[name]['exit']} -> {new[name]['exit']}"
            mine.append((name, "(exit status)", f"DIFFERENT: {change}"))
        for file in sorted(set(a) | set(b)):
            if file not in a:
                mine.append((name, file, f"DIFFERENT: missing in {what}"))
            elif file not in b:
                mine.append((name, file, "DIFFERENT: missing in this tree"))
            elif a[file] != b[file]:
                mine.append((name, file, "DIFFERENT"))
        same = [f for f in sorted(b) if f in a and a[f] == b[f]]
        if not a and not b and not mine:
            mine.append((name, "(no outputs)", f"same (exit {new[name]['exit']})"))
        elif len(same) > ALL_SAME_ROWS:
            mine.append((name, f"(the other {len(same)} files)", "same"))
        else:
            mine += [(name, f, "same") for f in same]
        rows += mine
    return rows, sum(r[2].startswith("DIFFERENT") for r in rows)


def format_rows(rows: list[tuple[str, str, str]]) -> str:
    head = ("run", "file", "result")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    ]
    return "\n".join(lines)


# --- the command ------------------------------------------------------------------------------


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def git(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        fail(f"git {' '.join(args)}: {said[-1] if said else f'exit {done.returncode}'}")
    return done.stdout.strip()


def environment() -> dict[str, Any]:
    """What the fingerprints depend on besides the code."""
    import platform

    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "omp_num_threads": 1,
        "machine": platform.machine(),
    }


def revision(tree: Path) -> str:
    head = git("rev-parse", "HEAD", cwd=tree)
    dirty = git("status", "--porcelain", "--untracked-files=no", cwd=tree)
    return head + ("+uncommitted" if dirty else "")


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def prepare_work(work: Path, sides: list[str]) -> None:
    """``work`` made ready: new or this script's (``MARKER``); the sides' old runs removed."""
    if work.exists() and any(work.iterdir()) and not (work / MARKER).exists():
        fail(f"--work {work}: holds files that are not this script's; choose another directory")
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).touch()
    for side in sides:
        if (work / side).exists():
            shutil.rmtree(work / side)
        (work / side).mkdir()


def run_all(
    chosen: list[Experiment], sides: list[Side], quick: bool, jobs: int,
    done: Callable[[Side, Experiment, Outcome], None],
) -> None:  # fmt: skip
    """Run every experiment on every side, ``jobs`` at a time, calling ``done`` as each ends."""
    tasks = [(side, ex) for ex in chosen for side in sides]
    sets = {ex.name: quick_sets(ex.raw) if quick else [] for ex in chosen}
    lock = threading.Lock()
    bar = tqdm(total=len(tasks), unit="run", dynamic_ncols=True, file=sys.stderr)

    def one(side: Side, ex: Experiment) -> None:
        outcome = side.run(ex, sets[ex.name])
        with lock:
            done(side, ex, outcome)
            bar.set_postfix_str(f"{side.label} {ex.name}: exit {outcome.exit}", refresh=False)
            bar.update()

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [pool.submit(one, side, ex) for side, ex in tasks]
        for future in concurrent.futures.as_completed(futures):
            future.result()
    finally:  # Ctrl-C: the running commands got it too; none of the others starts
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/regression.py",
        description="Rerun the fixed list of experiments and compare their outputs' fingerprints.",
    )
    p.add_argument("action", nargs="?", choices=["record", "check"], help="record or check FILE")
    p.add_argument("file", nargs="?", type=Path, help="the fingerprint file (JSON)")
    p.add_argument("--base", metavar="REV", help="compare REV (a git worktree) with this tree")
    p.add_argument("--only", metavar="REGEX", help="runs whose name matches (re.search)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="commands at a time (1)")
    p.add_argument("--quick", action="store_true", help="short runs (see the docstring)")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "regression", metavar="DIR")
    args = p.parse_args(argv)
    if args.base is not None and args.action is not None:
        p.error("--base compares REV with this tree: give no record/check")
    if args.base is None and (args.action is None or args.file is None):
        p.error("give record FILE, check FILE, or --base REV")
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    everything = experiments()
    reference: dict[str, Any] | None = None
    if args.action == "check":
        try:
            reference = json.loads(args.file.read_text())
        except (OSError, ValueError) as e:
            fail(f"{args.file}: cannot read it: {e}")
        assert reference is not None
        if reference.get("format") != FORMAT or not isinstance(reference.get("runs"), dict):
            fail(f"{args.file}: not a fingerprint file of this script (format {FORMAT})")
        if args.quick and reference["mode"] != "quick":
            fail(f"{args.file}: recorded in {reference['mode']} mode, not --quick")
        args.quick = reference["mode"] == "quick"
    try:
        pattern = re.compile(args.only or "")
    except re.error as e:
        fail(f"--only {args.only!r}: not a regular expression: {e}")
    names = [ex.name for ex in everything]
    if reference is not None:  # the file says what to check
        names = list(reference["runs"])
    names = [n for n in names if pattern.search(n)]
    if not names:
        listed = ", ".join(e.name for e in everything)
        fail(f"--only {args.only!r} matches no run; the runs: {listed}")
    chosen = [ex for ex in everything if ex.name in names]
    mode = "quick" if args.quick else "full"
    env = environment()
    if reference is not None and reference.get("environment") != env:
        print(
            f"warning: {args.file} was recorded with {reference.get('environment')}, "
            f"this is {env}: bits may differ for that alone",
            file=sys.stderr,
        )
    labels = ["current"] + (["base"] if args.base else [])
    work = args.work.resolve()
    prepare_work(work, labels)
    current = Side("current", ROOT, work / "current")
    sides = [current]
    worktree: Path | None = None
    holder: Path | None = None
    started = time.perf_counter()
    try:
        if args.base is not None:
            rev = git("rev-parse", "--verify", f"{args.base}^{{commit}}")
            holder = Path(tempfile.mkdtemp(prefix="p2pfl-regression-"))
            worktree = holder / "tree"
            git("worktree", "add", "--detach", "--quiet", str(worktree), rev)
            sides.append(Side("base", worktree, work / "base"))
        for side in sides:
            side.check_import()
        results: dict[str, dict[str, Any]] = {}
        for side in sides:
            results[side.label] = {
                "format": FORMAT, "mode": mode, "revision": revision(side.tree),
                "environment": env, "runs": {},
            }  # fmt: skip
        outputs = {
            side.label: (args.file if args.action == "record" else work / f"{side.label}.json")
            for side in sides
        }

        def done(side: Side, ex: Experiment, outcome: Outcome) -> None:
            results[side.label]["runs"][ex.name] = outcome.as_json()
            write_json(outputs[side.label], results[side.label])

        for label, path in outputs.items():
            write_json(path, results[label])
        run_all(chosen, sides, args.quick, args.jobs, done)
    finally:
        if worktree is not None:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(worktree)],
                cwd=ROOT,
                capture_output=True,
            )
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)
        if holder is not None:
            shutil.rmtree(holder, ignore_errors=True)
    elapsed = time.perf_counter() - started
    now = results["current"]["runs"]
    failed = [f"{n} (exit {r['exit']}: {r.get('error', '')})" for n, r in now.items() if r["exit"]]
    if failed:
        print(f"note: {len(failed)} run(s) did not exit 0: {'; '.join(failed)}", file=sys.stderr)
    if args.action == "record":
        print(f"recorded {len(names)} runs ({mode}) in {args.file}, {elapsed:.0f} s")
        return 0
    if reference is not None:
        old, what = reference["runs"], str(args.file)
    else:
        old, what = results["base"]["runs"], f"base {args.base}"
    rows, differ = compare(names, now, old, what)
    report = format_rows(rows)
    verdict = (
        f"{differ} difference(s) against {what}" if differ
        else f"all {len(names)} runs the same as {what}"
    ) + f" ({mode}, {elapsed:.0f} s)"  # fmt: skip
    (work / "report.txt").write_text(report + "\n" + verdict + "\n")
    print(report)
    print(verdict)
    return 1 if differ else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
