"""ReadTextFiles: a source of text documents, one document per file, plain or gzip compressed."""

from __future__ import annotations

import codecs
import gzip
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from zephon_flow.core import files
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Record, Source, Split
from zephon_flow.operators import _plan

#: The fewest files an automatic plan puts in a split.
MIN_SPLIT_FILES = 1

#: Where a text file's record says it is: the file is the record.
WHOLE_FILE = "(the whole file)"

# What a damaged gzip stream raises besides OSError (gzip.BadGzipFile is an OSError).
_GZIP_ERRORS = (OSError, EOFError, zlib.error)


class ReadTextFiles(Source):
    """Documents that are whole files: each file matching ``pattern`` is one document.

    Meant for corpora of many small files (one article, one source file each). Files ending in
    ``.gz`` are decompressed. The text is decoded with ``encoding`` (strictly; no replacement).

    - **Splits**: runs of consecutive files of the sorted glob, dealt like records: about the
      file count over ``SPLITS_PER_LANE`` splits per lane, so 10,000 files and 2 lanes make 16
      runs, and one file per split only when files are few. ``Split(first_path, i, j)``
      covers files ``i..j-1`` of the glob, weighted by their count; listing opens and stats
      no file.
    - **Positions**: the number of the next file of the glob to read (files consumed); a
      record's ``offset`` is its file's number in the glob.
    - **Reading**: ``read_split`` only names the files; ``decode``, which runs in parallel on the
      backend's workers, opens and reads each. So the lane's feed never waits on file I/O, and
      a file is opened exactly once per epoch, with no other system call about it.
    - **Documents**: a file whose decoded text is empty (e.g. a ``.gz`` of nothing) gives none.
    - **Epochs**: ``epochs=None`` reads forever, each epoch dealing the files anew; with a number,
      a lane's stream of this source ends after that many passes.
    - **Errors** (``DataError`` from ``decode``, naming the file and this operator): a zero-byte
      file is bad input (usually an interrupted write), as are text that does not decode (the
      message gives the byte offset, in the decompressed text for ``.gz``), a damaged ``.gz``
      and a file that cannot be opened. With ``on_error="skip"`` the runner drops that file.
    """

    #: A record's offset is a position ``read_split`` starts at (see ``Source``).
    rereads_offsets = True

    def __init__(
        self,
        pattern: str,
        *,
        encoding: str = "utf-8",
        epochs: int | None = None,
        on_error: str = "raise",
        label: str | None = None,
    ) -> None:
        super().__init__(pattern, epochs=epochs, on_error=on_error, label=label)
        name = type(self).__name__
        try:
            codecs.lookup(encoding)
        except (LookupError, TypeError) as exc:
            raise SpecError(f"{name}: encoding {encoding!r} is not a text encoding Python knows") from exc
        self.encoding = encoding

    def params(self) -> dict[str, Any]:
        return {**super().params(), "encoding": self.encoding, "split_plan": _plan.PLAN_VERSION}

    # -- listing and reading -------------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        size = _plan.target(len(paths), lanes, MIN_SPLIT_FILES)
        bounds = list(range(len(paths) + 1))
        return [Split(paths[i], i, j) for i, j in _plan.ranges(bounds, size, refine=False)] if paths else []

    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        paths = self.paths()
        first = split.start if position == START else position
        if not split.start <= first <= split.stop:
            raise DataError(
                f"{self.operator_name}: cannot resume files [{split.start}, {split.stop}) from "
                f"{split.path} at file {first}; did the files change since the checkpoint?"
            )
        if split.stop > len(paths) or paths[split.start] != split.path:
            raise DataError(
                f"{self.operator_name}: file {split.start} of {self.pattern!r} is no longer "
                f"{split.path}; did the files change since the splits were listed?"
            )
        return self._files(paths, first, split.stop)

    @staticmethod
    def _files(paths: list[str], first: int, stop: int) -> Iterator[tuple[int, Record]]:
        for k in range(first, stop):
            yield k + 1, Record(None, paths[k], WHOLE_FILE, k)

    # -- decoding (runs in workers on a pickled copy of this transform) ------------------
    def decode(self, record: Record, operator: str) -> list[Any]:
        path = record.path
        data = self._read(path, operator)
        try:
            text = data.decode(self.encoding)
        except UnicodeDecodeError as exc:
            where = "byte" if not path.endswith(".gz") else "decompressed byte"
            raise DataError(
                f"{operator}: {path} is not valid {self.encoding} at {where} {exc.start}: {exc.reason} "
                f"(0x{data[exc.start]:02x})"
            ) from exc
        return [text] if text else []

    @staticmethod
    def _read(path: str, operator: str) -> bytes:
        try:
            with files.open_binary(path, operator=operator) as fh:
                raw = fh.read()
            if not raw:
                raise DataError(
                    f"{operator}: {path} is empty (0 bytes); an empty file is treated as bad input "
                    "(an interrupted write?): remove it or narrow the glob"
                )
            return gzip.decompress(raw) if path.endswith(".gz") else raw
        except _GZIP_ERRORS as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise DataError(f"{operator}: cannot read {path}: {reason or type(exc).__name__}") from exc
