"""The file of checkpoint format 3 (``FORMAT_VERSION``; every version after ``blob.BLOB_VERSION``
has this layout): written and read lane by lane, compressed, optionally incremental.

Layout::

    MAGIC | u32 version (3)
    frame 0: the header (kind, step, lanes, fingerprint, mix history, lane ids, base)
    then per lane (in ``lane_ids`` order): its state, and its row index (digests of the rows
    of its element lists; a child checkpoint reads only these from its base)
    sha256 of every byte before it

A frame is ``u64 compressed length | u64 raw length | zstd(frame_encode.Frame)``. Writing holds one
lane's encoding at a time; reading first checks the digest (one pass over the bytes, in
blocks), then decodes one lane at a time. An incremental checkpoint names its base (a path relative to its
own directory, and the base's sha256): its lists of like elements store the rows found in the
base's same lane and place as references; loading loads the base first (following its own
base, if any) and refuses a base that is missing or was altered, naming it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

import zstandard

from zephon_flow.core.checkpoint import FORMAT_VERSION, blob, frame_decode, frame_encode
from zephon_flow.core.checkpoint.derived_fields import DerivedCodecs
from zephon_flow.core.checkpoint.packed_segments import BUILTIN
from zephon_flow.core.errors import CorruptStateError, FormatVersionError, StateError

_VERSION_HEAD = struct.Struct("<8sI")
_FRAME_HEAD = struct.Struct("<QQ")
_DIGEST = 32
_LEVEL = 1
#: A frame may not claim to decompress to more than this many times its compressed size.
_MAX_RATIO = 20_000
#: A chain of incremental checkpoints longer than this is refused (and cycles with it).
MAX_CHAIN = 64


@dataclass(frozen=True)
class Base:
    """The checkpoint an incremental one refers to: its path and its sha256."""

    path: str
    digest: str


@dataclass
class WriteStats:
    """What a write did: bytes written, raw state bytes encoded, rows stored by reference."""

    written: int = 0
    #: The frames' bytes before compression (narrowed, derived fields left out).
    uncompressed: int = 0
    raw_bytes: int = 0
    rows_total: int = 0
    rows_from_base: int = 0
    digest: str = ""


class _HashingWriter:
    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.hash, self.count = out, hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> None:
        self.hash.update(data)
        self.out.write(data)
        self.count += len(data)


def _encoded(frame: frame_encode.Frame, value: Any) -> list[bytes | memoryview]:
    """A frame's pieces, uncompressed: its header, then its payload buffers."""
    return [frame.encode(value), *frame.payload]


def _write_frame(out: _HashingWriter, pieces: list[bytes | memoryview]) -> int:
    compressor = zstandard.ZstdCompressor(level=_LEVEL).compressobj()
    parts: list[bytes] = []
    raw = 0
    for chunk in pieces:
        raw += len(chunk)
        parts.append(compressor.compress(chunk))
    parts.append(compressor.flush())
    out.write(_FRAME_HEAD.pack(sum(len(p) for p in parts), raw))
    for p in parts:
        out.write(p)
    return raw


def _write_pair(out: _HashingWriter, state: list[bytes | memoryview], index: list[bytes | memoryview]) -> int:
    return _write_frame(out, state) + _write_frame(out, index)


def write(
    header: dict[str, Any],
    lanes: Iterator[tuple[int, dict[str, Any]]],
    out: IO[bytes],
    *,
    base: tuple[Base, dict[int, frame_encode.RowIndex]] | None = None,
    codecs: DerivedCodecs = BUILTIN,
) -> WriteStats:
    """Writes a checkpoint: ``header`` (without lane states, with ``lane_ids``), then each lane's
    plain state, in ``lane_ids`` order, encoded and compressed one at a time.

    ``base`` (the base's name and digest, and its row digests per lane) makes it incremental;
    ``codecs`` leave out the derived fields they rebuild.
    """
    stream = _HashingWriter(out)
    stream.write(_VERSION_HEAD.pack(blob.MAGIC, FORMAT_VERSION))
    head = dict(header)
    head["base"] = None if base is None else {"path": base[0].path, "digest": base[0].digest}
    stats = WriteStats()
    stats.uncompressed += _write_frame(stream, _encoded(frame_encode.Frame(), head))
    # Lane k is compressed and written on a second thread (zstd and file writes release the
    # GIL) while lane k+1 is encoded here: at most one encoded lane waits.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="zephon-state-writer") as writer:
        pending: Future[int] | None = None
        for lane, plain in lanes:
            frame = frame_encode.Frame(base=None if base is None else base[1].get(lane), codecs=codecs)
            pieces = _encoded(frame, plain)
            pieces_index = _encoded(frame_encode.Frame(), frame_encode.index_tree(frame))
            if pending is not None:
                stats.uncompressed += pending.result()
            pending = writer.submit(_write_pair, stream, pieces, pieces_index)
            del pieces, pieces_index
            stats.raw_bytes += frame.raw_bytes
            stats.rows_total += frame.rows_total
            stats.rows_from_base += frame.rows_from_base
        if pending is not None:
            stats.uncompressed += pending.result()
    digest = stream.hash.digest()
    out.write(digest)
    stats.written = stream.count + len(digest)
    stats.digest = digest.hex()
    return stats


