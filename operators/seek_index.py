"""Seek indexes of compressed files: where a ``.gz`` or ``.zst`` stream can be entered mid-file.

A seek index lists *seek points* ``(compressed offset, decompressed offset)`` at which reading can
start without decompressing what comes before. It is built once per file and cached on disk
under ``ZEPHON_CACHE_DIR`` (default ``~/.cache/zephon-flow/index``), keyed by the path, size,
modification time, a hash of the first and last MiB and the index's own parameters, and written
atomically (a temporary file renamed into place), so later runs and other processes reuse it.

- **zstd, many frames** (``zstd -B``/``--block-size`` outputs, pzstd, seekable zstd): every frame
  is a seek point. The frames are found by walking frame and block headers, reading a few bytes
  per block and no data; only frames whose header omits the content size are decompressed, once,
  to learn it.
- **gzip**: ``indexed_gzip`` (zlib licence; wheels for CPython 3.11) builds a zran index in one
  decompression pass: every ``spacing`` bytes of output it stores the 32 KiB window the
  inflater needs, so reading starts at any seek point. Python's own ``zlib`` cannot prime the
  bit position of a deflate block, so a zran index cannot be written with it alone.
  ``rapidgzip`` (MIT/Apache-2.0) builds the same kind of index in parallel but ships a 9 MB
  C++ wheel; with two cores shared the single-threaded ``indexed_gzip`` was chosen.
- **zstd, one frame**: a frame is one window-dependent stream; there is no seek point inside it
  without storing the decoder's whole window per point. Such a file is one split.

``BUILDS`` counts the decompression (or header walking) passes done by this process, so tests
can tell a cache hit from a rebuild.
"""

from __future__ import annotations

import gzip
import io
import os
import struct
from dataclasses import dataclass
from typing import IO, cast

import indexed_gzip
import zstandard

from zephon_flow.core import files
from zephon_flow.core.errors import DataError
from zephon_flow.operators import _file_cache
from zephon_flow.operators._file_cache import cache_dir

#: Bumped whenever the index format or its meaning changes: old cache entries are not read.
INDEX_VERSION = 1
#: Decompressed bytes between two gzip seek points, at least (more for big files, see MAX_POINTS).
GZIP_SPACING = 1 << 20
#: Seek points a gzip index keeps at most (each holds a 32 KiB window).
MAX_POINTS = 1024
_ZSTD_MAGIC = 0xFD2FB528
_CHUNK = 1 << 16

#: Index builds (decompression or header-walking passes) done by this process.
BUILDS = 0


@dataclass(frozen=True)
class SeekIndex:
    """The seek points of one compressed file (``kind`` ``"zstd"`` or ``"gzip"``), its decompressed
    size, and for gzip the cached zran index file; ``points`` has one entry, (0, 0), when the
    file cannot be entered in the middle, and then ``reason`` says why."""

    kind: str
    points: tuple[tuple[int, int], ...]
    size: int
    reason: str = ""
    gzip_index: str = ""

    @property
    def splittable(self) -> bool:
        return len(self.points) > 1


