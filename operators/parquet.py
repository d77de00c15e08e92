"""ReadParquet: a source of text documents from one string column of Parquet files."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from zephon_flow.errors import DataError
from zephon_flow.operators._column import ColumnSource, column_rows
from zephon_flow.operators.splits import START, Record, Split


class ReadParquet(ColumnSource):
    """Documents from the string column ``column``, dealt one row group per split.

    A split is ``Split(path, g, g + 1)`` for row group ``g``; a position counts the rows of that
    group already consumed. Only ``column`` is read. Null and empty values give no document.
    """

    # -- listing -----------------------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        splits: list[Split] = []
        for path in paths:
            with self._open(path) as pf:
                groups = pf.num_row_groups
            splits.extend(Split(path, g, g + 1) for g in range(groups))
        return splits

    def _open(self, path: str) -> pq.ParquetFile:
        """The file, its footer read and its schema checked for ``column``."""
        try:
            if os.path.getsize(path) == 0:
                raise DataError(f"{self.operator_name}: {path} is empty (0 bytes), not a Parquet file")
            pf = pq.ParquetFile(path)
        except OSError as exc:
            raise DataError(f"{self.operator_name}: cannot read {path}: {exc.strerror or exc}") from exc
        except pa.ArrowException as exc:
            raise DataError(f"{self.operator_name}: {path} is not a readable Parquet file: {exc}") from exc
        names: list[str] = pf.schema_arrow.names
        if self.column not in names:
            pf.close()
            available = ", ".join(repr(n) for n in names) or "none"
            raise DataError(
                f"{self.operator_name}: {path} has no column {self.column!r} "
                f"(columns: {available}); set column= to the one that holds the text"
            )
        return pf

    # -- reading -----------------------------------------------------------------------
    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        group = split.start
        values = self._read_group(split.path, group)
        first = 0 if position == START else position
        if not 0 <= first <= len(values):
            raise DataError(
                f"{self.operator_name}: cannot resume row group {group} of {split.path} at row "
                f"{first}: it holds {len(values)} rows; did the file change since the checkpoint?"
            )
        return column_rows(split.path, f"row group {group}", values, first)

    def _read_group(self, path: str, group: int) -> pa.ChunkedArray:
        with self._open(path) as pf:
            if not 0 <= group < pf.num_row_groups:
                raise DataError(
                    f"{self.operator_name}: {path} has no row group {group} (it has "
                    f"{pf.num_row_groups}); did the file change since the splits were listed?"
                )
            try:
                table = pf.read_row_group(group, columns=[self.column])
            except (OSError, pa.ArrowException) as exc:
                raise DataError(
                    f"{self.operator_name}: cannot read row group {group} of {path}: {exc}"
                ) from exc
        return table.column(0)