# -- reading --------------------------------------------------------------------------------
def verify(stream: IO[bytes], source: str) -> str:
    """Checks the sha256 at the end of a (seekable) checkpoint stream before anything is decoded,
    reading it in blocks; returns it (hex) and leaves the stream where it was."""
    start = stream.tell()
    end = stream.seek(0, os.SEEK_END)
    if end - start < _DIGEST:
        raise CorruptStateError(f"{source}: checksum mismatch, the bytes are corrupt or truncated")
    stream.seek(0)
    digest = hashlib.sha256()
    left = end - _DIGEST
    while left:
        block = stream.read(min(left, 1 << 22))
        if not block:
            break
        digest.update(block)
        left -= len(block)
    if left or stream.read(_DIGEST) != digest.digest():
        raise CorruptStateError(f"{source}: checksum mismatch, the bytes are corrupt or truncated")
    stream.seek(start)
    return digest.hexdigest()


@dataclass
class _Reader:
    stream: IO[bytes]
    source: str
    end: int  # where the digest starts

    def take(self, n: int, what: str) -> bytes:
        if n > self.end - self.stream.tell():
            raise CorruptStateError(f"{self.source}: {what} ({n} bytes) runs past the end of the checkpoint")
        data = self.stream.read(n)
        if len(data) != n:
            raise CorruptStateError(
                f"{self.source}: truncated in {what} (wanted {n} bytes, found {len(data)})"
            )
        return data

    def skip(self, what: str) -> None:
        size, _raw = _FRAME_HEAD.unpack(self.take(_FRAME_HEAD.size, f"the length of {what}"))
        if size > self.end - self.stream.tell():
            raise CorruptStateError(
                f"{self.source}: {what} ({size} bytes) runs past the end of the checkpoint"
            )
        self.stream.seek(size, os.SEEK_CUR)

    def frame(self, what: str) -> bytes:
        size, raw = _FRAME_HEAD.unpack(self.take(_FRAME_HEAD.size, f"the length of {what}"))
        if raw > _MAX_RATIO * size + (1 << 20):
            raise CorruptStateError(f"{self.source}: {what} claims {raw} bytes from {size} compressed")
        data = self.take(size, what)
        try:
            out = zstandard.ZstdDecompressor().decompressobj().decompress(data)
        except zstandard.ZstdError as exc:
            raise CorruptStateError(f"{self.source}: {what} does not decompress ({exc})") from exc
        if len(out) != raw:
            raise CorruptStateError(f"{self.source}: {what} decompresses to {len(out)} bytes, expected {raw}")
        return out

    def finish(self) -> None:
        if self.stream.tell() != self.end:
            raise CorruptStateError(
                f"{self.source}: {self.end - self.stream.tell()} bytes follow the last lane"
            )


def _decoded(source: str, what: str, raw: bytes, base: Any = None, codecs: DerivedCodecs = BUILTIN) -> Any:
    try:
        return frame_decode.decode_frame(raw, base, codecs)
    except frame_decode.FrameError as exc:
        raise CorruptStateError(f"{source}: malformed checkpoint structure in {what} ({exc})") from exc


def read_version(stream: IO[bytes], source: str) -> tuple[int, bytes]:
    """The format version in a checkpoint's first bytes (and those bytes)."""
    head = stream.read(_VERSION_HEAD.size)
    if len(head) < _VERSION_HEAD.size or not head.startswith(blob.MAGIC):
        raise CorruptStateError(f"{source} is not a zephon-flow checkpoint (missing magic header)")
    _magic, version = _VERSION_HEAD.unpack(head)
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{source} uses checkpoint format version {version}, newer than the version "
            f"{FORMAT_VERSION} this zephon-flow reads; upgrade zephon-flow to load it"
        )
    if version < 1:
        raise CorruptStateError(f"{source} declares invalid format version {version}")
    return version, head


@dataclass
class Opened:
    """A format-3 checkpoint being read: its header, then ``lanes()`` one at a time."""

    reader: _Reader
    header: dict[str, Any]

    def lanes(self, base: dict[int, Any] | None = None, codecs: DerivedCodecs = BUILTIN) -> Iterator[Any]:
        """Each lane's plain state in header order; ``base``: the base's lane trees by id;
        ``codecs``: those that rebuild the derived fields the lanes left out."""
        for lane in self.header["lane_ids"]:
            what = f"the state of lane {lane}"
            raw = self.reader.frame(what)
            yield _decoded(self.reader.source, what, raw, None if base is None else base.get(lane), codecs)
            del raw
            self.reader.skip(f"the row index of lane {lane}")

    def finish(self) -> None:
        self.reader.finish()


