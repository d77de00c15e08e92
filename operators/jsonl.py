"""ReadJsonl: a source of text documents from JSON Lines files, plain or gzip/zstd compressed."""

from __future__ import annotations

import io
import json
import logging
import sys
import zlib
from collections.abc import Iterator, Sequence
from typing import IO, Any

import indexed_gzip
import orjson
import zstandard

from zephon_flow.core import files
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Record, Source, Split
from zephon_flow.operators import _plan, seek_index
from zephon_flow.operators._plan import PLAN_VERSION
from zephon_flow.operators.seek_index import SeekIndex

#: Suffixes of compressed files, entered mid-file through a seek index (``seek_index``).
COMPRESSED_SUFFIXES = (".gz", ".zst")
#: The smallest byte range an automatic plan cuts (decompressed bytes for compressed files).
MIN_SPLIT_BYTES = 256 * 1024
#: The read buffer of an uncompressed file (at most its split's size): lines of a few KB then
#: cost one read per many lines, not several per line (Python's default buffer is 8 KiB).
LINE_BUFFER = 256 * 1024

# What a damaged compressed stream raises besides OSError (gzip.BadGzipFile is an OSError).
_DECOMPRESSION_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError, indexed_gzip.ZranError)
_CHUNK = 1 << 16
_log = logging.getLogger("zephon_flow.sources")
#: A compressed file without seek points is read whole by every lane that shares it. Below this
#: many bytes (decompressed) that costs each lane well under a second, so the automatic plan
#: says nothing about it; with an explicit ``split_bytes`` it is said whatever the size.
QUIET_WHOLE_BYTES = 16 * 1024 * 1024
#: The files already said to be read whole in this process (path, size): said once each.
_said_whole: set[tuple[str, int]] = set()


