"""A source whose documents are the string values of one column (Parquet, Arrow IPC), in row ranges."""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import pyarrow as pa

from zephon_flow.core import files
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Record, Source, Split
from zephon_flow.operators import _plan

#: Rows turned into Python values at a time when a split is read.
BATCH_ROWS = 4096
#: The fewest rows an automatic plan puts in a split.
MIN_SPLIT_ROWS = 256
#: Bytes of unit columns a source keeps decoded (per process) for splits that cover part of a
#: unit, so the ``k`` splits cut from one row group decode it about once, not ``k`` times.
CACHE_BYTES = 256 << 20


class Units(Protocol):
    """An open table file: its units' row counts and their columns (see ``ColumnSource``)."""

    rows: list[int]

    def column(self, unit: int) -> pa.Array | pa.ChunkedArray: ...

    def close(self) -> None: ...

    def __enter__(self) -> Units: ...

    def __exit__(self, *_: object) -> None: ...


class ColumnSource(Source):
    """Shared by sources that read ``column`` of a table: the option, its fingerprint part, the
    row-range split plan, row records and their decoding (null and empty values give no
    document).

    A table file is a sequence of *units* (Parquet row groups, Arrow record batches). A split is
    a range ``[start, stop)`` of the file's rows (counted from the file's first row), of about
    the total rows of all files over ``SPLITS_PER_LANE`` splits per lane (at least
    ``MIN_SPLIT_ROWS``): several small units form one split, and a unit bigger than that is cut
    into equal row ranges (each such split reads its unit's column and keeps its range). A
    position is the file row of the next row to read; ``weight`` is the rows.
    """

    #: A record's offset is a position ``read_split`` starts at (see ``Source``).
    rereads_offsets = True

    #: How errors name a unit: "row group", "record batch".
    unit_name = "unit"

    def __init__(
        self,
        pattern: str,
        *,
        column: str = "text",
        epochs: int | None = None,
        on_error: str = "raise",
        label: str | None = None,
    ) -> None:
        super().__init__(pattern, epochs=epochs, on_error=on_error, label=label)
        if not isinstance(column, str) or not column:
            raise SpecError(f"{type(self).__name__}: column must be a non-empty string, got {column!r}")
        self.column = column
        #: Files left out at listing under ``on_error="skip"``.
        self.skipped_files: list[str] = []
        self._cache_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, int, int, int], pa.Array | pa.ChunkedArray] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_cache_lock"], state["_cache"] = None, OrderedDict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache_lock = threading.Lock()

    def params(self) -> dict[str, Any]:
        return {**super().params(), "column": self.column, "split_plan": _plan.PLAN_VERSION}

    # -- what a subclass provides --------------------------------------------------------
    def open_units(self, path: str) -> Units:
        """The file opened (its schema checked for ``column``): its units' row counts and a
        reader of one unit's column. Closed by its ``with`` block."""
        raise NotImplementedError

    def unit_rows(self, path: str) -> list[int]:
        """The row count of every unit of the file, in order."""
        with self.open_units(path) as units:
            return list(units.rows)

    # -- the plan and the reading ----------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        skipped: list[str] = []
        listed = files.list_each(
            paths,
            lambda p: [(p, self.unit_rows(p))],
            on_error=self.on_error,
            operator=self.operator_name,
            skipped=skipped,
        )
        self.skipped_files = skipped
        total = sum(sum(rows) for _, rows in listed)
        size = _plan.target(total, lanes, MIN_SPLIT_ROWS)
        splits: list[Split] = []
        for path, rows in listed:
            bounds = [0]
            for n in rows:
                if n:
                    bounds.append(bounds[-1] + n)
            if len(bounds) > 1:
                splits.extend(Split(path, a, b) for a, b in _plan.ranges(bounds, size, refine=True))
        return splits

    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        first = split.start if position == START else position
        if not split.start <= first <= split.stop:
            raise DataError(
                f"{self.operator_name}: cannot resume rows [{split.start}, {split.stop}) of "
                f"{split.path} at row {first}; did the file change since the checkpoint?"
            )
        units = self.open_units(split.path)
        starts = [0]
        for n in units.rows:
            starts.append(starts[-1] + n)
        if starts[-1] < split.stop:
            units.close()
            raise DataError(
                f"{self.operator_name}: {split.path} holds {starts[-1]} rows, not the {split.stop} "
                "its splits were listed with; did the file change since the splits were listed?"
            )
        return self._rows(split, first, starts, units)

    def _rows(
        self, split: Split, first: int, starts: list[int], units: Units
    ) -> Iterator[tuple[int, Record]]:
        with units:
            row = first
            unit = bisect.bisect_right(starts, row) - 1
            while row < split.stop:
                base = starts[unit]
                end = min(split.stop, starts[unit + 1])
                partial = row > base or end < starts[unit + 1]
                values = self._column_of(units, split.path, unit) if partial else units.column(unit)
                name = f"{self.unit_name} {unit}"
                yield from column_rows(
                    split.path, name, values, row - base, end - base, base, operator=self.operator_name
                )
                row, unit = end, unit + 1

    def _column_of(self, units: Units, path: str, unit: int) -> pa.Array | pa.ChunkedArray:
        """A unit's column through the per-process cache (least recently used out first), keyed
        by the file's size and modification time too, so a rewritten file is read anew."""
        info = files.stat(path, operator=self.operator_name)
        key = (path, unit, info.size, info.mtime_ns)
        with self._cache_lock:
            values = self._cache.get(key)
            if values is not None:
                self._cache.move_to_end(key)
                return values
        values = units.column(unit)
        with self._cache_lock:
            self._cache[key] = values
            while len(self._cache) > 1 and sum(v.nbytes for v in self._cache.values()) > CACHE_BYTES:
                self._cache.popitem(last=False)
        return values

    def decode(self, record: Record, operator: str) -> list[Any]:
        value = record.payload
        if value is None or value == "":
            return []
        if not isinstance(value, str):
            hint = " (a binary column: store the text as a string column)" if isinstance(value, bytes) else ""
            raise DataError(
                f"{operator}: the column {self.column!r} in {record.path} at {record.where} "
                f"holds a value of type {type(value).__name__}, not a string{hint}"
            )
        return [value]


def column_rows(
    path: str,
    unit: str,
    values: pa.Array | pa.ChunkedArray,
    first: int,
    stop: int,
    base: int,
    *,
    operator: str,
) -> Iterator[tuple[int, Record]]:
    """``(position after, record)`` for rows ``first..stop`` of one unit whose first row is file
    row ``base``; ``unit`` names it in errors (``"row group 2"``, ``"record batch 0"``). Values
    that do not decode (invalid UTF-8, damaged offsets) raise a ``DataError`` naming the rows."""
    for begin in range(first, stop, BATCH_ROWS):
        n = min(BATCH_ROWS, stop - begin)
        try:
            chunk = values.slice(begin, n).to_pylist()
        except (UnicodeDecodeError, pa.ArrowException, SystemError, OverflowError) as exc:
            raise DataError(
                f"{operator}: {path} {unit} rows {begin}..{begin + n - 1} do not decode: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        for row, value in enumerate(chunk, begin):
            yield base + row + 1, Record(value, path, f"{unit} row {row}", base + row)
