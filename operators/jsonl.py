"""ReadJsonl: a source of text documents from JSON Lines files, plain or gzip/zstd compressed."""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import zstandard

from zephon_flow.errors import DataError, SpecError
from zephon_flow.operators.splits import START, Record, Source, Split

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

#: Suffixes of files that cannot be entered in the middle: each is one split, counted in lines.
COMPRESSED_SUFFIXES = (".gz", ".zst")

# What a damaged compressed stream raises besides OSError (gzip.BadGzipFile is an OSError).
_DECOMPRESSION_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError)
_CHUNK = 1 << 16


class ReadJsonl(Source):
    """Documents from the string field ``field`` of JSON objects, one object per line.

    A plain file is dealt in byte ranges of about ``split_bytes``. A range ``[start, stop)`` owns
    the lines whose first byte lies in it, so ranges are cut without scanning the file, and a
    position is the byte offset of the next line to read. A ``.gz`` or ``.zst`` file cannot be
    entered in the middle: it is one split ``[0, 0)`` whose position counts the lines consumed.
    Lines holding only whitespace are skipped; an empty ``field`` gives no document.
    """

    def __init__(
        self,
        pattern: str,
        *,
        field: str = "text",
        split_bytes: int = 4 * 1024 * 1024,
        epochs: int | None = None,
        on_error: str = "raise",
        label: str | None = None,
    ) -> None:
        super().__init__(pattern, epochs=epochs, on_error=on_error, label=label)
        name = type(self).__name__
        if not isinstance(field, str) or not field:
            raise SpecError(f"{name}: field must be a non-empty string, got {field!r}")
        if isinstance(split_bytes, bool) or not isinstance(split_bytes, int) or split_bytes < 1:
            raise SpecError(f"{name}: split_bytes must be a positive integer, got {split_bytes!r}")
        self.field = field
        self.split_bytes = split_bytes

    def params(self) -> dict[str, Any]:
        return {**super().params(), "field": self.field, "split_bytes": self.split_bytes}

    # -- listing -----------------------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        splits: list[Split] = []
        for path in paths:
            size = self._size(path)
            if size == 0:
                raise DataError(
                    f"{self.operator_name}: {path} is empty (0 bytes); "
                    f"remove it or narrow the glob {self.pattern!r}"
                )
            if _is_compressed(path):
                splits.append(Split(path, 0, 0))
            else:
                step = self.split_bytes
                splits.extend(Split(path, s, min(s + step, size)) for s in range(0, size, step))
        return splits

    def _size(self, path: str) -> int:
        try:
            return os.path.getsize(path)
        except OSError as exc:
            raise self._unreadable(path, exc) from exc

    # -- reading -----------------------------------------------------------------------
    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        if _is_compressed(split.path):
            return self._read_compressed(split.path, position)
        return self._read_range(split, position)

    def _read_range(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        """Lines starting in ``[split.start, split.stop)``; positions are byte offsets."""
        if position != START and position < split.start:
            raise DataError(
                f"{self.operator_name}: position {position} lies before the split "
                f"[{split.start}, {split.stop}) of {split.path}"
            )
        try:
            with open(split.path, "rb") as fh:
                if position != START:
                    pos = position
                    fh.seek(pos)
                elif split.start == 0:
                    pos = 0
                else:
                    # The line running through byte start-1 belongs to the previous split.
                    fh.seek(split.start - 1)
                    pos = split.start - 1 + len(fh.readline())
                if pos >= split.stop:
                    return
                for line in fh:
                    offset, pos = pos, pos + len(line)
                    if line.strip():
                        yield pos, Record(line.removesuffix(b"\n"), split.path, f"byte {offset}", offset)
                    if pos >= split.stop:
                        return
        except OSError as exc:
            raise self._unreadable(split.path, exc) from exc

    def _read_compressed(self, path: str, position: int) -> Iterator[tuple[int, Record]]:
        """Every line of a compressed file; positions count lines (resuming re-reads the skip)."""
        if position != START and position < 0:
            raise DataError(f"{self.operator_name}: position {position} is not a line count ({path})")
        skip = 0 if position == START else position
        n = 0
        try:
            with _open_compressed(path) as fh:
                for line in fh:
                    n += 1
                    if n > skip and line.strip():
                        yield n, Record(line.removesuffix(b"\n"), path, f"line {n}", n)
        except _DECOMPRESSION_ERRORS as exc:
            raise self._unreadable(path, exc) from exc
        if n < skip:
            raise DataError(
                f"{self.operator_name}: cannot resume {path} after line {skip}: it holds only "
                f"{n} lines; did the file change since the checkpoint?"
            )

    def _unreadable(self, path: str, exc: BaseException) -> DataError:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return DataError(f"{self.operator_name}: cannot read {path}: {reason or type(exc).__name__}")

    # -- decoding (runs in workers on a pickled copy of this transform) ------------------
    def decode(self, record: Record, operator: str) -> list[Any]:
        where = f"{record.path} at {record.where}"
        payload: bytes = record.payload
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{operator}: {where} is not valid UTF-8: {exc.reason} "
                f"(0x{payload[exc.start]:02x}, {exc.start} bytes into the line)"
            ) from exc
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{operator}: malformed JSON in {where}: {exc.msg} (column {exc.colno})") from exc
        except RecursionError as exc:
            raise DataError(f"{operator}: malformed JSON in {where}: nested too deeply") from exc
        if not isinstance(obj, dict):
            raise DataError(
                f"{operator}: {where} holds a JSON {_json_type(obj)}, "
                f"not an object with the field {self.field!r}"
            )
        if self.field not in obj:
            raise DataError(
                f"{operator}: {where} has no field {self.field!r} (it has {_field_list(obj)}); "
                f"set field= to the field that holds the text"
            )
        value = obj[self.field]
        if not isinstance(value, str):
            raise DataError(
                f"{operator}: the field {self.field!r} in {where} is a JSON {_json_type(value)}, not a string"
            )
        return [value] if value else []


