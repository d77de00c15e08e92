"""ReadArrow: a source of documents (text, or token ids) from one column of Arrow IPC files."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.ipc as ipc

from zephon_flow.core import files
from zephon_flow.core.errors import DataError
from zephon_flow.operators import _hf_disk
from zephon_flow.operators._column import ColumnSource, column_kind

_FILE_MAGIC = b"ARROW1"
_FEATHER_V1_MAGIC = b"FEA1"


class ReadArrow(ColumnSource):
    """Documents from the column ``column`` of Arrow IPC files, in row ranges: text from a
    string column, or token ids from an integer-list column (each row an int32 array that
    ``Pack`` takes without ``Tokenize``; see ``docs/pretokenized.md``).

    Reads the IPC *file* format (Feather v2, ``.arrow``/``.feather``: batches are found through the
    footer, so a split is opened directly) and the IPC *stream* format (``.arrows``: reaching
    batch ``b`` reads the metadata of the batches before it; the file is memory-mapped, so that
    costs no data copy). Feather v1 files are refused.

    - **Splits**: row ranges of a file (see ``ColumnSource``): small record batches are
      grouped, batches bigger than a split are cut into row ranges.
    - **Positions**: the file row of the next row to read; a record's ``offset`` is its file
      row, its ``where`` names the batch and the row in it.
    - **Documents**: only ``column`` is read; null and empty values give no document. Its type
      is checked when the files are listed: a string column gives text, a list, large_list or
      fixed_size_list of integers gives int32 token arrays (an id outside int32 is refused by
      its row); any other type is refused naming the file, the column and the type.
    - **Hugging Face** ``save_to_disk`` **folders** (``dataset_info.json``, ``state.json`` and
      ``data-00000-of-0000N.arrow`` stream files): ``ReadArrow("ds")`` or ``ReadArrow("ds/*")``
      reads the data files ``state.json`` lists, in its order; a ``DatasetDict`` folder is
      refused naming its splits (read ``ds/train``).
    - **Epochs**: ``epochs=None`` reads forever, each epoch dealing the batches anew; with a
      number, a lane's stream of this source ends after that many passes.
    - **Errors** (``DataError``, naming the file and this operator): an empty (0-byte) file, a
      file that is not Arrow IPC, a damaged schema, a schema without ``column`` (the message
      lists the columns it has), a batch that is gone since listing, a batch whose column is
      damaged (its offsets, lengths or buffers disagree: the column is checked in full before
      any value is read, ``check_column``, so a damaged file never crashes the process; names
      the batch and its file rows), and in ``decode`` a value that is not a string (naming the
      batch and row). ``on_error="skip"`` lets the runner drop such records.
    """

    unit_name = "record batch"

    def open_units(self, path: str) -> _IpcFile:
        return _IpcFile(self, path)

    def paths(self) -> list[str]:
        """The files of the glob; a Hugging Face ``save_to_disk`` folder among them (or named
        by the pattern) is read by the data files its ``state.json`` lists (``_hf_disk``)."""
        if self._paths is None:
            self._paths = _hf_disk.expand(self.pattern, operator=self.operator_name)
        return self._paths


class _IpcFile:
    """One memory-mapped Arrow IPC file or stream, its schema checked for the source's column."""

    def __init__(self, source: ReadArrow, path: str) -> None:
        self._op, self._column, self.path = source.operator_name, source.column, path
        self._map: pa.NativeFile | None = None
        self._open()

    def __enter__(self) -> _IpcFile:
        return self

    def _open(self) -> None:
        """Maps the file, reads its schema and its batches' row counts."""
        path = self.path
        try:
            if files.size(path, operator=self._op) == 0:
                raise DataError(f"{self._op}: {path} is empty (0 bytes), not an Arrow IPC file")
            if files.is_local(path):
                self._map = pa.memory_map(files.local_path(path))
            else:
                self._map = pa.PythonFile(files.open_binary(path, operator=self._op), mode="r")
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
        try:
            names: list[str] = self._reader.schema.names
        except UnicodeDecodeError as exc:  # a damaged schema: field names must be UTF-8
            self.__exit__()
            raise DataError(
                f"{self._op}: {path} has a damaged schema (a field name is not UTF-8: {exc})"
            ) from exc
        self._index = self._column_index(self._reader.schema, names)
        self._stream_batches: list[pa.RecordBatch] = []
        try:
            if self._is_file:
                # Row counts come from each batch's metadata: no data is touched (and none
                # checked) until a batch's column is read.
                n = int(self._reader.num_record_batches)
                self.rows = [self._batch(b).num_rows for b in range(n)]
            else:
                # Memory-mapped: the batches reference the map, reading them copies no data.
                self._stream_batches = list(self._batches())
                self.rows = [rb.num_rows for rb in self._stream_batches]
        except DataError:
            self.__exit__()
            raise

    def __exit__(self, *_: object) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def _column_index(self, schema: pa.Schema, names: list[str]) -> int:
        if names.count(self._column) != 1:
            self.__exit__()
            available = ", ".join(repr(n) for n in names) or "none"
            what = "no column" if self._column not in names else "more than one column named"
            raise DataError(
                f"{self._op}: {self.path} has {what} {self._column!r} "
                f"(columns: {available}); set column= to the one that holds the text"
            )
        index = names.index(self._column)
        try:
            self.kind = column_kind(
                schema.field(index).type, operator=self._op, path=self.path, column=self._column
            )
        except DataError:
            self.__exit__()
            raise
        return index

    def column(self, batch: int) -> pa.Array:
        """The source's column of record batch ``batch``, its buffers checked in full first
        (``check_column``): a damaged file is a ``DataError`` naming the batch and its rows,
        never a read out of bounds."""
        rb = self._batch(batch) if self._is_file else self._stream_batches[batch]
        try:
            values = rb.column(self._index)
            check_column(values)
        except (OSError, pa.ArrowException) as exc:
            first = sum(self.rows[:batch])
            rows = f"file rows {first}-{first + rb.num_rows - 1}"
            raise DataError(
                f"{self._op}: record batch {batch} ({rows}) of {self.path} is damaged: column "
                f"{self._column!r}: {exc}"
            ) from exc
        return values

    def close(self) -> None:
        self.__exit__()

    def _batch(self, batch: int) -> pa.RecordBatch:
        try:
            return self._reader.get_batch(batch)
        except (OSError, pa.ArrowException) as exc:
            raise self._unreadable(batch, exc) from exc

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


#: Types with the layout of string types but no UTF-8 to check (see ``check_column``).
_AS_BYTES = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}


def check_column(values: pa.Array) -> None:
    """Checks every offset, length and buffer of ``values`` against its buffers (Arrow's full
    validation), raising ``pa.ArrowInvalid``: reading a damaged IPC file's values unchecked
    makes pyarrow read out of bounds and crash the process (SIGSEGV, SIGBUS). A batch's other
    columns are never read, so they are not checked. Strings are checked as bytes: the UTF-8
    check is the decoder's (a ``DataError`` naming the rows, ``_column.py``): with it, the check
    took 13 % of a text read's time, without it 0.4 % (``bench/arrow_validation.py``)."""
    as_bytes = _AS_BYTES.get(values.type)
    (values.view(as_bytes) if as_bytes is not None else values).validate(full=True)
