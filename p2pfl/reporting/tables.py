"""A run's CSV outputs read back, checked, and held by column.

A 10⁵-peer run's ``comm.csv`` has 10⁶ rows. Held as one list of strings per column, not a
dict per row, and read with Python's cyclic garbage collector paused (it would otherwise
walk the growing list of rows again and again), it is read in about a third of the time, and
the figures sum its columns with numpy instead of a Python loop over rows.
"""

from __future__ import annotations

import csv
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from p2pfl.core.collector import collector_paused
from p2pfl.core.errors import ConfigError

Read = Callable[[str], Any]
"""How a column's text is read (``int``, ``float``, ``str``): a ``ValueError`` rejects it."""
NUMBERS = {int: np.int64, float: np.float64}
"""The array type of a column read as numbers."""


class Table(Sequence[dict[str, str]]):
    """A CSV file's rows (each a dict of its fields as text, as ``csv.DictReader`` gives
    them), held by column: ``column``, ``ints`` and ``floats`` give a whole column."""

    def __init__(self, columns: dict[str, list[str]], path: Path | None = None) -> None:
        self.columns = columns
        self.header = list(columns)
        self.path = path
        """The file it was read from, for errors; None for a table made in memory."""
        self._length = len(next(iter(columns.values()), []))
        self._numbers: dict[tuple[str, type], np.ndarray] = {}

    @classmethod
    def of(cls, rows: Iterable[Mapping[str, Any]]) -> Table:
        """A table of ``rows`` (their values as text); the first row's keys are its header."""
        rows = list(rows)
        header = list(rows[0]) if rows else []
        return cls({c: [str(r[c]) for r in rows] for c in header})

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, i: int) -> dict[str, str]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, str]]: ...
    def __getitem__(self, i: int | slice) -> dict[str, str] | list[dict[str, str]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return {c: values[i] for c, values in self.columns.items()}

    def __iter__(self) -> Iterator[dict[str, str]]:
        header = self.header
        for values in zip(*self.columns.values(), strict=True):
            yield dict(zip(header, values, strict=True))

    def column(self, name: str) -> list[str]:
        """A column's fields as text, in the file's order."""
        return self.columns[name]

    def ints(self, name: str) -> np.ndarray:
        """A column read as Python's ``int`` reads each field, as int64 (:meth:`numbers`)."""
        return self.numbers(name, int)

    def floats(self, name: str) -> np.ndarray:
        """A column read as Python's ``float`` reads each field, as float64 (:meth:`numbers`)."""
        return self.numbers(name, float)

    def numbers(self, name: str, read: type[int] | type[float]) -> np.ndarray:
        """A column read as ``read`` reads each field, converted once and kept (read-only:
        every figure sums the same ``bytes`` column); a field it rejects is a one-line
        error naming the file, the line and the column."""
        if (name, read) not in self._numbers:
            values = self.columns[name]
            try:
                array = np.fromiter(map(read, values), NUMBERS[read], len(values))
            except ValueError:
                i = _first_rejected(values, read)
                raise ConfigError(
                    "", f"{self.path or 'a table'} line {_line(self.path, i)}: column {name!r} "
                    f"is {values[i]!r}, not a {read.__name__}",
                ) from None  # fmt: skip
            array.flags.writeable = False
            self._numbers[name, read] = array
        return self._numbers[name, read]


@collector_paused()  # its rows are a million lists, freed before it returns
def read_table(
    path: Path, columns: Mapping[str, Read] | None = None, rest: Read | None = None
) -> Table:
    """A CSV file's table, each row checked to have as many fields as its header and
    ``columns`` readable as their types (and, with ``rest``, the header's other columns as
    that); an error names the file and the first line that breaks them. Blank lines are
    skipped, as ``csv.DictReader`` skips them."""
    columns = dict(columns or {})
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            body = [row for row in reader if row]
    except (UnicodeDecodeError, csv.Error) as e:
        raise ConfigError("", f"{path}: not a CSV table ({e})") from None
    missing = [c for c in columns if c not in header]
    if missing:
        raise ConfigError("", f"{path}: no column {', '.join(missing)} in its header")
    if rest is not None:
        columns = dict.fromkeys(header, rest) | columns
    width = len(header)
    short = next((i for i, row in enumerate(body) if len(row) != width), len(body))
    table = Table({c: [row[j] for row in body[:short]] for j, c in enumerate(header)}, path)
    # the first row (by line) that breaks a column, and of its columns the first given
    unread = [
        (i, k, c, read)
        for k, (c, read) in enumerate(columns.items())
        if read is not str and (i := _first_unread(table.columns[c], read)) is not None
    ]
    if unread:
        i, _, c, read = min(unread, key=lambda u: u[:2])
        value = table.columns[c][i]
        raise ConfigError(
            "", f"{path} line {_line(path, i)}: column {c!r} is {value!r}, not a {read.__name__}"
        )
    if short < len(body):
        raise ConfigError(
            "", f"{path} line {_line(path, short)}: {len(body[short])} fields; its header has "
            f"{width}",
        )  # fmt: skip
    return table


def _first_unread(values: list[str], read: Read) -> int | None:
    """The index of the first field that ``read`` rejects; None if it reads them all."""
    try:
        deque(map(read, values), maxlen=0)  # in C: the usual case, every field read
        return None
    except ValueError:
        return _first_rejected(values, read)


def _first_rejected(values: list[str], read: Read) -> int:
    """The index of the first field that ``read`` rejects, one field at a time (where a
    whole column's read has failed)."""
    for i, value in enumerate(values):
        try:
            read(value)
        except ValueError:
            return i
    raise ValueError(f"{read.__name__} reads every field")


def _line(path: Path | None, index: int) -> int | str:
    """The file's line on which its ``index``-th row (after the header, blank lines not
    counted) ends, as ``csv.DictReader.line_num`` says; ``?`` for a table made in memory."""
    if path is None:
        return "?"
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        next(reader, None)
        rows = (reader.line_num for row in reader if row)
        return next(n for i, n in enumerate(rows) if i == index)
