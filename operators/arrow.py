"""ReadArrow: a source of text documents from one string column of Arrow IPC (Feather v2) files."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.ipc as ipc

from zephon_flow.errors import DataError
from zephon_flow.operators._column import ColumnSource, column_rows
from zephon_flow.operators.splits import START, Record, Split

_FILE_MAGIC = b"ARROW1"
_FEATHER_V1_MAGIC = b"FEA1"


class ReadArrow(ColumnSource):
    """Documents from the string column ``column`` of Arrow IPC files, one record batch per split.

    Reads the IPC *file* format (Feather v2, ``.arrow``/``.feather``: batches are found through the
    footer, so a split is opened directly) and the IPC *stream* format (``.arrows``: reaching
    batch ``b`` reads the metadata of the batches before it; the file is memory-mapped, so that
    costs no data copy). Feather v1 files are refused.

    - **Splits**: ``Split(path, b, b + 1)`` for record batch ``b``, listed in file order.
    - **Positions**: the number of rows of that batch already consumed; a record's ``offset`` is
      its row in the batch.
    - **Documents**: only ``column`` is read; null and empty values give no document.
    - **Epochs**: ``epochs=None`` reads forever, each epoch dealing the batches anew; with a
      number, a lane's stream of this source ends after that many passes.
    - **Errors** (``DataError``, naming the file and this operator): an empty (0-byte) file, a
      file that is not Arrow IPC, a schema without ``column`` (the message lists the columns
      it has), a batch that is gone since listing, and in ``decode`` a value that is not a
      string (naming the batch and row). ``on_error="skip"`` lets the runner drop such records.
    """

    # -- listing -----------------------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        splits: list[Split] = []
        for path in paths:
            with _IpcFile(self, path) as f:
                n = f.num_batches()
            splits.extend(Split(path, b, b + 1) for b in range(n))
        return splits

    # -- reading -----------------------------------------------------------------------
    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        batch = split.start
        with _IpcFile(self, split.path) as f:
            values = f.column_of_batch(batch)
        first = 0 if position == START else position
        if not 0 <= first <= len(values):
            raise DataError(
                f"{self.operator_name}: cannot resume record batch {batch} of {split.path} at row "
                f"{first}: it holds {len(values)} rows; did the file change since the checkpoint?"
            )
        return column_rows(split.path, f"record batch {batch}", values, first)


class _IpcFile:
    """One memory-mapped Arrow IPC file or stream, its schema checked for the source's column."""

    def __init__(self, source: ReadArrow, path: str) -> None:
        self._op, self._column, self.path = source.operator_name, source.column, path
        self._map: pa.MemoryMappedFile | None = None

    def __enter__(self) -> _IpcFile:
        path = self.path
        try:
            if os.path.getsize(path) == 0:
                raise DataError(f"{self._op}: {path} is empty (0 bytes), not an Arrow IPC file")
            self._map = pa.memory_map(path)
            head = self._map.read(len(_FILE_MAGIC))
            self._map.seek(0)
            if head.startswith(_FEATHER_V1_MAGIC):
                raise DataError(
                    f"{self._op}: {path} is a Feather v1 file; rewrite it as Feather v2 "
                    "(pyarrow.feather.write_feather) or Arrow IPC"
                )
            self._is_file = head == _FILE_MAGIC
            self._reader = ipc.open_file(self._map) if self._is_file else ipc.open_stream(self._map)
        except OSError as exc:
            self.__exit__()
            raise DataError(f"{self._op}: cannot read {path}: {exc.strerror or exc}") from exc
        except pa.ArrowException as exc:
            self.__exit__()
            raise DataError(f"{self._op}: {path} is not a readable Arrow IPC file or stream: {exc}") from exc
        except DataError:
            self.__exit__()
            raise
        self._index = self._column_index(self._reader.schema)
        return self

    def __exit__(self, *_: object) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def _column_index(self, schema: pa.Schema) -> int:
        names: list[str] = schema.names
        if names.count(self._column) != 1:
            self.__exit__()
            available = ", ".join(repr(n) for n in names) or "none"
            what = "no column" if self._column not in names else "more than one column named"
            raise DataError(
                f"{self._op}: {self.path} has {what} {self._column!r} "
                f"(columns: {available}); set column= to the one that holds the text"
            )
        return names.index(self._column)

    def num_batches(self) -> int:
        if self._is_file:
            return int(self._reader.num_record_batches)
        n = 0
        for _ in self._batches():
            n += 1
        return n

    def column_of_batch(self, batch: int) -> pa.Array:
        """The source's column of record batch ``batch``, refusing a batch that is not there."""
        found: pa.RecordBatch | None = None
        if self._is_file:
            n = int(self._reader.num_record_batches)
            if 0 <= batch < n:
                try:
                    found = self._reader.get_batch(batch)
                except (OSError, pa.ArrowException) as exc:
                    raise self._unreadable(batch, exc) from exc
        else:
            n = 0
            for n, rb in enumerate(self._batches(), 1):
                if n - 1 == batch:
                    found = rb
                    break
        if found is None:
            raise DataError(
                f"{self._op}: {self.path} has no record batch {batch} (it has {n}); "
                "did the file change since the splits were listed?"
            )
        return found.column(self._index)

    def _batches(self) -> Iterator[pa.RecordBatch]:
        """The record batches of a stream, in order, naming the batch that cannot be read."""
        b = 0
        while True:
            try:
                rb = self._reader.read_next_batch()
            except StopIteration:
                return
            except (OSError, pa.ArrowException) as exc:
                raise self._unreadable(b, exc) from exc
            yield rb
            b += 1

    def _unreadable(self, batch: int, exc: BaseException) -> DataError:
        return DataError(f"{self._op}: cannot read record batch {batch} of {self.path}: {exc}")