def _is_compressed(path: str) -> bool:
    return path.endswith(COMPRESSED_SUFFIXES)


def _open_compressed(path: str) -> io.BufferedIOBase:
    """A buffered reader of the decompressed bytes of a ``.gz`` or ``.zst`` file."""
    if path.endswith(".gz"):
        return gzip.GzipFile(path, "rb")
    return io.BufferedReader(_ZstdReader(path), buffer_size=_CHUNK)


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of every frame of a zstd file, refusing a truncated last frame.

    ``zstandard``'s own ``stream_reader`` ends quietly when the file stops inside a frame, which
    would drop the file's tail without a word; this reader raises ``ZstdError`` instead.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = self._dctx.decompressobj()
        self._in_frame = False  # bytes of the current frame have been fed
        self._out = memoryview(b"")  # decompressed, not yet handed out

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        while not self._out:
            chunk = self._file.read(_CHUNK)
            if not chunk:
                if self._in_frame:
                    raise zstandard.ZstdError("the file ends inside a frame (truncated?)")
                return 0
            self._out = memoryview(self._feed(chunk))
        target = memoryview(buffer).cast("B")
        n = min(len(target), len(self._out))
        target[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _feed(self, chunk: bytes) -> bytes:
        parts = []
        while chunk:
            parts.append(self._frame.decompress(chunk))
            self._in_frame = True
            if not self._frame.eof:
                break
            # A frame ended inside the chunk: the rest starts the next frame.
            chunk = self._frame.unused_data
            self._frame = self._dctx.decompressobj()
            self._in_frame = False
        return b"".join(parts)

    def close(self) -> None:
        self._file.close()
        super().close()


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _field_list(obj: dict[str, Any], limit: int = 10) -> str:
    names = [repr(k) for k in obj]
    if not names:
        return "no fields"
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
