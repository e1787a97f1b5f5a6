"""A run's CSV outputs read back by column (``p2pfl.reporting.tables``): the rows are
``csv.DictReader``'s, an error names the line ``DictReader`` would have stopped at, and the
figures' sums over a column equal a plain loop over the rows."""

from __future__ import annotations

import csv
import gc
from bisect import bisect_right
from itertools import accumulate
from pathlib import Path

import numpy as np
import pytest

from conftest import run_experiment
from p2pfl.core.collector import collector_paused
from p2pfl.core.errors import ConfigError
from p2pfl.reporting import plots
from p2pfl.reporting.progress import Sent
from p2pfl.reporting.tables import Table, read_table


def dict_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished gossip run with message loss: its comm.csv has a fate column."""
    out = tmp_path_factory.mktemp("tables") / "run"
    run_experiment(
        out, model={"name": "mlp", "hidden": [8]}, peers={"count": 6},
        topology={"kind": "ring"}, algorithm={"name": "gossip", "rounds": 3},
        network={"links": {"loss": 0.3}},
    )  # fmt: skip
    return out


@pytest.mark.parametrize("name", ["comm.csv", "metrics.csv", "partition.csv"])
def test_a_tables_rows_are_dictreaders(run, name):
    table = read_table(run / name)
    expected = dict_rows(run / name)
    assert len(expected) > 5 and list(table) == expected
    assert table[3] == expected[3] and table[-1] == expected[-1] and table[1:3] == expected[1:3]
    assert table.header == list(expected[0])


def test_a_column_read_as_numbers_is_each_field_read_by_python(run):
    table = read_table(run / "comm.csv")
    rows = dict_rows(run / "comm.csv")
    assert table.ints("bytes").tolist() == [int(r["bytes"]) for r in rows]
    assert table.floats("arrival").tolist() == [float(r["arrival"]) for r in rows]
    kept = table.ints("bytes")  # read once, shared by every figure: nobody may write it
    assert table.ints("bytes") is kept and not kept.flags.writeable
    assert {r["fate"] for r in rows} == {"delivered", "lost"}  # the case: some were lost


def test_blank_lines_quotes_and_line_breaks_in_a_field_are_read_as_dictreader_reads_them(
    tmp_path,
):
    path = tmp_path / "t.csv"
    path.write_text('a,b\n1,"x,y"\n\n2,"two\nlines"\n3,z\n')
    assert list(read_table(path, {"a": int})) == dict_rows(path)
    path.write_text('a,b\n1,"two\nlines"\n\n2,q\nx,z\n')
    with pytest.raises(ConfigError, match=r"t.csv line 6: column 'a' is 'x', not a int$"):
        read_table(path, {"a": int})


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("a,b\n1,2\n3\n4,x\n", "line 3: 1 fields; its header has 2"),  # short row first
        ("a,b\n1,2\n4,x\n3\n", "line 3: column 'b' is 'x', not a float"),  # bad value first
        ("a,b\n1,y\n4,x\n", "line 2: column 'b' is 'y', not a float"),
        ("a,b\nq,y\n", "line 2: column 'a' is 'q', not a int"),  # of one row's, the first given
        ("a,b\n1,2,3\n", "line 2: 3 fields; its header has 2"),
        ("b\n1\n", "no column a in its header"),
    ],
)
def test_an_error_names_the_first_line_that_breaks_the_table(tmp_path, text, reason):
    """As the row-by-row check did: each row's width, then its columns in the order given."""
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_table(path, {"a": int, "b": float})
    assert str(e.value) in (f"{path} {reason}", f"{path}: {reason}")


def test_a_bad_number_met_later_names_its_line(tmp_path):
    path = tmp_path / "comm.csv"
    path.write_text("time,bytes\n0.5,3\n\nsoon,4\n")
    table = read_table(path, {"bytes": int})
    with pytest.raises(ConfigError, match=r"comm.csv line 4: column 'time' is 'soon', not a float"):
        table.floats("time")
    with pytest.raises(ConfigError, match=r"comm.csv line 2: column 'time' is '0.5', not a int"):
        table.ints("time")


def test_sent_is_the_bytes_of_every_message_up_to_a_time():
    rng = np.random.default_rng(0)
    times = rng.integers(0, 20, 500) / 4  # many ties
    sizes = rng.integers(1, 10**9, 500)
    sent = Sent(times, sizes)
    pairs = sorted(zip(times.tolist(), sizes.tolist(), strict=True))
    totals = [0, *accumulate(b for _, b in pairs)]
    for t in [-1.0, 0.0, 0.25, 1.1, 2.5, 4.75, 5.0, 99.0]:
        assert sent.by(t) == totals[bisect_right([p[0] for p in pairs], t)]
        assert isinstance(sent.by(t), int)
    assert Sent(np.array([]), np.array([])).by(1.0) == 0


def test_a_runs_delivered_bytes_leave_out_the_lost_ones(run):
    """The figures' bytes against time: only what arrived, by its arrival time."""
    series, _ = plots.series(plots.read_run(run))
    rows = dict_rows(run / "comm.csv")
    for time, *_, delivered in ([p[0], p[2]] for p in series):
        assert delivered == sum(
            int(r["bytes"]) for r in rows
            if r["fate"] == "delivered" and float(r["arrival"]) <= time
        )  # fmt: skip


def test_a_table_made_in_memory_reads_as_the_file_would():
    table = Table.of([{"a": 1, "b": 0.5}, {"a": 2, "b": "x"}])
    assert list(table) == [{"a": "1", "b": "0.5"}, {"a": "2", "b": "x"}]
    assert table.ints("a").tolist() == [1, 2] and len(Table.of([])) == 0
    with pytest.raises(ConfigError, match="a table line [?]: column 'b' is 'x', not a float"):
        table.floats("b")


def test_the_collector_is_back_as_it_was_after_a_pause_even_after_an_error():
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        assert not gc.isenabled()
        raise KeyError
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
