"""ReadTextFiles: a source of text documents, one document per file, plain or gzip compressed."""

from __future__ import annotations

import codecs
import gzip
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from zephon_flow.errors import DataError, SpecError
from zephon_flow.operators.splits import START, Record, Source, Split

#: Where a text file's record says it is: the file is the record.
WHOLE_FILE = "(the whole file)"

# What a damaged gzip stream raises besides OSError (gzip.BadGzipFile is an OSError).
_GZIP_ERRORS = (OSError, EOFError, zlib.error)


class ReadTextFiles(Source):
    """Documents that are whole files: each file matching ``pattern`` is one document.

    Meant for corpora of many small files (one article, one source file each). Files ending in
    ``.gz`` are decompressed. The text is decoded with ``encoding`` (strictly; no replacement).

    - **Splits**: one per file, ``Split(path, 0, 1)``, listed once from the sorted glob; listing
      opens no file (the glob and the pipeline fingerprint stat each file once, at start).
    - **Positions**: ``START`` (the file is still to read) or ``1`` (it was read); a record's
      ``offset`` is always 0.
    - **Reading**: ``read_split`` only names the file; ``decode``, which runs in parallel on the
      backend's workers, opens and reads it. So the lane's feed never waits on file I/O, and
      a file is opened exactly once per epoch, with no other system call about it.
    - **Documents**: a file whose decoded text is empty (e.g. a ``.gz`` of nothing) gives none.
    - **Epochs**: ``epochs=None`` reads forever, each epoch dealing the files anew; with a number,
      a lane's stream of this source ends after that many passes.
    - **Errors** (``DataError`` from ``decode``, naming the file and this operator): a zero-byte
      file is bad input (usually an interrupted write), as are text that does not decode (the
      message gives the byte offset, in the decompressed text for ``.gz``), a damaged ``.gz``
      and a file that cannot be opened. With ``on_error="skip"`` the runner drops that file.
    """

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
        return {**super().params(), "encoding": self.encoding}

    # -- listing and reading -------------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        return [Split(path, 0, 1) for path in paths]

    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        if position not in (START, 1):
            raise DataError(
                f"{self.operator_name}: cannot resume {split.path} at position {position}: "
                "a file is one document, so the only position after its start is 1"
            )
        if position == START:
            yield 1, Record(None, split.path, WHOLE_FILE, 0)

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
            with open(path, "rb") as fh:
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
