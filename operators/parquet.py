"""ReadParquet: a source of documents (text, or token ids) from one column of Parquet files."""

from __future__ import annotations

from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

from zephon_flow.core import files
from zephon_flow.core.errors import DataError
from zephon_flow.operators._column import ColumnSource, column_kind


class ReadParquet(ColumnSource):
    """Documents from the column ``column`` of Parquet files, in row ranges: text from a string
    column, or token ids from an integer-list column (pre-tokenized data: each row an int32
    array that ``Pack`` takes without ``Tokenize``; see ``ColumnSource`` and
    ``docs/pretokenized.md``). The column's type is checked when the files are listed.

    Splits are row ranges of a file (see ``ColumnSource``): small row groups are grouped, and
    row groups bigger than a split are cut into ranges; such a split reads its group's column
    (only ``column``) and keeps its range, so a group cut in ``k`` is decoded ``k`` times per
    pass. Errors name the row group and its row. Null and empty values give no document.
    """

    unit_name = "row group"

    def open_units(self, path: str) -> _RowGroups:
        return _RowGroups(self, path)

    def _open(self, path: str) -> tuple[pq.ParquetFile, IO[bytes] | None, str]:
        """The file, its footer read and its schema checked for ``column`` and its type; for a
        remote file the handle it reads through (the caller closes both); what the column holds
        (``column_kind``)."""
        raw: IO[bytes] | None = None
        try:
            if files.size(path, operator=self.operator_name) == 0:
                raise DataError(f"{self.operator_name}: {path} is empty (0 bytes), not a Parquet file")
            if not files.is_local(path):
                raw = files.open_binary(path, operator=self.operator_name)
            pf = pq.ParquetFile(raw if raw is not None else files.local_path(path))
        except OSError as exc:
            _close(raw)
            if exc.errno is None:  # pyarrow's own IOError: a damaged footer, not the OS
                raise DataError(
                    f"{self.operator_name}: {path} is not a readable Parquet file: {exc}"
                ) from exc
            raise DataError(f"{self.operator_name}: cannot read {path}: {exc.strerror or exc}") from exc
        except pa.ArrowException as exc:
            _close(raw)
            raise DataError(f"{self.operator_name}: {path} is not a readable Parquet file: {exc}") from exc
        names: list[str] = pf.schema_arrow.names
        if self.column not in names:
            pf.close()
            _close(raw)
            available = ", ".join(repr(n) for n in names) or "none"
            raise DataError(
                f"{self.operator_name}: {path} has no column {self.column!r} "
                f"(columns: {available}); set column= to the one that holds the text"
            )
        try:
            kind = column_kind(
                pf.schema_arrow.field(names.index(self.column)).type,
                operator=self.operator_name,
                path=path,
                column=self.column,
            )
        except DataError:
            pf.close()
            _close(raw)
            raise
        return pf, raw, kind


def _close(raw: IO[bytes] | None) -> None:
    if raw is not None:
        raw.close()


class _RowGroups:
    """An open Parquet file as units: its row groups' row counts and ``column`` of each."""

    def __init__(self, source: ReadParquet, path: str) -> None:
        self._op, self.path = source.operator_name, path
        self._wanted = source.column
        self._file, self._raw, self.kind = source._open(path)
        meta = self._file.metadata
        self.rows = [meta.row_group(g).num_rows for g in range(self._file.num_row_groups)]

    def column(self, group: int) -> pa.ChunkedArray:
        try:
            table = self._file.read_row_group(group, columns=[self._wanted])
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{self._op}: cannot read row group {group} of {self.path}: {exc}") from exc
        return table.column(0)

    def close(self) -> None:
        self._file.close()
        _close(self._raw)

    def __enter__(self) -> _RowGroups:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
