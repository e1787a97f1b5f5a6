"""The example notebook (``examples/compare-methods.ipynb``) runs start to finish in a fresh
directory, its printed numbers are the ones its runs wrote, and it is stored without outputs."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from conftest import ROOT

nbformat = pytest.importorskip("nbformat")  # the dev extra's (not on every GPU image)
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOK = ROOT / "examples" / "compare-methods.ipynb"
RUNS = {"FedAvg, star": "fedavg-star", "DFedAvgM, ring": "dfedavgm-ring"}


def test_the_notebook_is_stored_valid_and_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert nb.metadata.kernelspec.name == "python3"


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The notebook run by a Python kernel in an empty directory: (the notebook, the dir)."""
    where = tmp_path_factory.mktemp("notebook")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(where)}}
    )
    client.execute()  # raises CellExecutionError on a cell that fails
    return nb, where


def printed(nb: Any) -> str:
    return "".join(
        out.text
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "stream" and out.name == "stdout"
    )


def summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


def test_the_notebook_runs_without_errors_and_draws_its_figure(executed):
    nb, where = executed
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    figures = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(figures) == 1  # accuracy against simulated time and against bytes
    # its last cell lists the figures Result.plot() wrote for the star run
    listed = ast.literal_eval(nb.cells[-1].outputs[0]["data"]["text/plain"])
    plots = where / "runs" / "compare-methods" / "fedavg-star" / "plots"
    assert "accuracy.png" in listed and all((plots / name).is_file() for name in listed)


def test_the_numbers_it_prints_are_its_runs(executed):
    nb, where = executed
    text = printed(nb)
    out = where / "runs" / "compare-methods"
    for name, folder in RUNS.items():
        s = summary(out / folder)
        assert s["status"] == "ok" and s["num_peers"] == 8
        line = re.search(
            rf"^{re.escape(name)}: accuracy ([\d.]+), ([\d.]+) s simulated, ([\d,]+) bytes in "
            r"(\d+) messages$",
            text,
            re.M,
        )
        assert line is not None, text
        assert line[1] == f"{s['final']['accuracy']:.4f}"
        assert line[2] == f"{s['sim_time_s']:.4f}"
        assert int(line[3].replace(",", "")) == s["comm"]["total_bytes"]
        assert int(line[4]) == s["comm"]["messages"] == len(pd.read_csv(out / folder / "comm.csv"))
        reached = s["time_to_accuracy"]["0.8"]
        assert (
            f"{name}: reached 0.8 in round {reached['round']}, at {reached['time_s']:.4f} s "
            f"simulated, after {reached['bytes']:,} bytes"
        ) in text.splitlines()


def test_its_sweep_table_is_the_sweeps_and_a_cell_repeats_its_run(executed):
    nb, where = executed
    seeds = where / "runs" / "compare-methods" / "seeds"
    table = pd.read_csv(seeds / "sweep.csv")
    cells = pd.read_csv(seeds / "cells.csv")
    assert sorted(cells["status"]) == ["ok"] * 6 + ["skipped"] * 6
    text = printed(nb)
    for row in table[table["runs"] == 3].itertuples():
        mean, std = f"{row.accuracy_mean:.4f}", f"{row.accuracy_std:.4f}"
        pattern = rf"^{row.algorithm}\s+{row.topology}\s+3\s+{mean} ± {std}\s"
        assert re.search(pattern, text, re.M), (pattern, text)
    # the seed-0 cells are the notebook's two runs again, to the byte
    for folder, cell in (
        ("fedavg-star", "algorithm=fedavg_rounds-10,topology=star,seed=0"),
        ("dfedavgm-ring", "algorithm=dfedavgm_rounds-10,topology=ring,seed=0"),
    ):
        alone, in_grid = summary(seeds.parent / folder), summary(seeds / cell)
        assert alone["final"] == in_grid["final"] and alone["comm"] == in_grid["comm"]
        assert (seeds.parent / folder / "comm.csv").read_bytes() == (
            seeds / cell / "comm.csv"
        ).read_bytes()
