"""Videos inside WebDataset tar shards: the shard's members from their headers, and a member as a file.

``ReadVideo`` reads a ``.tar`` path's video members (``.mp4``, ``.mkv``, ``.webm``, ``.mov``)
as videos; PyAV opens each through ``MemberFile``, a seekable window onto the shard, so a
member is never copied out whole.
"""

from __future__ import annotations

import io
import os
import tarfile
from typing import IO, NamedTuple

from zephon_flow.core import files
from zephon_flow.core.errors import DataError

#: Member extensions read as videos (lower case).
VIDEO_EXTENSIONS = ("mp4", "mkv", "webm", "mov")


class Member(NamedTuple):
    """A regular member of a shard: its name and where its data lies."""

    name: str
    offset: int
    size: int

    @property
    def key(self) -> str:
        """The WebDataset key: the name up to the first dot of its basename."""
        directory, _, base = self.name.rpartition("/")
        stem = base.partition(".")[0]
        return f"{directory}/{stem}" if directory else stem

    @property
    def ext(self) -> str:
        """The WebDataset extension: the basename after its first dot (``a.b.mp4``: ``b.mp4``)."""
        return self.name.rpartition("/")[2].partition(".")[2].lower()

    @property
    def is_video(self) -> bool:
        """Whether the member is a video: the last part of its extension says so, as WebDataset's
        decoders read it (``a.b.mp4``, key ``a``, field ``b.mp4``, is an MP4; it was passed over
        silently when its whole extension was matched)."""
        return self.ext.rpartition(".")[2] in VIDEO_EXTENSIONS


def is_shard(path: str) -> bool:
    return path.lower().endswith(".tar")


def members(path: str, operator: str) -> list[Member]:
    """Every regular member of the shard, in shard order, from its headers (no data read)."""
    out: list[Member] = []
    with files.open_binary(path, operator=operator) as fh:
        try:
            with tarfile.open(fileobj=fh, mode="r:") as tar:
                for info in tar:
                    if info.isreg():
                        out.append(Member(info.name, info.offset_data, info.size))
        except tarfile.TarError as exc:
            raise DataError(f"{operator}: {path} is not a readable uncompressed tar shard: {exc}") from exc
    return out


def shard_videos(path: str, caption_ext: str | None, operator: str) -> list[tuple[Member, Member | None]]:
    """The shard's video members in shard order, each with its caption member (the member of
    its key with extension ``caption_ext``; None without one asked for, or when the shard has
    none: ``ReadVideo`` refuses that video by name, or leaves it out with ``on_error="skip"``)."""
    shard = members(path, operator)
    out: list[tuple[Member, Member | None]] = []
    for video in (m for m in shard if m.is_video):
        text = None
        if caption_ext:
            text = next((m for m in shard if m.key == video.key and m.ext == caption_ext.lower()), None)
        out.append((video, text))
    return out


class MemberFile(io.RawIOBase):
    """A read-only, seekable view of ``size`` bytes at ``offset`` of an open shard."""

    def __init__(self, fh: IO[bytes], offset: int, size: int) -> None:
        super().__init__()
        self._fh, self._offset, self._size, self._pos = fh, offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), self._size - self._pos))
        if n == 0:
            return 0
        self._fh.seek(self._offset + self._pos)
        data = self._fh.read(n)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def member_text(path: str, member: Member, operator: str) -> str:
    """A caption member's text (UTF-8)."""
    data = files.read_bytes(path, member.offset, member.size, operator=operator)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{operator}: the caption {member.name!r} of {path} is not UTF-8: {exc}") from exc


def sibling_text(path: str, ext: str, operator: str) -> str:
    """The text of the file beside ``path`` with extension ``ext`` (a plain video's caption)."""
    sibling = f"{os.path.splitext(path)[0]}.{ext}"
    try:
        with files.open_binary(sibling, operator=operator) as fh:
            return fh.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{operator}: cannot read the caption {sibling} of {path}: {exc}") from exc