def open_v3(stream: IO[bytes], source: str) -> Opened:
    """Reads a format-3 header (after ``read_version``), once ``verify`` passed."""
    here = stream.tell()
    reader = _Reader(stream, source, stream.seek(0, os.SEEK_END) - _DIGEST)
    stream.seek(here)
    header = _decoded(source, "the header", reader.frame("the header"))
    if not isinstance(header, dict):
        raise CorruptStateError(f"{source}: the header should be a mapping, found {type(header).__name__}")
    for key in ("lane_ids", "base"):
        if key not in header:
            raise CorruptStateError(f"{source}: the header is missing {key!r}: the checkpoint is corrupt")
    ids = header["lane_ids"]
    if (
        not isinstance(ids, list)
        or not all(type(i) is int and i >= 0 for i in ids)
        or len(set(ids)) != len(ids)
    ):
        raise CorruptStateError(
            f"{source}: the header's lane ids {str(ids)[:80]} are not distinct lane numbers"
        )
    base = header["base"]
    if base is not None and not (
        isinstance(base, dict)
        and set(base) == {"path", "digest"}
        and all(isinstance(v, str) and v for v in base.values())
    ):
        raise CorruptStateError(f"{source}: the header's base {str(base)[:80]} is not {{path, digest}}")
    return Opened(reader, header)


def base_of(header: dict[str, Any], source_path: str) -> Base | None:
    """The base an incremental checkpoint names, resolved against the checkpoint's directory."""
    base = header["base"]
    if base is None:
        return None
    where = os.path.dirname(os.path.abspath(source_path))
    return Base(os.path.normpath(os.path.join(where, base["path"])), base["digest"])


def refuse_incremental_bytes(header: dict[str, Any], source: str) -> None:
    if header["base"] is not None:
        raise StateError(
            f"{source} is an incremental checkpoint on base {header['base']['path']!r}; load it "
            f"from its file with zf.load_state(path), which finds the base next to it"
        )


def row_index(
    path: str, chain: tuple[str, ...] = (), files: list[str] | None = None
) -> tuple[dict[str, Any], dict[int, frame_encode.RowIndex], str]:
    """A checkpoint file's header, its row digests per lane and its sha256 (for a child); the
    digests of rows it takes from its own base come from that base (checked by its sha256).
    ``files``, if given, gets the real path of each file read: this one, its base, ..."""
    if files is not None:
        files.append(os.path.realpath(path))
    with open(path, "rb") as f:
        digest = verify(f, path)
        version, _head = read_version(f, path)
        if version <= blob.BLOB_VERSION:
            raise StateError(
                f"{path} uses checkpoint format version {version}; an incremental checkpoint needs a "
                f"base in format {blob.BLOB_VERSION + 1} or later: save a full checkpoint first (zf.save_state without base)"
            )
        opened = open_v3(f, path)
        parent: dict[int, frame_encode.RowIndex] = {}
        base = base_of(opened.header, path)
        if base is not None:
            check_chain(path, base, chain)
            _header, parent, found = row_index(base.path, (*chain, path), files)
            check_base(path, base, found)
        index: dict[int, frame_encode.RowIndex] = {}
        for lane in opened.header["lane_ids"]:
            opened.reader.skip(f"the state of lane {lane}")
            what = f"the row index of lane {lane}"
            tree = _decoded(path, what, opened.reader.frame(what))
            try:
                index[lane] = frame_decode.full_digests(tree, parent.get(lane))
            except (frame_decode.FrameError, TypeError, IndexError, ValueError) as exc:
                raise CorruptStateError(
                    f"{path}: malformed checkpoint structure in lane {lane} ({exc})"
                ) from exc
        opened.finish()
    return opened.header, index, digest


def check_chain(source: str, base: Base, chain: tuple[str, ...]) -> None:
    """Refuses a missing base, a loop of bases and an overlong chain, naming the files."""
    if base.path in chain or base.path == source or len(chain) >= MAX_CHAIN:
        raise CorruptStateError(
            f"{source}: its chain of bases {' <- '.join((*chain, source))} <- {base.path} loops or is "
            f"longer than {MAX_CHAIN}; save a full checkpoint (without base) to start a new chain"
        )
    if not os.path.exists(base.path):
        raise StateError(
            f"{source} is incremental on base {base.path}, which is missing; restore that file next "
            f"to it (or load an earlier full checkpoint)"
        )


def check_base(source: str, base: Base, found: str) -> None:
    """Refuses a base whose sha256 is not the one the child recorded."""
    if found != base.digest:
        raise CorruptStateError(
            f"{source} is incremental on base {base.path}, which was altered or replaced since "
            f"(its sha256 is {found[:16]}..., the checkpoint recorded {base.digest[:16]}...)"
        )
