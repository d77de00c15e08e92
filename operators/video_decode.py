"""``DecodeVideo``: one planned clip to ``T x H x W x 3`` uint8 frames with PyAV, by seeking (stateless)."""

from __future__ import annotations

import contextlib
import math
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import apache_beam as beam
import numpy as np

from zephon_flow.core import files
from zephon_flow.core.errors import DataError, SpecError, StageError
from zephon_flow.operators._video_index import ffmpeg_reason, open_container, pyav, video_stream
from zephon_flow.operators._video_scale import INTERPOLATION, SCALER, FrameScaler, rgb
from zephon_flow.operators._video_tar import Member
from zephon_flow.operators.image_resize import ResizeImage
from zephon_flow.operators.video_source import PLAN_FIELD, ClipPlan

#: Containers a worker thread keeps open (see ``DecodeVideo._opened``): at least
#: ``KEPT_CONTAINERS``, more while their frames hold at most ``KEPT_PIXELS`` pixels in all (what a
#: kept decoder holds grows with its frame size: about 1.3 MB at 320x240, 6 to 10 MB at 1080p),
#: and never more than ``KEPT_CONTAINERS_MAX`` (open files).
KEPT_CONTAINERS = 4
KEPT_PIXELS = 4 * 1920 * 1080
KEPT_CONTAINERS_MAX = 16
#: How a decode pass went (``DecodeVideo._pass``).
_DONE, _MISSED, _FAILED = "done", "missed", "failed"
#: What a kept container is kept under: the file, its tar member, the stream asked for.
_Held = tuple[str, Member | None, int | None]


