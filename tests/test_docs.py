"""The docs say what the repository holds: the quick-start file the README shows is the one
``make run`` runs, the package layout page's layer table (docs/reference/layout.md) names every
part of the package, and nothing cites files a reader of the repository does not have."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

README = (ROOT / "README.md").read_text()
LAYOUT = (ROOT / "docs" / "reference" / "layout.md").read_text()
"""The package layout page: its table has a row per layer (moved from the README)."""


def test_readme_shows_the_quickstart_file_make_runs():
    assert "experiments/quickstart.yaml" in (ROOT / "Makefile").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", README, re.S)
    assert (ROOT / "experiments" / "quickstart.yaml").read_text() in blocks


def test_the_layer_table_names_every_subpackage():
    rows = re.findall(r"^\| `([^`]+)` \|", LAYOUT, re.M)
    packages = sorted(
        f"{p.name}/" for p in (ROOT / "p2pfl").iterdir() if (p / "__init__.py").is_file()
    )
    assert [r for r in rows if r.endswith("/") or r.endswith("api.py")] == [
        "p2pfl/api.py", "app/", "runtime/", "reporting/", "methods/", "learning/", "data/",
        "network/", "core/",
    ]  # fmt: skip
    assert sorted(r for r in rows if r.endswith("/")) == packages


def test_the_layer_table_names_every_module():
    """Each module ``p2pfl/PKG/PATH.py`` is named `PATH.py` in row `PKG/` (a nested one as
    `attacks/alie.py`), each top-level one in its own row, and no row names a module that
    is not there."""
    cells = dict(re.findall(r"^\| `([^`]+)` \| (.*) \|[^|]*\|$", LAYOUT, re.M))
    named = {
        (row if row.endswith("/") else "", token)
        for row, cell in cells.items()
        for token in re.findall(r"`([^`]+\.py)`", cell if row.endswith("/") else f"`{row}`")
    }
    modules = set()
    for path in (ROOT / "p2pfl").rglob("*.py"):
        rel = path.relative_to(ROOT / "p2pfl")
        if path.name in ("__init__.py", "__main__.py") or "__pycache__" in rel.parts:
            continue
        if len(rel.parts) == 1:
            modules.add(("", f"p2pfl/{rel}"))
        else:
            modules.add((f"{rel.parts[0]}/", "/".join(rel.parts[1:])))
    assert sorted(modules - named) == []  # modules the table leaves out
    assert sorted(named - modules) == []  # modules it names that are not there


def test_nothing_cites_the_unpublished_specs():
    files = [ROOT / "README.md"] + [
        path
        for folder in ("p2pfl", "tests", "docs", "experiments", "benchmarks", "examples")
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in (".py", ".md", ".yaml")
        and path != Path(__file__)
        # not what a run installed there (benchmarks/.flwr-venv: Flower for vs_flower.py)
        and not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
    ]
    cited = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in files
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "specs/" in line
    ]
    assert cited == []