def index_for(path: str, *, operator: str) -> SeekIndex:
    """The seek index of a ``.gz`` or ``.zst`` file, from the cache or built (and cached) now.

    A file that cannot be indexed (damaged, truncated) gets a one-point index whose ``reason``
    says why: it is still read whole, and the damage is raised where reading reaches it.
    """
    info = files.stat(path, operator=operator)
    kind = "gzip" if path.endswith(".gz") else "zstd"
    spacing = max(GZIP_SPACING, info.size * 4 // MAX_POINTS) if kind == "gzip" else 0
    key = _cache_key(path, info, kind, spacing, operator)
    meta = key + ".json"
    found = _load(meta)
    if found is not None:
        return found
    global BUILDS
    BUILDS += 1
    gz_file = os.path.join(cache_dir(), key + ".gzidx")
    try:
        index = (
            _build_gzip(path, spacing, gz_file, operator) if kind == "gzip" else _build_zstd(path, operator)
        )
    except DataError:
        raise  # the file is gone, or the cache cannot be written: not a property of the data
    except (OSError, EOFError, ValueError, indexed_gzip.ZranError, zstandard.ZstdError, _Malformed) as exc:
        index = SeekIndex(kind, ((0, 0),), -1, reason=f"cannot be indexed ({exc or type(exc).__name__})")
    _store(meta, index)
    return index


def open_at(path: str, index: SeekIndex, offset: int, *, operator: str) -> IO[bytes]:
    """A reader of the decompressed bytes of ``path``, positioned at decompressed ``offset``
    (from the last seek point at or before it, decompressing and dropping the rest)."""
    c_off, d_off = max((p for p in index.points if p[1] <= offset), key=lambda p: p[1])
    if index.kind == "gzip" and index.splittable:
        fh = _IndexedGzip(files.open_binary(path, operator=operator), index.gzip_index)
        fh.seek(offset)
        return fh
    raw = files.open_binary(path, operator=operator)
    reader: IO[bytes]
    if index.kind == "gzip":
        gz = gzip.GzipFile(fileobj=raw)
        gz.myfileobj = raw  # type: ignore[assignment]  # closed with the reader
        reader = cast(IO[bytes], gz)
    else:
        raw.seek(c_off)
        reader = ZstdFrames(raw)
    _discard(reader, offset - d_off)
    return reader


class ZstdFrames(io.BufferedReader):
    """Buffered decompressed bytes of consecutive zstd frames from a raw reader's position."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__(_ZstdRaw(raw), buffer_size=_CHUNK)


class _IndexedGzip(indexed_gzip.IndexedGzipFile):  # type: ignore[misc]
    """An ``IndexedGzipFile`` over a raw reader it closes, with a cached index imported."""

    def __init__(self, raw: IO[bytes], index_file: str) -> None:
        # Its default buffer is 4 x spacing (4 MiB and up): a split read would inflate megabytes
        # past its end; each read call has a fixed cost, so not much smaller either.
        super().__init__(fileobj=raw, index_file=index_file, auto_build=False, buffer_size=1 << 20)
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


# -- building ----------------------------------------------------------------------------


class _Malformed(Exception):
    """A frame or block header that does not parse."""


def _build_gzip(path: str, spacing: int, out: str, operator: str) -> SeekIndex:
    with files.open_binary(path, operator=operator) as raw:
        fh = indexed_gzip.IndexedGzipFile(fileobj=raw, spacing=spacing, auto_build=True)
        try:
            fh.build_full_index()
            size = fh.seek(0, os.SEEK_END)
            points = tuple((int(c), int(u)) for u, c in fh.seek_points())
            try:
                files.atomic_write(out, lambda f: fh.export_index(fileobj=f))
            except OSError as exc:
                # Not a fallback to reading whole: the plan must not depend on the machine.
                raise DataError(
                    f"{operator}: cannot write the seek index of {path} under {cache_dir()}: "
                    f"{exc.strerror or exc}; set ZEPHON_CACHE_DIR to a writable directory"
                ) from exc
        finally:
            fh.close()
    trailer = files.read_bytes(path, max(0, files.size(path, operator=operator) - 4), 4, operator=operator)
    if len(trailer) != 4 or struct.unpack("<I", trailer)[0] != size & 0xFFFFFFFF:
        # indexed_gzip stops quietly where a truncated file ends; the trailer's ISIZE tells.
        raise _Malformed(
            "its trailer does not match the data: truncated, or several gzip members, which are read whole"
        )
    points = tuple(p for p in points if p[1] < size)  # a point at the very end leads nowhere
    if not points or points[0][1] != 0:
        points = ((0, 0), *points)
    if len(points) == 1:
        return SeekIndex("gzip", points, size, reason=f"gzip of {size} bytes: one seek point")
    return SeekIndex("gzip", points, size, gzip_index=out)


def _build_zstd(path: str, operator: str) -> SeekIndex:
    frames = _zstd_frames(path, operator)
    if any(d < 0 for _, _, d in frames):
        frames = _measure_frames(path, frames, operator)
    points: list[tuple[int, int]] = []
    d_off = 0
    for c_off, _, d_size in frames:
        if d_size > 0 or not points:
            points.append((c_off, d_off))
        d_off += d_size
    if len(points) == 1:
        return SeekIndex("zstd", ((0, 0),), d_off, reason="single-frame zstd: no seek points")
    return SeekIndex("zstd", tuple(points), d_off)


def _zstd_frames(path: str, operator: str) -> list[tuple[int, int, int]]:
    """``(offset, compressed length, content size or -1)`` of every zstd frame, skippable frames
    left out, read from frame and block headers only."""
    frames: list[tuple[int, int, int]] = []
    with files.open_binary(path, operator=operator) as fh:
        end = fh.seek(0, os.SEEK_END)
        pos = 0
        while pos < end:
            fh.seek(pos)
            head = fh.read(18)
            if len(head) < 4:
                raise _Malformed(f"{end - pos} stray bytes at byte {pos}")
            (magic,) = struct.unpack_from("<I", head)
            if 0x184D2A50 <= magic <= 0x184D2A5F:  # skippable frame
                pos += 8 + struct.unpack_from("<I", head, 4)[0]
                continue
            if magic != _ZSTD_MAGIC:
                raise _Malformed(f"no zstd frame at byte {pos}")
            start = pos
            fhd = head[4]
            single, checksum = bool(fhd & 0x20), bool(fhd & 0x04)
            dict_len = (0, 1, 2, 4)[fhd & 0x03]
            fcs_len = (1 if single else 0, 2, 4, 8)[fhd >> 6]
            at = 5 + (0 if single else 1) + dict_len
            content = -1
            if fcs_len:
                raw_fcs = head[at : at + fcs_len]
                content = int.from_bytes(raw_fcs, "little") + (256 if fcs_len == 2 else 0)
            pos += at + fcs_len
            while True:
                fh.seek(pos)
                bh = fh.read(3)
                if len(bh) < 3:
                    raise _Malformed(f"the file ends inside the frame at byte {start}")
                word = int.from_bytes(bh, "little")
                kind, bsize = (word >> 1) & 3, word >> 3
                if kind == 3:
                    raise _Malformed(f"reserved block type at byte {pos}")
                pos += 3 + (1 if kind == 1 else bsize)
                if word & 1:
                    break
            pos += 4 if checksum else 0
            if pos > end:
                raise _Malformed(f"the file ends inside the frame at byte {start}")
            frames.append((start, pos - start, content))
    return frames


def _measure_frames(
    path: str, frames: list[tuple[int, int, int]], operator: str
) -> list[tuple[int, int, int]]:
    """The frames with every unknown content size found by decompressing that frame."""
    out = []
    dctx = zstandard.ZstdDecompressor()
    with files.open_binary(path, operator=operator) as fh:
        for c_off, c_len, d_size in frames:
            if d_size < 0:
                fh.seek(c_off)
                obj, d_size = dctx.decompressobj(), 0
                left = c_len
                while left:
                    chunk = fh.read(min(_CHUNK, left))
                    left -= len(chunk)
                    d_size += len(obj.decompress(chunk))
            out.append((c_off, c_len, d_size))
    return out


# -- the cache ---------------------------------------------------------------------------


def _cache_key(path: str, info: files.FileInfo, kind: str, spacing: int, operator: str) -> str:
    kind = f"seek-index {INDEX_VERSION} {kind} {spacing}"
    return _file_cache.stat_key(
        path, info, kind, operator=operator, notes="seek", stat=_file_cache.stat_of(path)
    )


def _load(meta: str) -> SeekIndex | None:
    d = _file_cache.load_json(meta)
    if d is None:
        return None
    try:
        index = SeekIndex(
            str(d["kind"]),
            tuple((int(c), int(u)) for c, u in d["points"]),
            int(d["size"]),
            str(d["reason"]),
            str(d["gzip_index"]),
        )
    except (ValueError, KeyError, TypeError):
        return None  # unreadable: rebuilt and rewritten
    if index.gzip_index and not os.path.exists(index.gzip_index):
        return None
    return index


def _store(meta: str, index: SeekIndex) -> None:
    entry = {
        "kind": index.kind,
        "points": [list(p) for p in index.points],
        "size": index.size,
        "reason": index.reason,
        "gzip_index": index.gzip_index,
    }
    _file_cache.store_json(meta, entry)  # a read-only cache only costs a rebuild next time


# -- reading -----------------------------------------------------------------------------


def _discard(reader: IO[bytes], n: int) -> None:
    while n > 0:
        got = len(reader.read(min(n, _CHUNK)))
        if not got:
            raise EOFError(f"the stream ends {n} bytes before the resume point")
        n -= got


class _ZstdRaw(io.RawIOBase):
    """The decompressed bytes of every frame from the raw reader's position, refusing a
    truncated last frame (``zstandard``'s ``stream_reader`` would end quietly)."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._file = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = self._dctx.decompressobj()
        self._in_frame = False
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
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
            chunk = self._frame.unused_data
            self._frame = self._dctx.decompressobj()
            self._in_frame = False
        return b"".join(parts)

    def close(self) -> None:
        self._file.close()
        super().close()
