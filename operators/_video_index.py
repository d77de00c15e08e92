"""A video file's index read by demuxing, never decoding: every frame's timestamp and the key frames.

``ReadVideo`` plans its clips from it and ``DecodeVideo`` seeks with it. Demuxing reads packet
headers only (a two-hour file's index is read in seconds and then cached on disk by
``_file_cache``, keyed by the file's path, size, mtime and ends), so listing costs no decode.
A local file's key is found again from its ``stat`` alone (``_file_cache.stat_key``), so a
listing of many unchanged videos reads no video bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from zephon_flow.core import files
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.operators import _file_cache
from zephon_flow.operators._video_tar import Member, MemberFile

#: The cached index's kind and version: bumped when what it holds or how it is read changes.
LISTING = "video-index 4"
#: The container extensions ``ReadVideo`` is meant for (the glob decides what is read).
EXTENSIONS = (".mp4", ".mkv", ".webm", ".mov")


@dataclass(frozen=True)
class VideoIndex:
    """What a clip plan needs of one video stream, read from packet headers."""

    #: The stream's time base as (numerator, denominator): a pts times it is seconds.
    time_base: tuple[int, int]
    #: Every shown frame's presentation timestamp, ascending (presentation order); frames an
    #: edit list cuts (a trimmed ``.mp4``: decoded for the frames after them, never shown) are
    #: not among them.
    pts: tuple[int, ...]
    #: The key frames' presentation timestamps, ascending: where a decode may start (a key
    #: frame an edit list cuts too).
    keys: tuple[int, ...]
    width: int
    height: int
    codec: str

    def seconds(self, pts: int) -> float:
        """``pts`` in seconds from the stream's first frame."""
        num, den = self.time_base
        return float(Fraction((pts - self.pts[0]) * num, den))

    def end(self) -> float:
        """The video's length in seconds: the last frame's time plus one mean frame duration."""
        step = (self.pts[-1] - self.pts[0]) / (len(self.pts) - 1) if len(self.pts) > 1 else 0
        num, den = self.time_base
        return self.seconds(self.pts[-1]) + step * num / den

    def key_before(self, pts: int) -> int:
        """The last key frame at or before ``pts`` (the first key frame if none is)."""
        i = bisect.bisect_right(self.keys, pts) - 1
        return self.keys[max(i, 0)]

    def keys_before(self, key: int, count: int) -> tuple[int, ...]:
        """Up to ``count`` key frames before the key frame ``key``, nearest first."""
        i = bisect.bisect_left(self.keys, key)
        return tuple(reversed(self.keys[max(0, i - count) : i]))

    def to_json(self) -> dict[str, Any]:
        return {
            "time_base": list(self.time_base),
            "pts": list(self.pts),
            "keys": list(self.keys),
            "width": self.width,
            "height": self.height,
            "codec": self.codec,
        }

    @classmethod
    def from_json(cls, value: Any) -> VideoIndex | None:
        """The index stored by ``to_json``, or None for anything else (a stale cache entry)."""
        try:
            num, den = value["time_base"]
            index = cls(
                (int(num), int(den)),
                tuple(int(p) for p in value["pts"]),
                tuple(int(p) for p in value["keys"]),
                int(value["width"]),
                int(value["height"]),
                str(value["codec"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        return index if index.pts and index.keys else None


def pyav() -> Any:
    """The ``av`` module (PyAV, an optional dependency: imported when a video is first opened,
    so ``zephon_flow.operators`` imports without it)."""
    try:
        import av  # optional: the ``video`` extra
    except ImportError as exc:
        raise SpecError(
            "the video operators need PyAV: pip install 'zephon-flow[video]' (av==18.1.0)"
        ) from exc
    return av


@contextlib.contextmanager
def open_container(path: str, operator: str, member: Member | None = None) -> Iterator[Any]:
    """The file (or a tar shard's ``member``) opened by PyAV (local paths directly, others
    through Beam's ``FileSystems``); FFmpeg's refusal to open it is a ``DataError`` naming it."""
    with contextlib.ExitStack() as stack:
        source: Any = files.local_path(path) if files.is_local(path) and member is None else None
        if source is None:
            source = stack.enter_context(files.open_binary(path, operator=operator))
        if member is not None:
            source = MemberFile(source, member.offset, member.size)
            path = f"{path} member {member.name!r}"
        av = pyav()
        try:
            container = av.open(source, mode="r")
        except av.error.FFmpegError as exc:
            raise DataError(
                f"{operator}: {path} is not a video container FFmpeg can read (truncated or "
                f"damaged?): {ffmpeg_reason(exc)}"
            ) from exc
        stack.callback(container.close)
        yield container


#: ``AVStream.disposition``'s attached-picture flag (``AV_DISPOSITION_ATTACHED_PIC``): a cover
#: image FFmpeg presents as a one-frame video stream (an MP4's ``covr`` art, a Matroska image
#: attachment). A stable part of FFmpeg's ABI, so no import of PyAV is needed to name it.
ATTACHED_PIC = 0x0400


def video_stream(container: Any, path: str, operator: str, max_pixels: int, number: int | None = None) -> Any:
    """The file's video: stream ``number`` (FFmpeg's stream index, as ``ffprobe`` lists it) if
    given, else its first video stream that is not an attached picture (a cover image,
    disposition ``attached_pic``); refused by name if there is none (or stream ``number`` is not
    a video stream), if FFmpeg has no decoder for its codec, or if its frames have more than
    ``max_pixels`` pixels. Listing and decoding both choose it by this rule, from the file's
    header alone."""
    if number is not None:
        stream = _numbered(container, path, operator, number)
    else:
        videos = list(container.streams.video)
        if not videos:
            kinds = sorted({s.type for s in container.streams}) or ["no streams"]
            raise DataError(f"{operator}: {path} has no video stream (it has {', '.join(kinds)})")
        moving = [s for s in videos if not int(s.disposition) & ATTACHED_PIC]
        if not moving:
            raise DataError(
                f"{operator}: {path} has no video stream but its cover image (an attached picture: "
                f"{len(videos)} stream{'s' if len(videos) > 1 else ''} flagged attached_pic)"
            )
        stream = moving[0]
    ctx = stream.codec_context
    name = getattr(ctx, "name", None) if ctx is not None else None
    if not name:
        raise DataError(f"{operator}: {path} has a video stream in a codec FFmpeg cannot decode")
    width, height = int(ctx.width), int(ctx.height)
    if width < 1 or height < 1:  # FFmpeg opened it but found no picture size in it
        raise DataError(
            f"{operator}: {path} has a {name} video stream whose frame size FFmpeg cannot read "
            f"({width}x{height}): its decoder does not support this variant (an animated WebP, "
            "say) or the file is not a video; convert it (to H.264, say) or leave it out"
        )
    if width * height > max_pixels:
        raise DataError(
            f"{operator}: {path} has {width}x{height} frames, outside 1..max_pixels={max_pixels} "
            f"pixels; raise max_pixels= if such videos are expected"
        )
    return stream


def _numbered(container: Any, path: str, operator: str, number: int) -> Any:
    """Stream ``number`` of the file (``ReadVideo(stream=number)``), refused by name if the file
    has no such stream or it is not a video stream."""
    streams = list(container.streams)
    if number < len(streams) and streams[number].type == "video":
        return streams[number]
    what = "has no" if number >= len(streams) else f"has {streams[number].type} as"
    raise DataError(
        f"{operator}: {path} {what} stream #{number} (stream={number} was asked for; its streams: "
        f"{describe_streams(container)})"
    )


def describe_streams(container: Any) -> str:
    """The file's streams as ``ffprobe`` numbers them: ``#0 video h264, #1 audio aac, ...``
    (a cover image says so)."""
    out = []
    for s in container.streams:
        ctx = s.codec_context
        codec = getattr(ctx, "name", None) if ctx is not None else None
        cover = " (attached picture)" if int(s.disposition) & ATTACHED_PIC else ""
        out.append(f"#{s.index} {s.type} {codec or 'unknown codec'}{cover}")
    return ", ".join(out) or "none"


def read_index(
    path: str,
    *,
    operator: str,
    max_pixels: int,
    member: Member | None = None,
    stream: int | None = None,
    info: files.FileInfo | None = None,
) -> VideoIndex:
    """The index of the video stream of ``path`` (or of its tar ``member``) that ``video_stream``
    chooses (``stream``: that stream), from the disk cache or by demuxing it (``info``: the
    file's ``files.stat``, if the caller has it)."""
    info = info or files.stat(path, operator=operator)
    where = path if member is None else f"{path} member {member.name!r}"
    if info.size == 0 or (member is not None and member.size == 0):
        raise DataError(f"{operator}: {where} is empty (0 bytes), not a video; remove it or narrow the glob")
    key = _file_key(path, info, operator)
    if member is not None:  # the shard's key (its ends hashed once), then the member's place
        key = hashlib.sha256(f"{key}\0{member.name}\0{member.offset}\0{member.size}".encode()).hexdigest()[
            :40
        ]
    name = f"video-index-{key}.json" if stream is None else f"video-index-{key}-stream{stream}.json"
    index = VideoIndex.from_json(_file_cache.load_json(name))
    if index is None:
        index = _demux(path, operator, max_pixels, member, stream)
        _file_cache.store_json(name, index.to_json())
    elif index.width * index.height > max_pixels:
        raise DataError(
            f"{operator}: {where} has {index.width}x{index.height} frames, outside "
            f"1..max_pixels={max_pixels} pixels; raise max_pixels= if such videos are expected"
        )
    return index


#: The files' cache keys this process found, by ``_file_cache.Stat`` (other files: path, size,
#: mtime): a shard's video members share one.
_KEYS: dict[tuple[str | int, ...], str] = {}


def _file_key(path: str, info: files.FileInfo, operator: str) -> str:
    """The file's cache key: ``_file_cache.key`` (its path, size, mtime and a hash of its first
    and last MiB), found from a local file's ``stat`` alone when it is unchanged since an
    earlier listing (``_file_cache.stat_key``: the hash was 83 % of listing 300 cached videos,
    2.1 ms a file). A file changed less than ``RACY_SECONDS`` ago is hashed every time."""
    stat = _file_cache.stat_of(path)
    memo: tuple[str | int, ...] = stat if stat is not None else (path, info.size, info.mtime_ns)
    key = _KEYS.get(memo)
    if key is not None:
        return key
    key = _file_cache.stat_key(path, info, LISTING, operator=operator, notes="video", stat=stat)
    if stat is None or stat.settled():  # a racy file's key is not remembered, even here
        if len(_KEYS) >= 256:
            _KEYS.clear()
        _KEYS[memo] = key
    return key


def _demux(
    path: str, operator: str, max_pixels: int, member: Member | None = None, number: int | None = None
) -> VideoIndex:
    av = pyav()
    with open_container(path, operator, member) as container:
        if member is not None:
            path = f"{path} member {member.name!r}"
        stream = video_stream(container, path, operator, max_pixels, number)
        stamps: set[int] = set()
        keys: set[int] = set()
        try:
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue  # the demuxer's end-of-stream marker
                pts = packet.pts if packet.pts is not None else packet.dts
                if pts is None:
                    raise DataError(f"{operator}: {path} has video packets without timestamps")
                if packet.is_keyframe:  # a decode may start there, even if its frame is not shown
                    keys.add(int(pts))
                if not packet.is_discard:  # before an edit list's start (a trimmed .mp4):
                    _add_stamp(stamps, int(pts), path, operator)  # decoded for what follows, never shown
        except av.error.FFmpegError as exc:
            raise DataError(f"{operator}: {path} cannot be demuxed (damaged?): {ffmpeg_reason(exc)}") from exc
        if not stamps or not keys:
            raise DataError(
                f"{operator}: {path} has no video frames" + ("" if not stamps else " (no key frame)")
            )
        tb = stream.time_base
        ctx = stream.codec_context
        index = VideoIndex(
            (tb.numerator, tb.denominator),
            tuple(sorted(stamps)),
            tuple(sorted(keys)),
            int(ctx.width),
            int(ctx.height),
            str(ctx.name),
        )
        others = len(container.streams.video) - 1
        why = _other_streams(container, stream.index, number) if others else None
        length = _declared_length(container, index)
        _check_length(index, length, path, operator, why, lambda: _other_span(container, stream))
        return index


def _declared_length(container: Any, index: VideoIndex) -> int | None:
    """The length the file's header declares, in microseconds from the video's first frame (None
    if it declares none). A Matroska segment's Duration counts from timestamp 0, not from the
    first frame (FFmpeg reports it as is): a file whose frames start at 5 s and end at 17 s
    declares 17 s, and was refused as cut short ("its header says 17.000 s but its video frames
    end at 12.000 s"). Other containers' lengths (MP4, MPEG-TS) count from the first frame."""
    duration = container.duration
    if not duration or "matroska" not in container.format.name:
        return int(duration) if duration else None
    num, den = index.time_base
    first_us = max(0, index.pts[0] * num * 1_000_000 // den)
    return max(0, int(duration) - first_us)


def _add_stamp(stamps: set[int], pts: int, path: str, operator: str) -> None:
    """Adds a shown frame's timestamp, refusing one seen before: two frames at one time (files
    joined end to end, timestamps restarting) cannot be told apart by a plan or a seek, which
    would quietly take one of them."""
    if pts in stamps:
        raise DataError(
            f"{operator}: {path} has two video frames at pts {pts}: its timestamps repeat (files "
            "joined end to end, or a damaged stream), so its frames cannot be found by time; "
            "remux it with fresh timestamps"
        )
    stamps.add(pts)


def _other_streams(container: Any, read: int, asked: int | None) -> tuple[str, str]:
    """What a length refusal says of a file with other video streams than stream ``read``:
    perhaps not cut, but the wrong stream (a one-frame cover image Matroska stores as an
    ordinary track), and how to read another."""
    how = (
        f"stream={asked} was asked for"
        if asked is not None
        else "the first video stream not flagged an attached picture is read, and a cover image "
        "stored as an ordinary track is not flagged; give ReadVideo(stream=N) to read stream #N"
    )
    return (
        f"its video stream #{read} is not its main video",
        f"its streams: {describe_streams(container)}; {how}",
    )


def _check_length(
    index: VideoIndex,
    duration_us: int | None,
    path: str,
    operator: str,
    others: tuple[str, str] | None = None,
    other_span: Callable[[], float] | None = None,
) -> None:
    """Refuses a file whose frames end well before the length its header declares: a cut
    download or copy, whose missing tail would otherwise just quietly be fewer clips.
    ``others``: for a file with other video streams, what to say of the stream read (see
    ``_other_streams``). ``other_span``: how long the file's other (audio, subtitle) streams
    run; a header's length they reach is theirs (a soundtrack running past the last frame),
    not a cut. A lone frame has no duration to judge by: such a file is refused, if at all,
    for having no whole clip (unless it has other video streams: a cover stored as a track)."""
    if not duration_us or (len(index.pts) < 2 and others is None):
        return
    declared = duration_us / 1_000_000
    step = index.seconds(index.pts[-1]) / max(1, len(index.pts) - 1)
    seen = index.seconds(index.pts[-1]) + step
    tolerance = max(2 * step, 0.02 * declared)
    if declared - seen <= tolerance:
        return
    if others is not None:
        stream, how = others
        raise DataError(
            f"{operator}: {path} is truncated, or {stream}: its header says {declared:.3f} s "
            f"but that stream's frames end at {seen:.3f} s ({how})"
        )
    if other_span is not None and declared - other_span() <= tolerance:
        return
    raise DataError(
        f"{operator}: {path} is truncated: its header says {declared:.3f} s but its video "
        f"frames end at {seen:.3f} s"
    )


def _other_span(container: Any, video: Any) -> float:
    """The longest time any stream but ``video`` (and other video streams) runs, in seconds
    from its first packet to its last packet's end, demuxed from the start (0 if there is none
    or it cannot be read): asked only when the video ends well before the header's length."""
    streams = [s for s in container.streams if s.type not in ("video", "attachment")]
    if not streams:
        return 0.0
    first: dict[int, int] = {}
    end: dict[int, int] = {}
    try:
        container.seek(0, backward=True, any_frame=False)
        for packet in container.demux(*streams):
            if packet.size == 0 or packet.pts is None:
                continue
            i = packet.stream.index
            first.setdefault(i, int(packet.pts))
            end[i] = max(end.get(i, 0), int(packet.pts) + int(packet.duration or 0))
    except pyav().error.FFmpegError:
        return 0.0
    spans = [float((end[i] - first[i]) * container.streams[i].time_base) for i in end]
    return max(spans, default=0.0)


def ffmpeg_reason(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc)
    return str(text).rstrip(".")
