"""The sources' file layer: list, stat and open files, local or remote, through Beam's FileSystems.

Local paths (no scheme, or ``file://``) take a fast path: ``glob``, ``os.stat`` and plain
``open`` (sources that memory-map keep doing so). Any other scheme (``gs://``, ``s3://``,
``hdfs://``, ...) goes through Apache Beam's ``FileSystems``, which is already a dependency and
whose filesystems come with Beam's extras (``apache-beam[gcp]``, ``[aws]``, ``[hadoop]``), so
the filesystem a Beam pipeline reads is the one the loader reads. fsspec would add a second
registry of filesystems and credentials to configure, for no scheme that Beam lacks among
those a training corpus lives on. Files are always opened uncompressed (Beam's default
``AUTO`` would inflate ``.gz`` behind the source's back).

Errors are ``DataError``s naming the operator and the file.
"""

from __future__ import annotations

import errno
import glob as globlib
import logging
import os
import posixpath
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, TypeVar, cast

from apache_beam.io.filesystem import CompressionTypes, FileMetadata
from apache_beam.io.filesystems import FileSystems

from zephon_flow.core.errors import DataError, SpecError

_log = logging.getLogger("zephon_flow.sources")

_SCHEME = re.compile(r"^(?P<scheme>[a-zA-Z][-a-zA-Z0-9+.]*)://")
_MAGIC = re.compile(r"[*?[]")

T = TypeVar("T")


@dataclass(frozen=True)
class FileInfo:
    """What listing needs of a file: its size in bytes and its modification time (ns)."""

    size: int
    mtime_ns: int


def scheme(path: str) -> str | None:
    """The URI scheme of ``path`` (``"gs"``, ``"file"``), or None for a plain local path."""
    m = _SCHEME.match(os.fspath(path))
    return m.group("scheme").lower() if m else None


def is_local(path: str) -> bool:
    """Whether ``path`` is on the local filesystem (no scheme, or ``file://``)."""
    return scheme(path) in (None, "file")


def local_path(path: str) -> str:
    """The OS path of a local ``path`` (``file:///a/b`` -> ``/a/b``; ``~`` expanded)."""
    path = os.fspath(path)
    if scheme(path) == "file":
        path = path[len("file://") :]
    return os.path.expanduser(path)


def expand_glob(pattern: str, *, operator: str) -> list[str]:
    """The files matching ``pattern``, sorted; refuses a pattern that matches nothing."""
    pattern = os.fspath(pattern)
    if is_local(pattern):
        found = globlib.glob(local_path(pattern), recursive=True)
        paths = sorted(p for p in found if os.path.isfile(p))
    else:
        paths = sorted(m.path for m in _match(pattern, operator))
    if not paths:
        raise SpecError(f"{operator}: the glob {pattern!r} matches no file")
    return paths


def relative_name(path: str, pattern: str) -> str:
    """The path relative to the fixed (non-wildcard) directory prefix of ``pattern``."""
    path, pattern = os.fspath(path), os.fspath(pattern)
    if is_local(pattern):
        fixed = []
        for part in local_path(pattern).split(os.sep):
            if globlib.has_magic(part):
                break
            fixed.append(part)
        root = os.sep.join(fixed)
        root = root if os.path.isdir(root) else os.path.dirname(root)
        return os.path.relpath(local_path(path), root or ".")
    head = _MAGIC.split(pattern, maxsplit=1)[0]
    root = head if head.endswith("/") else posixpath.dirname(head) + "/"
    return path[len(root) :] if path.startswith(root) else path


def stat(path: str, *, operator: str) -> FileInfo:
    """Size and modification time of one file."""
    if is_local(path):
        try:
            st = os.stat(local_path(path))
        except OSError as exc:
            raise DataError(f"{operator}: cannot read {path}: {exc.strerror or exc}") from exc
        return FileInfo(st.st_size, st.st_mtime_ns)
    found = [m for m in _match(path, operator) if m.path == path]
    if not found:
        raise DataError(f"{operator}: cannot read {path}: no such file")
    meta = found[0]
    return FileInfo(int(meta.size_in_bytes), int(float(meta.last_updated_in_seconds or 0.0) * 1e9))


def size(path: str, *, operator: str) -> int:
    """The size of one file in bytes."""
    return stat(path, operator=operator).size


def open_binary(path: str, *, operator: str, buffering: int = -1) -> IO[bytes]:
    """A seekable binary reader of the file's raw bytes (never decompressed); ``buffering`` is
    the read buffer of a local file in bytes (-1: Python's default, 8 KiB)."""
    if is_local(path):
        try:
            return open(local_path(path), "rb", buffering=buffering)
        except OSError as exc:
            raise DataError(f"{operator}: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return cast(
            IO[bytes],
            FileSystems.open(path, "application/octet-stream", CompressionTypes.UNCOMPRESSED),
        )
    except Exception as exc:  # Beam wraps every filesystem's own errors differently
        raise DataError(f"{operator}: cannot read {path}: {exc}") from exc


def read_bytes(path: str, start: int, n: int, *, operator: str) -> bytes:
    """``n`` bytes of the file from ``start`` (fewer at its end)."""
    with open_binary(path, operator=operator) as fh:
        fh.seek(start)
        return fh.read(n)


def list_each(
    paths: Sequence[str],
    list_one: Callable[[str], list[T]],
    *,
    on_error: str,
    operator: str,
    skipped: list[str],
) -> list[T]:
    """``list_one`` of every path, concatenated. With ``on_error="skip"`` a file whose listing
    raises a ``DataError`` is left out with a logged warning naming it, and appended to
    ``skipped``; with ``"raise"`` the error stands."""
    out: list[T] = []
    for path in paths:
        try:
            out.extend(list_one(path))
        except DataError as exc:
            if on_error != "skip":
                raise
            skipped.append(path)
            _log.warning("%s: leaving out %s (on_error='skip'): %s", operator, path, exc)
    return out


def _match(pattern: str, operator: str) -> list[FileMetadata]:
    try:
        (result,) = FileSystems.match([pattern])
    except Exception as exc:  # BeamIOError, ValueError for an unknown scheme
        raise DataError(
            f"{operator}: cannot list {pattern!r}: {exc}; is the Beam extra for its scheme "
            "installed (apache-beam[gcp], [aws], [hadoop])?"
        ) from exc
    return list(result.metadata_list)


def atomic_write(path: str, write: Callable[[IO[bytes]], T], *, prefix: str = ".tmp-") -> T:
    """Writes a local file all or nothing: ``write(f)`` into a temporary file in the same folder,
    fsync, rename over ``path``, fsync of the folder (so the rename survives a crash); returns
    what ``write`` returned. The temporary file is removed if anything fails."""
    if os.path.isdir(path):  # before the work: os.replace would refuse only at the end
        raise IsADirectoryError(errno.EISDIR, "is a directory; give the path of a file to write", path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)
    return result


def _fsync_directory(directory: str) -> None:
    """Makes a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