class ReadJsonl(Source):
    """Documents from the string field ``field`` of JSON objects, one object per line.

    - **Splits**: byte ranges ``[start, stop)``, sized from the total of all files and the lane
      count (about ``SPLITS_PER_LANE`` per lane, at least ``MIN_SPLIT_BYTES``), or exactly
      ``split_bytes`` when given. A range owns the lines whose first byte lies in it, so ranges
      are cut without scanning the file; a split looks for its first line start only up to its
      ``stop``, so a line longer than many splits is read once, by the split it starts in.
    - **Compressed** (``.gz``, ``.zst``): the ranges are of decompressed bytes, cut at the seek
      points of the file's cached seek index (``seek_index``: zstd frames, a zran index for
      gzip). A file without seek points (one zstd frame, a damaged stream) is one split
      ``[0, 0)`` weighted by its decompressed size (its size on disk if unknown), which the
      dealer shares among lanes by stride; a warning names the file and why. A compressed
      range owns the lines starting in ``(start, stop]`` (the first range also the line at 0),
      so it opens at its seek point and never needs the byte before it.
    - **Positions**: the (decompressed) byte offset of the next line to read; resuming seeks
      there (from the nearest seek point for a compressed file). A record's ``offset`` is the
      byte offset of its line.
    - Lines holding only whitespace are skipped; an empty ``field`` gives no document.
    - A UTF-8 byte order mark at the start of a file (as some Windows tools write) is ignored;
      anywhere else it is malformed JSON.
    """

    #: A record's offset is a position ``read_split`` starts at (see ``Source``).
    rereads_offsets = True

    def __init__(
        self,
        pattern: str,
        *,
        field: str = "text",
        split_bytes: int | None = None,
        epochs: int | None = None,
        on_error: str = "raise",
        label: str | None = None,
    ) -> None:
        super().__init__(pattern, epochs=epochs, on_error=on_error, label=label)
        name = type(self).__name__
        if not isinstance(field, str) or not field:
            raise SpecError(f"{name}: field must be a non-empty string, got {field!r}")
        if split_bytes is not None and (
            isinstance(split_bytes, bool) or not isinstance(split_bytes, int) or split_bytes < 1
        ):
            raise SpecError(f"{name}: split_bytes must be a positive integer or None, got {split_bytes!r}")
        self.field = field
        self.split_bytes = split_bytes
        #: Files left out at listing under ``on_error="skip"``.
        self.skipped_files: list[str] = []
        self._indexes: dict[str, SeekIndex] = {}

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "field": self.field,
            "split_bytes": self.split_bytes,
            "split_plan": PLAN_VERSION,
        }

    # -- listing -----------------------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        skipped: list[str] = []
        listed = files.list_each(
            paths, self._list_file, on_error=self.on_error, operator=self.operator_name, skipped=skipped
        )
        self.skipped_files = skipped
        total = sum(weight for _, weight, _ in listed)
        size = self.split_bytes or _plan.target(total, lanes, MIN_SPLIT_BYTES)
        splits: list[Split] = []
        for path, weight, bounds in listed:
            if bounds is None:  # compressed, no seek points: one split, shared by stride
                splits.append(Split(path, 0, 0, weight))
                if self._worth_saying_whole(path, weight, size):
                    _log.warning(
                        "%s: %s is read whole (%s); lanes share it by stride, each decompressing all of it",
                        self.operator_name,
                        path,
                        self._index(path).reason,
                    )
            elif self.split_bytes is not None and not _is_compressed(path):
                splits.extend(Split(path, s, min(s + size, weight)) for s in range(0, weight, size))
            else:
                refine = not _is_compressed(path)
                splits.extend(Split(path, a, b) for a, b in _plan.ranges(bounds, size, refine=refine))
        return splits

    def _worth_saying_whole(self, path: str, weight: int, size: int) -> bool:
        """Whether to warn that ``path`` (``weight`` bytes, no seek points) is read whole: it is
        heavier than a split should be, and large enough to matter or split finer on request;
        once per file and size per process (a plan is made by every loader and rank)."""
        if weight <= size or (self.split_bytes is None and weight < QUIET_WHOLE_BYTES):
            return False
        key = (path, weight)
        if key in _said_whole:
            return False
        _said_whole.add(key)
        return True

    def _list_file(self, path: str) -> list[tuple[str, int, list[int] | None]]:
        """``(path, weight, allowed cut points or None)``; refuses an empty file."""
        info = files.stat(path, operator=self.operator_name)
        if info.size == 0:
            raise DataError(
                f"{self.operator_name}: {path} is empty (0 bytes); "
                f"remove it or narrow the glob {self.pattern!r}"
            )
        if not _is_compressed(path):
            return [(path, info.size, [0, info.size])]
        index = self._index(path)
        if not index.splittable:
            return [(path, index.size if index.size > 0 else info.size, None)]
        return [(path, index.size, [d for _, d in index.points] + [index.size])]

    def _index(self, path: str) -> SeekIndex:
        index = self._indexes.get(path)
        if index is None:
            index = seek_index.index_for(path, operator=self.operator_name)
            self._indexes = {**self._indexes, path: index}  # assigned whole: feeds list concurrently
        return index

    # -- reading -----------------------------------------------------------------------
    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        whole = split.stop <= split.start
        stop = sys.maxsize if whole else split.stop
        if position != START and position < split.start:
            raise DataError(
                f"{self.operator_name}: position {position} lies before the split "
                f"[{split.start}, {split.stop}) of {split.path}; did the file change since the checkpoint?"
            )
        if whole and _is_compressed(split.path) and position != START:
            size = self._index(split.path).size
            if 0 <= size < position:
                raise DataError(
                    f"{self.operator_name}: cannot resume {split.path} at decompressed byte {position}: "
                    f"it holds only {size} bytes; did the file change since the checkpoint?"
                )
        return self._lines(split, position, stop)

    def _lines(self, split: Split, position: int, stop: int) -> Iterator[tuple[int, Record]]:
        """The split's lines, from one reader; positions are (decompressed) byte offsets.

        A plain range owns the lines starting in ``[start, stop)``, a compressed one those
        starting in ``(start, stop]`` (the first from 0): its start is a seek point, so
        the reader opens there and the byte before it is never needed.
        """
        path = split.path
        compressed = _is_compressed(path)
        unit = "decompressed byte" if compressed else "byte"
        lo, hi = split.start, stop
        if compressed:
            lo, hi = (split.start + 1 if split.start else 0), stop + 1
        pos, n = (lo if position == START else position), 0
        try:
            with self._open_at(path, pos - 1 if position == START and lo > 0 else pos, hi - pos) as fh:
                if position == START and lo > 0:
                    pos = _after_newline(fh, lo - 1, hi)  # the line through byte lo-1 is not ours
                for line in fh if pos < hi else ():
                    offset, pos, n = pos, pos + len(line), n + 1
                    if not line.isspace():  # what strip() would leave empty, without its copy
                        yield pos, Record(line.removesuffix(b"\n"), path, f"{unit} {offset}", offset)
                    if pos >= hi:
                        return
        except _DECOMPRESSION_ERRORS as exc:
            if not compressed:
                raise self._unreadable(path, exc) from exc
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise DataError(
                f"{self.operator_name}: cannot read {path}: {reason or type(exc).__name__}, at "
                f"decompressed byte {pos} (after line {n} of the split from decompressed byte "
                f"{split.start}); the file is truncated or damaged there"
            ) from exc

    def _open_at(self, path: str, offset: int, span: int) -> IO[bytes]:
        """A reader at ``offset`` for about ``span`` bytes (its buffer reads no more than that
        ahead, so the splits inside one huge line do not each read far past their own)."""
        if not _is_compressed(path):
            buffering = min(LINE_BUFFER, max(io.DEFAULT_BUFFER_SIZE, span))
            fh = files.open_binary(path, operator=self.operator_name, buffering=buffering)
            fh.seek(offset)
            return fh
        return seek_index.open_at(path, self._index(path), offset, operator=self.operator_name)

    def _unreadable(self, path: str, exc: BaseException) -> DataError:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return DataError(f"{self.operator_name}: cannot read {path}: {reason or type(exc).__name__}")

    # -- decoding (runs in workers on a pickled copy of this transform) ------------------
    def decode(self, record: Record, operator: str) -> list[Any]:
        try:
            obj = orjson.loads(record.payload)  # about twice as fast as json on documents
        except orjson.JSONDecodeError:
            obj = _loads_leniently(record, operator)
        if isinstance(obj, dict) and isinstance(value := obj.get(self.field), str):
            return [value] if value else []
        raise self._no_text(obj, record, operator)

    def _no_text(self, obj: Any, record: Record, operator: str) -> DataError:
        """Why a decoded line gives no text: not an object, no such field, or not a string."""
        where = _where(record)
        if not isinstance(obj, dict):
            return DataError(
                f"{operator}: {where} holds a JSON {_json_type(obj)}, "
                f"not an object with the field {self.field!r}"
            )
        if self.field not in obj:
            return DataError(
                f"{operator}: {where} has no field {self.field!r} (it has {_field_list(obj)}); "
                f"set field= to the field that holds the text"
            )
        return DataError(
            f"{operator}: the field {self.field!r} in {where} is a JSON {_json_type(obj[self.field])}, "
            f"not a string"
        )


