"""MkDocs hook: the reference pages generated from the code at build time.

``reference/yaml.md`` (every section and key of an experiment file, from the registries'
signatures and docstrings) and ``reference/cli.md`` (from the argument parser) are built
by :mod:`p2pfl.app.reference`, so they never drift from the code. ``report.md`` is written
by its own page's author; until it exists a short page stands in, so the navigation never
points at nothing.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]

REPORT_STUB = """# Run report

`p2pfl report RUN_DIR [RUN_DIR ...]` writes one self-contained HTML page per run or
comparison. Its documentation is on its way.
"""


def on_files(files: Files, config) -> Files:  # noqa: ANN001 (MkDocs' signature)
    from p2pfl.app.reference import cli_reference, yaml_reference

    pages = {
        "reference/yaml.md": yaml_reference(),
        "reference/cli.md": cli_reference(),
    }
    if files.get_file_from_path("report.md") is None:
        pages["report.md"] = REPORT_STUB
    for path, text in pages.items():
        files.append(File.generated(config, path, content=text))
    return files
