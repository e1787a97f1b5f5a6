"""The documentation site: it builds with no warnings (every internal link and anchor
checked), its YAML reference is generated from the code and describes every key of every
registered component, its tutorials' commands run as shown, and no page cites an issue or
tells a figure's day-by-day history."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from p2pfl.app import reference
from p2pfl.app.cli import parser
from p2pfl.core.options import parameters

DOCS = ROOT / "docs"
VENV_BIN = Path(sys.executable).parent
PAGES = sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)
TUTORIALS = sorted((DOCS / "tutorials").glob("*.md"))


# --- the YAML reference -----------------------------------------------------------------


def test_every_key_of_every_registered_component_has_a_description():
    """A key or component added without a description fails here, naming it and where its
    description belongs (its docstring: reference.py's module docstring says how)."""
    assert reference.missing_descriptions() == []


def registries():
    from p2pfl.data.datasets import DATASETS
    from p2pfl.data.partition import PARTITIONERS
    from p2pfl.learning.models import MODELS
    from p2pfl.learning.robust import AGGREGATORS
    from p2pfl.methods import METHODS
    from p2pfl.methods.attacks.base import ATTACKS
    from p2pfl.network.codecs import CODECS
    from p2pfl.network.topology import GRAPHS

    return [
        ("dataset", "name", DATASETS, 0),
        ("partition", "name", PARTITIONERS, 3),
        ("model", "name", MODELS, 2),
        ("topology", "kind", GRAPHS, 2),
        ("algorithm", "name", METHODS, 0),
        ("algorithm.aggregator", "name", AGGREGATORS, 0),
        ("compression.KIND", "codec", CODECS, 0),
        ("adversary.attack", "name", ATTACKS, 0),
    ]


def test_the_reference_lists_every_registered_component_with_its_signature_keys():
    tables = {t.title: t for t in reference.yaml_tables()}
    for section, key, registry, skip in registries():
        assert registry.names(), section
        for name, fn in registry:
            table = tables[f"`{section}: {{{key}: {name}}}`"]
            assert [k.name for k in table.keys] == list(parameters(fn, skip)), (section, name)


def test_types_and_defaults_come_from_the_code():
    tables = {t.title: t for t in reference.yaml_tables()}
    train = {k.name: k for k in tables["`train`"].keys}
    assert (train["lr"].type, train["lr"].default) == ("number", "`0.05`")
    assert train["optimizer"].type == "'sgd' | 'adam' | 'sam'"
    fedavg = {k.name: k for k in tables["`algorithm: {name: fedavg}`"].keys}
    assert fedavg["rounds"].default == "`20`"  # inherited from Rounds, described there
    assert fedavg["rounds"].meaning.startswith("how many rounds")
    peers = {k.name: k for k in tables["`peers`"].keys}
    assert peers["count"].default == "required" and peers["profile"].meaning
    mlp = {k.name: k for k in tables["`model: {name: mlp}`"].keys}
    assert mlp["hidden"].default == "`[200]`"
    top = [k.name for k in reference.yaml_tables()[0].keys]
    from p2pfl.app.config import SECTIONS

    assert top == [*SECTIONS, "sweep"]


def test_a_plugin_component_shows_up_with_its_docstring(monkeypatch):
    """What a plug-in registers is in the reference, described by its ``Args:`` section,
    its fields' docstrings or their comments; one left undescribed is reported."""
    from p2pfl.methods import METHODS
    from p2pfl.methods.base import Rounds

    @dataclasses.dataclass(kw_only=True, eq=False)
    class Probe(Rounds):
        """A probe method.

        Args:
            gain: how much each step moves.
        """

        gain: float = 0.5
        width: int = 3  # the probe's width
        depth: int = 2
        """the probe's depth"""
        silent: bool = False

    monkeypatch.setitem(METHODS._items, "doc_probe", Probe)
    table = next(t for t in reference.yaml_tables() if t.title == "`algorithm: {name: doc_probe}`")
    meanings = {k.name: k.meaning for k in table.keys}
    assert meanings == {
        "rounds": meanings["rounds"],
        "gain": "how much each step moves.",
        "width": "the probe's width",
        "depth": "the probe's depth",
        "silent": "",
    }
    assert any(m.startswith("algorithm.silent (") for m in reference.missing_descriptions())
    assert "| `gain` | number | `0.5` | how much each step moves. |" in reference.yaml_reference()


def test_docstring_keys_reads_bullets_and_args_sections():
    doc = """Summary.

    - ``a``: the first key,
      continued.
    - ``b`` / ``c``: shared.

    Args:
        d (int): the fourth,
            continued.
        e: the fifth.
    """
    assert reference.docstring_keys(doc) == {
        "a": "the first key, continued.",
        "b": "shared.",
        "c": "shared.",
        "d": "the fourth, continued.",
        "e": "the fifth.",
    }


def test_the_cli_reference_lists_every_command_and_option():
    text = reference.cli_reference()
    for name, sub in reference._subparsers(parser()).items():
        assert f"## `p2pfl {name}`" in text
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in text or f", {option}" in text, (name, option)


# --- the site ---------------------------------------------------------------------------


def test_the_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: every warning (a broken link or anchor, a page left out of
    the navigation, a bad docstring reference) fails the build."""
    start = time.monotonic()
    out = subprocess.run(
        [str(VENV_BIN / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert time.monotonic() - start < 120
    yaml_page = (tmp_path / "site" / "reference" / "yaml.html").read_text()
    assert "fedavg" in yaml_page and "participation" in yaml_page
    assert (tmp_path / "site" / "reference" / "cli.html").is_file()
    assert "p2pfl.app.library.run" in (tmp_path / "site" / "reference" / "python.html").read_text()


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        assert str(page.relative_to(DOCS)) in nav, page


ISSUE = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w/#(\[])#\d+\b")
HISTORY = re.compile(
    r"later that day|that evening|earlier that day|(faster|slower|busier|loaded) day"
    r"|a later call|the day before|(first|second|third|fourth|fifth) lease\b"
)


def test_no_page_cites_an_issue_or_a_figures_history():
    """Pages state what is, with a figure's command and date; how figures moved is in
    CHANGELOG.md. No issue numbers either: a reader does not have the tracker."""
    found = []
    for path in [ROOT / "README.md", *PAGES]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in (ISSUE, HISTORY):
                m = pattern.search(line)
                if m:
                    found.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
            dates = set(re.findall(r"20\d\d-\d\d-\d\d", line))
            if len(dates) > 1:  # one figure told at two dates: a history
                found.append(f"{path.relative_to(ROOT)}:{n}: dates {sorted(dates)}")
    assert found == []


def test_the_history_checks_catch_what_they_are_for():
    assert ISSUE.search("as issue 39 asked") and ISSUE.search("fixed in #35")
    assert not ISSUE.search("[dynamics](dynamics.md#4-push-sum)")
    assert HISTORY.search("8.4x, then later that day 9.6x")
    assert not HISTORY.search("CPU, 2026-11-26, load average 1")


# --- commands shown in the pages run as shown -------------------------------------------

FENCE = re.compile(r"```console\n(.*?)```", re.S)
PYTHON = re.compile(r"```python\n(.*?)```\n+```text\n(.*?)```", re.S)


def console_steps(page: Path) -> list[tuple[str, list[str]]]:
    """Each ``$ command`` of a page's console blocks, with the output lines shown under it."""
    steps: list[tuple[str, list[str]]] = []
    for block in FENCE.findall(page.read_text()):
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            elif steps and line.strip():
                steps[-1][1].append(line)
    return steps


def skeleton(line: str) -> str:
    """A line with its numbers blanked and its spacing collapsed: timings and the last
    digits of accuracies differ between machines, the words and columns do not."""
    return " ".join(re.sub(r"\d[\d.,]*", "#", line).split())


def workspace(tmp_path: Path) -> Path:
    """A directory laid out like the repository's root (what the pages' commands read),
    with the pages' outputs (runs/) going to the test's own folder."""
    for name in ("experiments", "topologies", "peers", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def environment(cwd: Path) -> dict[str, str]:
    """The pages' commands' environment in the workspace ``cwd``: what they leave in a
    temporary directory (``p2pfl.run`` without ``out=``) goes to ``cwd/tmp``."""
    (cwd / "tmp").mkdir(exist_ok=True)
    return os.environ | {
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "TMPDIR": str(cwd / "tmp"),
    }


def run_page(page: Path, cwd: Path) -> None:
    """Run a page's commands in order, each as shown; a command ending in ``&`` runs in the
    background until the page's last command has run. Every output line the page shows
    must be printed (numbers aside), and a command exits 0 unless its shown output is an
    ``error:`` line."""
    background = []
    try:
        for command, shown in console_steps(page):
            if command.endswith("&"):
                background.append(
                    subprocess.Popen(
                        ["bash", "-c", command[:-1]],
                        cwd=cwd,
                        env=environment(cwd),
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                time.sleep(1)
                continue
            out = subprocess.run(
                ["bash", "-c", command],
                cwd=cwd,
                env=environment(cwd),
                capture_output=True,
                text=True,
                timeout=300,
            )
            printed = {skeleton(line) for line in (out.stdout + out.stderr).splitlines()}
            fails = any(line.startswith("error:") for line in shown)
            assert (out.returncode != 0) == fails, (command, out.stdout, out.stderr)
            missing = [line for line in shown if skeleton(line) not in printed]
            assert missing == [], (command, out.stdout + out.stderr)
        for proc in background:
            assert proc.wait(timeout=120) == 0
    finally:
        for proc in background:
            proc.kill()


def test_every_tutorial_shows_commands_whose_files_exist():
    """Not slow: every tutorial has commands, and every file a command names is there."""
    assert {p.name for p in TUTORIALS} >= {
        "first-experiment.md", "sweep.md", "plugin.md", "network.md", "attackers.md",
        "sockets.md", "cost.md", "python.md",
    }  # fmt: skip
    for page in TUTORIALS:
        steps = console_steps(page) or PYTHON.findall(page.read_text())
        assert steps, page.name
        for command, _ in console_steps(page):
            for path in re.findall(r"\b((?:experiments|examples)/[\w./-]+\.yaml)\b", command):
                assert (ROOT / path).is_file(), (page.name, path)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in TUTORIALS if console_steps(p)], ids=lambda p: p.stem)
def test_a_tutorials_commands_run_as_shown(page, tmp_path):
    run_page(page, workspace(tmp_path))


@pytest.mark.slow
def test_the_python_tutorial_runs_as_shown(tmp_path):
    """The Python tutorial's code blocks, run in order in one interpreter; each prints the
    text block shown under it (numbers aside)."""
    cwd = workspace(tmp_path)
    blocks = PYTHON.findall((DOCS / "tutorials" / "python.md").read_text())
    script = tmp_path / "tutorial.py"
    marker = "----- next block -----"
    script.write_text(f"\nprint({marker!r})\n".join(code for code, _ in blocks))
    out = subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=environment(cwd), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    printed = out.stdout.split(marker)
    assert len(printed) == len(blocks)
    for (_, shown), got in zip(blocks, printed, strict=True):
        lines = {skeleton(line) for line in got.splitlines()}
        assert [ln for ln in shown.splitlines() if skeleton(ln) not in lines] == [], got


QUICKSTART = re.compile(r"```sh\nmake run .*?```\n.*?```\n(quickstart: .*?)\n```", re.S)


def test_the_readme_quick_start_prints_what_it_shows(tmp_path):
    """`make run`'s command, as the Makefile has it, prints the line the README shows: the
    same bytes, messages and simulated time, the accuracy within 0.01 (CPU kernels differ
    in the last bits between machines; ``tests/test_experiments.py`` allows as much), any
    wall time."""
    readme = (ROOT / "README.md").read_text()
    (shown,) = QUICKSTART.findall(readme)
    make = (ROOT / "Makefile").read_text()
    (command,) = re.findall(
        r"^\t\$\(VENV\)/bin/(p2pfl run experiments/quickstart\.yaml.*)$", make, re.M
    )
    (tmp_path / "ws").mkdir()
    out = subprocess.run(
        ["bash", "-c", command + " --quiet"],
        cwd=workspace(tmp_path / "ws"),
        env=environment(tmp_path / "ws"),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    got = out.stdout.strip()
    assert skeleton(got) == skeleton(shown)
    numbers = re.compile(r"final accuracy ([\d.]+), (.*), wall")
    (acc, rest), (shown_acc, shown_rest) = numbers.findall(got)[0], numbers.findall(shown)[0]
    assert rest == shown_rest and abs(float(acc) - float(shown_acc)) <= 0.01, got


# --- the README: a quick tour that links into the site ----------------------------------


def test_the_readme_is_a_quick_tour_whose_links_resolve():
    """At most 200 lines (the manual is the site), and every relative link points at a file
    of the repository (the site's pages are its Markdown files under docs/)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert len(links) >= 20
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), link
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [link.removeprefix("docs/") for link in links if link.startswith("docs/")]
    assert [p for p in pages if p.endswith(".md") and p not in nav] == []