def _where(record: Record) -> str:
    """A record's place for an error: its file and offset."""
    return f"{record.path} at {record.where}"


_BOM = b"\xef\xbb\xbf"


def _loads_leniently(record: Record, operator: str) -> Any:
    """A line ``orjson`` refused, through the standard library's ``json``: it also accepts what
    ``orjson`` does not (``NaN``, ``Infinity``, a lone surrogate escape), as ``ReadJsonl`` always
    has, and its errors name the column. A bad line is a ``DataError`` naming file and offset."""
    payload: bytes = record.payload
    if record.offset == 0 and payload.startswith(_BOM):  # the file's first line: not JSON's
        payload = payload[len(_BOM) :]
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{operator}: {_where(record)} is not valid UTF-8: {exc.reason} "
            f"(0x{payload[exc.start]:02x}, {exc.start} bytes into the line)"
        ) from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{operator}: malformed JSON in {_where(record)}: {exc.msg} (column {exc.colno})"
        ) from exc
    except RecursionError as exc:
        raise DataError(f"{operator}: malformed JSON in {_where(record)}: nested too deeply") from exc


def _after_newline(fh: IO[bytes], pos: int, hi: int) -> int:
    """Reads from ``pos`` through the next newline, never past ``hi``: the offset after it, or
    ``hi`` when no line starts before ``hi`` (so a huge line is not read by every split in it)."""
    while pos < hi:
        part = fh.readline(min(_CHUNK, hi - pos))
        if not part:
            return hi
        pos += len(part)
        if part.endswith(b"\n"):
            return pos
    return hi


def _is_compressed(path: str) -> bool:
    return path.endswith(COMPRESSED_SUFFIXES)


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