class DecodeVideo(beam.DoFn):  # type: ignore[misc]
    """Decodes the clip a ``ReadVideo`` element plans and stores its frames under ``output``.

    The decoder seeks to the key frame the plan names, decodes forward and keeps the planned
    frames: a clip costs at most a group of pictures of decoding, never the video before it,
    and only one clip's frames are held. With ``size`` each frame is resized as it is decoded
    (``ResizeImage``'s ``mode`` and ``resample``: the image path's crop and pad), by FFmpeg's
    swscale in the same pass as its conversion to RGB, so no frame is held at full resolution
    (``resample="hamming"``, which swscale lacks, converts then resizes with Pillow). The
    output is a C-contiguous ``uint8 [T, H, W, 3]`` array; the plan field is dropped. A frame
    whose stream carries a display rotation (phone videos) is turned upright (multiples of 90
    degrees). The stream decoded is the one listed: the plan's (``ReadVideo(stream=)``), else
    the same rule as listing's.

    **Bytes**: the frames are a pure function of the file, the plan and the options for one
    FFmpeg build. A clip is always decoded from the same key frame (the plan's), whichever
    lane, worker or resume point decodes it, and the decoder runs single-threaded
    (``thread_type="NONE"``, one thread): frame-threaded H.264 and VP9 decoding is exact too,
    but error concealment on damaged streams is not, and a thread pool per worker process
    would oversubscribe the cores the backend already fills. The conversion to RGB and the
    resize run single-threaded with bit-exact rounding (``_video_scale``). FFmpeg's decoders
    and swscale may change between releases: PyAV (which bundles FFmpeg) is pinned by the
    ``video`` extra; its version is not in the fingerprint, like Pillow's.

    **Errors** (``DataError`` naming the file and the clip): a file FFmpeg cannot open or
    demux, a decode error (damaged data raises, ``err_detect=explode``, rather than being
    concealed with made-up pixels; so does a frame the decoder flags corrupt), a clip whose planned frames the decoder does not give (a truncated
    or changed file). With the source's ``on_error="skip"`` the runner drops that clip.
    """

    def __init__(
        self,
        *,
        size: int | tuple[int, int] | None = None,
        mode: str = "center_crop",
        resample: str = "bilinear",
        output: str = "frames",
        max_pixels: int = 16_000_000,
        rotate: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(output, str) or not output:
            raise SpecError(f"DecodeVideo: output must be a non-empty string, got {output!r}")
        if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
            raise SpecError(f"DecodeVideo: max_pixels must be a positive integer, got {max_pixels!r}")
        self.resizer = None if size is None else ResizeImage(size, mode=mode, resample=resample)
        self.scaler = None
        if self.resizer is not None and resample in INTERPOLATION:
            r = self.resizer
            self.scaler = FrameScaler(r.size, r.mode, r.resample, r.pad_value)
        self.output = output
        self.max_pixels = max_pixels
        self.rotate = bool(rotate)
        # PyAV imported now, where the pipeline is built: the processes backend forks its workers
        # from this process, so they start with it instead of each importing it (about 50 ms)
        # before its first clip. Without PyAV, the first decode says what to install.
        with contextlib.suppress(SpecError):
            pyav()

    def params(self) -> dict[str, Any]:
        return {
            "resize": None if self.resizer is None else self.resizer.params(),
            "scaler": SCALER if self.scaler is not None else "pillow",
            "output": self.output,
            "max_pixels": self.max_pixels,
            "rotate": self.rotate,
        }

    def process(self, element: Any) -> Iterator[dict[str, Any]]:
        if not isinstance(element, Mapping) or not isinstance(element.get(PLAN_FIELD), ClipPlan):
            got = sorted(element) if isinstance(element, Mapping) else type(element).__name__
            raise DataError(
                f"DecodeVideo: expected a ReadVideo clip (a dict with {PLAN_FIELD!r}), got {got}; "
                f"put DecodeVideo right after ReadVideo"
            )
        out = {k: v for k, v in element.items() if k != PLAN_FIELD}
        out[self.output] = self.decode(str(element["video"]), element[PLAN_FIELD])
        yield out

    def decode(self, path: str, plan: ClipPlan) -> np.ndarray:
        """The planned frames of one clip of ``path``, stacked ``[T, H, W, 3]``."""
        where = f"clip {plan.clip} ({plan.start:.3f}s to {plan.end:.3f}s)"
        if plan.member is not None:
            where = f"{where} of member {plan.member.name!r}"
        operator = f"DecodeVideo [{where}]"
        wanted = set(plan.pts)
        # The size is checked after a decode that gave the frames (a changed file that fails to
        # decode says why first): a stat (2 us) per clip, a remote file's only at its opening.
        key = (path, plan.member, plan.stream)
        check = files.is_local(path) or not self._holds(key)
        container, stream = self._opened(path, operator, plan.member, plan.stream)
        try:
            got = self._clip_frames(container, stream, plan, wanted, path, where)
            if check and wanted <= got.keys():
                _unchanged(path, plan, where)
        except BaseException:
            self._close_held(key)  # the next clip opens the file afresh
            raise
        missing = sorted(wanted - set(got))
        if missing:
            raise DataError(
                f"DecodeVideo: {path} did not give {len(missing)} of the {len(wanted)} frames of "
                f"{where} (the first missing at pts {missing[0]}): truncated or damaged, or changed "
                "since it was listed?"
            )
        frames = [got[p] for p in plan.pts]
        shapes = {f.shape for f in frames}
        if len(shapes) > 1:
            raise DataError(
                f"DecodeVideo: {where} of {path} changes frame size mid-clip ({sorted(shapes)}); "
                "give DecodeVideo(size=...) to resize every frame"
            )
        return np.stack(frames)  # C-contiguous: the clip's one copy of its frames

    def _opened(
        self, path: str, operator: str, member: Member | None = None, number: int | None = None
    ) -> tuple[Any, Any]:
        """``path``'s container and video stream (stream ``number`` if the plan names one),
        opened once per thread and kept for its next clips (the files a thread decoded last:
        ``KEPT_CONTAINERS`` of them, or more of smaller frames, see ``KEPT_PIXELS``): opening
        parses the container's index and probes its streams (1.8 ms for a 20 s 320x240 ``.mp4``,
        a tenth of a clip; more for a long one), and a worker takes clips from several lanes'
        videos in turn. Every clip seeks, which flushes the decoder, so a kept container gives
        the bytes a fresh one does."""
        local = self.__dict__.get("_held")
        if local is None:
            local = self._held = threading.local()
        held: OrderedDict[_Held, tuple[Any, Any, Any, int]] | None = getattr(local, "videos", None)
        if held is None:
            held = local.videos = OrderedDict()
        key = (path, member, number)
        if key in held:
            held.move_to_end(key)
            return held[key][1], held[key][2]
        stack = contextlib.ExitStack()
        try:
            container = stack.enter_context(open_container(path, operator, member))
            where = path if member is None else f"{path} member {member.name!r}"
            stream = video_stream(container, where, operator, self.max_pixels, number)
            ctx = stream.codec_context
            ctx.thread_type = "NONE"
            ctx.thread_count = 1
            ctx.options = {"err_detect": "explode"}  # damage raises instead of being concealed
        except BaseException:
            stack.close()
            raise
        pixels = int(ctx.width) * int(ctx.height)
        kept = pixels + sum(entry[3] for entry in held.values())
        while held and (
            len(held) >= KEPT_CONTAINERS_MAX or (len(held) >= KEPT_CONTAINERS and kept > KEPT_PIXELS)
        ):
            oldest = held.popitem(last=False)[1]
            oldest[0].close()
            kept -= oldest[3]
        held[key] = (stack, container, stream, pixels)
        return container, stream

    def _holds(self, key: _Held) -> bool:
        """Whether this thread keeps ``key``'s container open."""
        held: OrderedDict[_Held, Any] | None = getattr(self.__dict__.get("_held"), "videos", None)
        return held is not None and key in held

    def _close_held(self, key: _Held | None = None) -> None:
        """Closes this thread's kept container of ``key`` (None: all of them)."""
        held = getattr(self.__dict__.get("_held"), "videos", None)
        if not held:
            return
        for k in [key] if key is not None else list(held):
            entry = held.pop(k, None)
            if entry is not None:
                entry[0].close()

    def teardown(self) -> None:
        self._close_held()

    def __getstate__(self) -> dict[str, Any]:
        # The open containers stay with the thread that opened them.
        return {k: v for k, v in self.__dict__.items() if k != "_held"}

    def _clip_frames(
        self, container: Any, stream: Any, plan: ClipPlan, wanted: set[int], path: str, where: str
    ) -> dict[int, np.ndarray]:
        """The wanted frames, decoded from the plan's key frame; failing that, from the key
        frames before it the plan names (``ClipPlan.earlier``), nearest first; failing that, from
        the stream's start. Every attempt is a function of the file and the plan, so the frames
        are the same whoever decodes, and each is a straight decode's: frames shown before the
        plan's key frame are never kept.

        Why an attempt fails or misses: an H.264 open GOP's key frame is a recovery point, not an
        IDR frame, and the frames decoded after it may list pictures before it as references
        (never used for its shown frames), which FFmpeg's ``err_detect=explode`` refuses. Errors
        of frames shown before the plan's key frame are passed over (they are not the clip's: a
        leading picture, or the GOP before it); an error of a frame from the key frame on sends
        the decode one key frame further back, where those references exist. A container
        without an index (MPEG-TS) seeks by decoding timestamp, not by key frame: a seek to a
        key frame's pts lands on the packet decoded at that time, past the key frame itself when
        B-frames make its decoding timestamp earlier than its pts (every clip of such a file),
        and the decoder then waits for the next key frame. That misses the clip's first frame
        (or never gives a wanted one): a seek to the key frame before lands early enough (its pts
        is a GOP before), and what it decodes before the clip's key frame is passed over."""
        for target in (plan.seek, *plan.earlier):
            got: dict[int, np.ndarray] = {}
            if self._pass(container, stream, target, plan.seek, wanted, got, path, where) == _DONE:
                return got
        got = {}
        self._pass(container, stream, None, plan.seek, wanted, got, path, where)
        return got

    def _pass(
        self,
        container: Any,
        stream: Any,
        seek: int | None,
        key: int,
        wanted: set[int],
        got: dict[int, np.ndarray],
        path: str,
        where: str,
    ) -> str:
        """Decodes from where a seek to ``seek`` lands (None: the stream's start) until the last
        wanted frame, into ``got``. Returns how it went: ``_DONE``; ``_MISSED``: the first frame
        from ``key`` on came after the first wanted one, or a wanted frame did not come;
        ``_FAILED``: a frame from ``key`` on did not decode. From the start, a failure raises
        ``DataError`` naming the clip."""
        last, first = max(wanted), min(wanted)
        try:
            if seek is None:
                container.seek(0, backward=True, any_frame=False)
            else:
                container.seek(seek, stream=stream, backward=True, any_frame=False)
            started = False
            turns: dict[int, int] = {}  # this pass's display matrices, by PyAV's angle (quarter_turns)
            for frame in _decoded(container, stream, key, landing=seek == key):
                if frame.pts is None or frame.pts < key:
                    continue  # not the clip's (see _clip_frames)
                if not started:
                    started = True
                    if frame.pts > first and seek is not None:
                        return _MISSED
                if frame.is_corrupt:
                    raise DataError(
                        f"DecodeVideo: {path} is damaged: the frame at pts {frame.pts} of {where} "
                        "decodes corrupt"
                    )
                if frame.pts in wanted:
                    _check_palette(frame, path, where)
                    got[frame.pts] = self._pixels(frame, path, where, turns)
                if frame.pts >= last:
                    break
        except _LandedPast:
            return _MISSED
        except pyav().error.FFmpegError as exc:
            if seek is not None:
                return _FAILED
            raise DataError(f"DecodeVideo: cannot decode {where} of {path}: {ffmpeg_reason(exc)}") from exc
        return _DONE if seek is None or wanted <= got.keys() else _MISSED

    def _pixels(self, frame: Any, path: str, where: str, known: dict[int, int]) -> np.ndarray:
        """One kept frame, upright, resized: a view (the clip's ``np.stack`` is its one copy)."""
        turns = quarter_turns(frame, path, where, known) if self.rotate else 0
        if self.scaler is not None:
            return self.scaler(frame, turns)
        arr = rgb(frame)
        if turns:
            arr = np.rot90(arr, k=turns)
        if self.resizer is not None:  # a filter swscale lacks: Pillow's
            return self.resizer.resize(np.ascontiguousarray(arr), f"{where} of {path}")
        return arr


class _LandedPast(Exception):
    """A seek to a clip's key frame landed after it (see ``_decoded``)."""


def _decoded(container: Any, stream: Any, key: int, *, landing: bool = False) -> Iterator[Any]:
    """The frames of ``stream`` from where the container's last seek landed, decoded packet by
    packet. A packet that fails to decode raises ``FFmpegError``, unless it is shown before
    ``key`` (not a frame of the clip being decoded).

    With ``landing`` (after a seek to ``key`` itself): a first packet that is not a key frame and
    is decoded at or after ``key`` lies after the key frame (decoding timestamps only grow, and
    the key frame's is at most its pts, ``key``), so the decoder would wait for the next key
    frame, past the clip: ``_LandedPast`` is raised before anything is decoded. An MPEG-TS seek,
    by decoding timestamp, lands so with B-frames, and decoding that GOP to find it out cost as
    much again."""
    error = pyav().error.FFmpegError
    for packet in container.demux(stream):
        if landing:
            landing = False
            if not packet.is_keyframe and packet.dts is not None and packet.dts >= key:
                raise _LandedPast
        try:
            frames = packet.decode()
        except error:
            if packet.pts is not None and packet.pts < key:
                continue
            raise
        yield from frames


def _unchanged(path: str, plan: ClipPlan, where: str) -> None:
    """Refuses a file whose size is not the one its clips were planned from: replaced by another
    video since (its frames at the planned timestamps are the other video's, and which clips got
    which depended on when each was decoded), or still being written. Found replacing a listed
    ``.mp4`` in place by another of the same frame rate: its clips decoded the new frames
    silently. A rewrite of the same size is not seen (the time is not compared: a node's own
    copy of a file, made without keeping times, is the same video). Not a ``DataError``: the
    file is not bad, it moved under a running pipeline, and ``on_error="skip"`` would drop
    whichever clips happened to be decoded after the change, a stream that depends on timing."""
    if plan.size is None:
        return
    size = files.stat(path, operator="DecodeVideo").size
    if size != plan.size:
        raise StageError(
            f"DecodeVideo: {path} has changed since its clips were listed ({size} bytes, listed at "
            f"{plan.size}): refusing {where}, planned from the file as listed (replaced, or still "
            "being written?); list the videos again (a new Loader) once the file is complete"
        )


def _check_palette(frame: Any, path: str, where: str) -> None:
    """Refuses a palette frame (``pal8``: QuickTime Animation, 8-bit RLE) without a palette. A
    demuxer such as the ``.mov`` one sends a palette once, with the stream's first packet; a
    seek drops it, and the frames decode against an all-zero palette (black), silently."""
    if frame.format.name == "pal8" and not any(bytes(frame.planes[1])):
        raise DataError(
            f"DecodeVideo: {path} is a palette video (pal8) whose palette comes once, with its "
            f"first packet, and is lost on a seek: {where} would decode black; convert the file "
            "(to H.264 or FFV1, say) to read it by clips"
        )


#: A display matrix's 2x2 part ``(a, b, c, d)`` (FFmpeg's ``int32[9]``, 16.16 fixed point, entries
#: 0, 1, 3, 4) for each exact counterclockwise quarter turn, and the turns ``np.rot90`` makes.
_ONE = 1 << 16
_QUARTER_TURNS = {
    (_ONE, 0, 0, _ONE): 0,
    (0, -_ONE, _ONE, 0): 1,
    (-_ONE, 0, 0, -_ONE): 2,
    (0, _ONE, -_ONE, 0): 3,
}


def quarter_turns(frame: Any, path: str, where: str, known: dict[int, int]) -> int:
    """The counterclockwise quarter turns that show ``frame`` upright, from its display matrix
    (none: 0). Only an exact rotation by a multiple of 90 degrees is applied; any other matrix
    (a rotation by another angle, a mirror, a scale) is refused by name rather than rounded to
    the nearest quarter turn or ignored, which would silently change the frames. The translation
    part (MP4 writers put the frame's size there for a turn) does not change the picture.

    The matrix is read (``frame.side_data``) only when PyAV's angle (``frame.rotation``, whole
    degrees, read in C) is not 0, and once per angle a clip shows (``known``, per pass of one
    clip, so what it holds is a function of the clip alone): that property ties the frame and
    its side data in a reference cycle, which keeps the frame (3 MB at 1080p) alive until
    Python's cyclic collector runs (read on every frame: 830 MB peak against 266 MB on the
    two-hour 1080p video). A matrix PyAV reads as 0 degrees (none, the identity, a vertical flip,
    a scale, a rotation by less than a degree) is taken as no rotation, as before this rule."""
    angle = int(frame.rotation)
    if angle == 0:
        return 0
    turns = known.get(angle)
    if turns is None:
        turns = known[angle] = _matrix_turns(frame, path, where)
    return turns


def _matrix_turns(frame: Any, path: str, where: str) -> int:
    data = frame.side_data.get("DISPLAYMATRIX")
    if data is None:
        return 0
    raw = bytes(data)
    if len(raw) != 36:
        raise DataError(f"DecodeVideo: {path} has a display matrix of {len(raw)} bytes (not 36) in {where}")
    m = struct.unpack("=9i", raw)
    a, b, c, d = m[0], m[1], m[3], m[4]
    turns = _QUARTER_TURNS.get((a, b, c, d))
    if turns is not None:
        return turns
    s0, s1 = math.hypot(a, c), math.hypot(b, d)
    angle = f"{0.0 - math.degrees(math.atan2(b / s1, a / s0)):.2f}" if s0 and s1 else "undefined"
    mirrored = ", mirrored" if a * d - b * c < 0 else ""
    scaled = "" if abs(s0 - _ONE) <= 4 and abs(s1 - _ONE) <= 4 else ", scaled"  # 16.16's rounding
    raise DataError(
        f"DecodeVideo: {path} asks for a display transform that is not a quarter turn (a rotation "
        f"of {angle} degrees{mirrored}{scaled}: display matrix {[a, b, c, d]} in 16.16) in {where}; "
        "only rotations by multiples of 90 degrees are applied (none is rounded): give "
        "DecodeVideo(rotate=False) to read its frames as stored"
    )
