"""A source whose documents are the values of one column (Parquet, Arrow IPC), in row ranges:
text from a string column, token ids (int32 arrays) from an integer-list column."""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

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
    #: What the column holds (``column_kind``): "text", "tokens", or "none" (nulls only).
    kind: str

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
        """The file opened (its schema checked for ``column`` and its type, ``column_kind``):
        its units' row counts and a reader of one unit's column. Closed by its ``with`` block."""
        raise NotImplementedError

    def unit_rows(self, path: str) -> list[int]:
        """The row count of every unit of the file, in order."""
        return self._listed(path)[0]

    def _listed(self, path: str) -> tuple[list[int], str]:
        with self.open_units(path) as units:
            return list(units.rows), units.kind

    # -- the plan and the reading ----------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        skipped: list[str] = []
        listed = files.list_each(
            paths,
            lambda p: [(p, *self._listed(p))],
            on_error=self.on_error,
            operator=self.operator_name,
            skipped=skipped,
        )
        self.skipped_files = skipped
        first: dict[str, str] = {}
        for path, _, kind in listed:
            first.setdefault(kind, path)
        if "text" in first and "tokens" in first:
            raise DataError(
                f"{self.operator_name}: the column {self.column!r} holds text in {first['text']} "
                f"but token ids in {first['tokens']}; a source reads one kind: give the text "
                f"files and the tokenized ones sources of their own"
            )
        total = sum(sum(rows) for _, rows, _ in listed)
        size = _plan.target(total, lanes, MIN_SPLIT_ROWS)
        splits: list[Split] = []
        for path, rows, _ in listed:
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
                    split.path,
                    name,
                    values,
                    row - base,
                    end - base,
                    base,
                    operator=self.operator_name,
                    column=self.column,
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
        if isinstance(value, np.ndarray):  # token ids (``column_rows`` made them int32)
            return [value] if value.size else []
        if value is None or value == "":
            return []
        if not isinstance(value, str):
            hint = " (a binary column: store the text as a string column)" if isinstance(value, bytes) else ""
            raise DataError(
                f"{operator}: the column {self.column!r} in {record.path} at {record.where} "
                f"holds a value of type {type(value).__name__}, not a string{hint}"
            )
        return [value]


#: What a column may hold, as errors say it.
ACCEPTED = (
    "text (string or large_string) or token ids (list, large_list or fixed_size_list of "
    "int8..int64 or uint8..uint64)"
)
_INT32 = np.iinfo(np.int32)


def column_kind(data_type: pa.DataType, *, operator: str, path: str, column: str) -> str:
    """``"text"`` for a string column, ``"tokens"`` for an integer-list column (``"none"`` for
    a column of nulls only); anything else is refused, naming the file, column and type."""
    if pat.is_dictionary(data_type):
        data_type = data_type.value_type
    if pat.is_string(data_type) or pat.is_large_string(data_type):
        return "text"
    if pat.is_null(data_type):
        return "none"
    if _is_token_list(data_type):
        return "tokens"
    hint = ""
    if pat.is_binary(data_type) or pat.is_large_binary(data_type):
        hint = " (a binary column: store the text as a string column)"
    elif pat.is_list(data_type) or pat.is_large_list(data_type) or pat.is_fixed_size_list(data_type):
        hint = " (token ids must be integers)"
    raise DataError(
        f"{operator}: the column {column!r} in {path} has type {data_type}; a column must hold "
        f"{ACCEPTED}{hint}"
    )


def _is_token_list(data_type: pa.DataType) -> bool:
    listed = pat.is_list(data_type) or pat.is_large_list(data_type) or pat.is_fixed_size_list(data_type)
    return bool(listed and pat.is_integer(data_type.value_type))


def token_rows(
    values: pa.Array, *, operator: str, path: str, unit: str, first: int, column: str
) -> list[Any]:
    """The rows of an integer-list array, each as an int32 array of its own (None for a null
    row). A null token id, or one outside int32, is refused naming its
    row (``first`` is the unit row of ``values``' first)."""
    n = len(values)
    if pat.is_fixed_size_list(values.type):
        size = values.type.list_size
        flat = values.values.slice(values.offset * size, n * size)
        offsets = np.arange(0, (n + 1) * size, size, dtype=np.int64)
    else:
        raw = values.offsets.to_numpy().astype(np.int64)
        flat = values.values.slice(int(raw[0]), int(raw[-1] - raw[0]))
        offsets = raw - raw[0]
    rows_valid = np.asarray(values.is_valid()) if values.null_count else np.ones(n, dtype=bool)
    counted = np.repeat(rows_valid, np.diff(offsets))  # the ids of valid rows (null rows' are not)
    ids = flat.to_numpy(zero_copy_only=False)
    bad_null = np.asarray(flat.is_null()) & counted if flat.null_count else None
    if bad_null is not None and bad_null.any():
        _refuse_id(operator, path, unit, first, column, offsets, int(np.flatnonzero(bad_null)[0]), None)
    if ids.dtype.kind == "f":  # nulls (of null rows only) made pyarrow give floats
        ids = np.where(counted, np.nan_to_num(ids), 0).astype(np.int64)
    if ids.size:
        outside = counted & ((ids < _INT32.min) | (ids > _INT32.max))
        if outside.any():
            at = int(np.flatnonzero(outside)[0])
            _refuse_id(operator, path, unit, first, column, offsets, at, int(ids[at]))
    # Each row its own int32 array (astype copies): never a view of the file's (mapped)
    # buffers, and a document a stateful operator keeps part of (Pack's open sequence) keeps
    # only its own tokens alive, not the block's.
    bounds = offsets.tolist()
    return [ids[bounds[i] : bounds[i + 1]].astype(np.int32) if rows_valid[i] else None for i in range(n)]


def _refuse_id(
    operator: str,
    path: str,
    unit: str,
    first: int,
    column: str,
    offsets: np.ndarray,
    at: int,
    value: int | None,
) -> None:
    row = first + int(np.searchsorted(offsets, at, side="right")) - 1
    what = "a null token id" if value is None else f"the token id {value}, outside int32 (-2**31..2**31-1)"
    raise DataError(f"{operator}: the column {column!r} in {path} at {unit} row {row} holds {what}")


def column_rows(
    path: str,
    unit: str,
    values: pa.Array | pa.ChunkedArray,
    first: int,
    stop: int,
    base: int,
    *,
    operator: str,
    column: str = "text",
) -> Iterator[tuple[int, Record]]:
    """``(position after, record)`` for rows ``first..stop`` of one unit whose first row is file
    row ``base``; ``unit`` names it in errors (``"row group 2"``, ``"record batch 0"``). Values
    that do not decode (invalid UTF-8, damaged offsets) raise a ``DataError`` naming the rows.
    A row of an integer-list column is an int32 array (``token_rows``)."""
    tokens = _is_token_list(values.type)
    for begin in range(first, stop, BATCH_ROWS):
        n = min(BATCH_ROWS, stop - begin)
        try:
            part = values.slice(begin, n)
            if tokens:
                if isinstance(part, pa.ChunkedArray):
                    part = part.combine_chunks()
                chunk = token_rows(part, operator=operator, path=path, unit=unit, first=begin, column=column)
            else:
                chunk = part.to_pylist()
        except (UnicodeDecodeError, pa.ArrowException, SystemError, OverflowError) as exc:
            raise DataError(
                f"{operator}: {path} {unit} rows {begin}..{begin + n - 1} do not decode: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        for row, value in enumerate(chunk, begin):
            yield base + row + 1, Record(value, path, f"{unit} row {row}", base + row)
