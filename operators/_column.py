"""A source whose documents are the string values of one column (Parquet, Arrow IPC)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from zephon_flow.errors import DataError, SpecError
from zephon_flow.operators.splits import Record, Source

#: Rows turned into Python values at a time when a split is read.
BATCH_ROWS = 4096


class ColumnSource(Source):
    """Shared by sources that read ``column`` of a table: the option, its fingerprint part,
    row records and their decoding (null and empty values give no document)."""

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

    def params(self) -> dict[str, Any]:
        return {**super().params(), "column": self.column}

    def decode(self, record: Record, operator: str) -> list[Any]:
        value = record.payload
        if value is None or value == "":
            return []
        if not isinstance(value, str):
            raise DataError(
                f"{operator}: the column {self.column!r} in {record.path} at {record.where} "
                f"holds a {type(value).__name__}, not a string"
            )
        return [value]


def column_rows(
    path: str, unit: str, values: pa.Array | pa.ChunkedArray, first: int
) -> Iterator[tuple[int, Record]]:
    """``(position after, record)`` for rows ``first..`` of one split; ``unit`` names the split
    in errors (``"row group 2"``, ``"record batch 0"``)."""
    for begin in range(first, len(values), BATCH_ROWS):
        for row, value in enumerate(values.slice(begin, BATCH_ROWS).to_pylist(), begin):
            yield row + 1, Record(value, path, f"{unit} row {row}", row)
