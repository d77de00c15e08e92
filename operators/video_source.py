"""ReadVideo: a source of clips of video files, planned from the containers' indexes (no decoding)."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from zephon_flow.core import files
from zephon_flow.core import rng as rng_lib
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Record, Source, Split
from zephon_flow.operators import _plan
from zephon_flow.operators._video_index import VideoIndex, read_index
from zephon_flow.operators._video_tar import (
    VIDEO_EXTENSIONS,
    Member,
    is_shard,
    member_text,
    shard_videos,
    sibling_text,
)

_log = logging.getLogger("zephon_flow.sources")

#: The fewest clips an automatic plan puts in a split.
MIN_SPLIT_CLIPS = 4
#: ``"all"``: every whole clip; ``"random"``: one clip per video, at a place drawn from the seed.
WINDOWS = ("all", "random")
#: Videos whose clip plans a process keeps in memory; others are planned again from the
#: index cached on disk when a split of theirs is read.
KEPT_PLANS = 4
#: The field of ``ReadVideo``'s elements holding the clip's decode plan (``DecodeVideo`` reads it).
PLAN_FIELD = "clip_plan"
#: Key frames before a clip's own that its plan names (``ClipPlan.earlier``): where its decode
#: goes back to, one at a time, when decoding from its own fails or misses the clip's frames.
BACK_KEYS = 2


@dataclass(frozen=True)
class ClipPlan:
    """How to decode one clip: seek to key frame ``seek``, keep the frames at ``pts`` (in order;
    a timestamp listed twice gives the frame twice). Timestamps are in ``time_base``."""

    clip: int
    seek: int
    pts: tuple[int, ...]
    time_base: tuple[int, int]
    start: float
    end: float
    #: The tar shard member holding the video, and its caption member (None for plain files).
    member: Member | None = None
    caption: Member | None = None
    #: The bytes of its kept frames as RGB before any resize: what the lane's feed weighs a
    #: record by when it cuts chunks for the workers (about 128 KB a chunk), so a chunk of
    #: clips is one clip (or a few small ones), not a hundred clips of 1 KiB each.
    nbytes: int = 0
    #: The file's stream to decode (``ReadVideo(stream=)``); None: the rule of ``video_stream``.
    stream: int | None = None
    #: The file's (a shard's) size in bytes when the clip was planned: ``DecodeVideo`` refuses a
    #: file whose size has changed since (replaced by another video, or still being written), whose
    #: frames at the planned timestamps would be another video's, silently. None: not checked.
    size: int | None = None
    #: Up to ``BACK_KEYS`` key frames before ``seek``, nearest first: where ``DecodeVideo`` starts
    #: again when decoding from ``seek`` fails (an H.264 open GOP) or misses the clip's frames (an
    #: MPEG-TS seek, by decoding timestamp, lands past a key frame whose B-frames precede it), so
    #: that such a clip costs a GOP or two more, not a decode from the stream's start.
    earlier: tuple[int, ...] = ()


def _positive(name: str, value: Any, kind: type = int) -> Any:
    ok = isinstance(value, int | float) if kind is float else isinstance(value, int)
    if value is not None and (isinstance(value, bool) or not ok or value <= 0):
        raise SpecError(f"ReadVideo: {name} must be a positive {kind.__name__} or None, got {value!r}")
    return value


class ReadVideo(Source):
    """Clips of the video files matching ``pattern`` (``.mp4``, ``.mkv``, ``.webm``, ``.mov``; any
    container FFmpeg opens), or of the video members of the WebDataset ``.tar`` shards it
    matches (read in place, captioned by the member of the same key): a long video gives many
    clips, each one sample.

    A clip is ``clip_frames`` consecutive frames (presentation order) or the frames shown in
    ``clip_seconds`` (from the first frame's timestamp; variable frame rates are read from the
    timestamps); consecutive clips start ``stride`` frames or seconds apart (default: the clip's
    length). Only whole clips are planned. ``window="random"`` plans one clip per video instead,
    starting at a frame (or time) drawn anew in each pass from ``seed``, the video's relative
    name and the pass (counter-based: the same window on every topology and resume).
    From each clip, ``frames=K`` frames uniformly by
    index, or by timestamp at ``fps`` (the frame on screen at each ``1/fps`` tick), or all.

    - **Splits**: runs of consecutive clips of one video, ``Split(path, first, stop)`` counting
      clips, weighted by the frames kept. Listing demuxes each file once (packet headers only,
      no decoding) and caches its index on disk (``ZEPHON_CACHE_DIR``); a process keeps the
      plans of its last ``KEPT_PLANS`` videos and re-plans others from that cache.
    - **Positions**: the number of the next clip of the video; a record's ``offset`` is its
      clip number, so resuming in the middle of a long video costs one clip, not a replay.
    - **Elements**: ``{"__key__": "<relative path>#<clip>", "video": path, "clip": i, "start":
      s, "end": s, "clip_plan": ClipPlan}`` (plus ``"txt"``, the sibling caption file's text,
      with ``caption_ext="txt"``; for a shard, the key is ``"<shard>/<member>#<clip>"``, a
      ``"member"`` field names the member and the caption is its key's ``caption_ext``
      member; a split counts the clips of all the shard's video members, in shard order);
      ``DecodeVideo`` turns the plan into frames.
    - **Stream**: a file's video is its first video stream not flagged an attached picture (a
      cover image); ``stream=N`` reads stream ``#N`` instead (FFmpeg's index, as ``ffprobe``
      lists it) in every file, refusing by name a file where it is not a video stream. The
      clip plans carry it, so ``DecodeVideo`` decodes the stream listed.
    - **Errors** (``DataError`` naming the file and this operator): at listing, a zero-byte
      file, one FFmpeg cannot open or demux, no video stream, an unknown codec, frames over
      ``max_pixels``, or no whole clip. With ``on_error="skip"`` such a file (a shard's
      member: that member) is left out with a warning naming it, and listed in
      ``skipped_files`` (the same on every topology: listing is global).
    """

    rereads_offsets = True

    def __init__(
        self,
        pattern: str,
        *,
        clip_frames: int | None = None,
        clip_seconds: float | None = None,
        stride: float | None = None,
        frames: int | None = None,
        fps: float | None = None,
        caption_ext: str | None = None,
        window: str = "all",
        seed: int = 0,
        max_pixels: int = 16_000_000,
        stream: int | None = None,
        clips_per_split: int | None = None,
        epochs: int | None = None,
        on_error: str = "raise",
        label: str | None = None,
    ) -> None:
        super().__init__(pattern, epochs=epochs, on_error=on_error, label=label)
        if (clip_frames is None) == (clip_seconds is None):
            raise SpecError("ReadVideo: give exactly one of clip_frames= and clip_seconds=")
        if frames is not None and fps is not None:
            raise SpecError(
                "ReadVideo: give at most one of frames= (uniform by index) and fps= (by timestamp)"
            )
        self.clip_frames = _positive("clip_frames", clip_frames)
        self.clip_seconds = _positive("clip_seconds", clip_seconds, float)
        self.stride = _positive("stride", stride, float if clip_seconds is not None else int)
        self.frames = _positive("frames", frames)
        self.fps = _positive("fps", fps, float)
        self.max_pixels = _positive("max_pixels", max_pixels)
        if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int) or stream < 0):
            raise SpecError(
                f"ReadVideo: stream must be a stream's index (a non-negative integer, as ffprobe "
                f"numbers them) or None, got {stream!r}"
            )
        self.stream = stream
        self.clips_per_split = _positive("clips_per_split", clips_per_split)
        if window not in WINDOWS:
            raise SpecError(f"ReadVideo: window must be one of {WINDOWS}, got {window!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise SpecError(f"ReadVideo: seed must be a non-negative integer, got {seed!r}")
        self.window, self.seed = window, seed
        if caption_ext is not None and (not isinstance(caption_ext, str) or not caption_ext.strip(".")):
            raise SpecError(f"ReadVideo: caption_ext must be an extension such as 'txt', got {caption_ext!r}")
        self.caption_ext = caption_ext.strip(".") if caption_ext else None
        #: Files left out at listing (``on_error="skip"``); a shard's member as ``<shard> member '<name>'``.
        self.skipped_files: list[str] = []
        self._plans: dict[tuple[str, int], list[ClipPlan]] = {}
        # A random window's records depend on the pass, which recipe state's re-read by offset
        # does not know: only the fixed windows re-read a clip from its offset.
        self.rereads_offsets = window != "random"

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "clip_frames": self.clip_frames,
            "clip_seconds": self.clip_seconds,
            "stride": self.stride,
            "frames": self.frames,
            "fps": self.fps,
            "caption_ext": self.caption_ext,
            "window": self.window,
            "seed": self.seed,
            "max_pixels": self.max_pixels,
            "clips_per_split": self.clips_per_split,
            "split_plan": _plan.PLAN_VERSION,
            # Only when given: pipelines without it keep their fingerprint.
            **({} if self.stream is None else {"stream": self.stream}),
        }

    # -- planning ------------------------------------------------------------------------
    def clips(self, path: str, pass_index: int = 0) -> list[ClipPlan]:
        """The clips of one video in pass ``pass_index`` (which only a random window depends
        on), planned from its index (kept per process). Listing counts pass 0's."""
        at = (path, pass_index if self.window == "random" else 0)
        plans = self._plans.get(at)
        if plans is None:
            info = files.stat(path, operator=self.operator_name)
            plans = self._shard_clips(*at, info) if is_shard(path) else self._video_clips(*at, None, info)
            # Only the last few plans are kept (one timestamp per frame: a corpus of long
            # videos would not fit); assigned whole, as feeds list concurrently.
            kept = [(k, c) for k, c in self._plans.items() if k != at][-(KEPT_PLANS - 1) :]
            self._plans = {**dict(kept), at: plans}
        return plans

    def _video_clips(
        self, path: str, pass_index: int, member: Member | None, info: files.FileInfo
    ) -> list[ClipPlan]:
        """The clips of one video (``info``: the file's size and time, stat'ed once per file)."""
        index = read_index(
            path,
            operator=self.operator_name,
            max_pixels=self.max_pixels,
            member=member,
            stream=self.stream,
            info=info,
        )
        name = files.relative_name(path, self.pattern) + ("" if member is None else f"/{member.name}")
        plans = self.plan(index, name, pass_index, size=info.size)
        if not plans:
            what = f"{self.clip_frames} frames" if self.clip_frames else f"{self.clip_seconds} s"
            where = path if member is None else f"{path} member {member.name!r}"
            raise DataError(
                f"{self.operator_name}: {where} has {len(index.pts)} frames, not one whole "
                f"clip of {what}; remove it or shorten the clips"
            )
        return plans

    def _shard_clips(self, path: str, pass_index: int, info: files.FileInfo) -> list[ClipPlan]:
        """The clips of every video member of a tar shard, in shard order. With
        ``on_error="skip"`` a member refused at listing (or without its caption) is left out
        alone, not with the whole shard: one damaged video among a shard's thousand."""
        plans: list[ClipPlan] = []
        videos = shard_videos(path, self.caption_ext, self.operator_name)
        for video, text in videos:
            try:
                if self.caption_ext and text is None:
                    raise DataError(
                        f"{self.operator_name}: {path} has no {self.caption_ext!r} member for {video.name!r}"
                    )
                clips = self._video_clips(path, pass_index, video, info)
            except DataError as exc:
                if self.on_error != "skip":
                    raise
                self._leave_out(f"{path} member {video.name!r}", exc)
                continue
            plans += [replace(p, member=video, caption=text) for p in clips]
        if not plans:
            what = "readable video members" if videos else "video members"
            raise DataError(f"{self.operator_name}: {path} has no {what} ({', '.join(VIDEO_EXTENSIONS)})")
        return plans

    def _leave_out(self, where: str, exc: DataError) -> None:
        """Notes a shard member left out (``on_error="skip"``): in ``skipped_files``, and in a
        warning the first time this process lists it."""
        if where in self.skipped_files:
            return
        self.skipped_files.append(where)
        _log.warning("%s: leaving out %s (on_error='skip'): %s", self.operator_name, where, exc)

    def plan(
        self, index: VideoIndex, name: str = "", pass_index: int = 0, *, size: int | None = None
    ) -> list[ClipPlan]:
        """Every whole clip of a video (``window="all"``) or one at a random place
        (``"random"``, drawn from ``seed``, the video's ``name`` and the pass), with the frames
        to keep (``size``: the file's bytes as listed, see ``ClipPlan.size``)."""
        pts, out = index.pts, []
        windows: list[tuple[int, int, float, float]] = []  # first frame, stop frame, start s, end s
        if self.window == "random":
            windows = self._random_window(index, name, pass_index)
        elif self.clip_frames is not None:
            step = int(self.stride or self.clip_frames)
            for a in range(0, len(pts) - self.clip_frames + 1, step):
                b = a + self.clip_frames
                end = index.seconds(pts[b]) if b < len(pts) else index.end()
                windows.append((a, b, index.seconds(pts[a]), end))
        else:
            length, step_s = float(self.clip_seconds or 0), float(self.stride or self.clip_seconds or 0)
            times = [index.seconds(p) for p in pts]
            total, k = index.end(), 0
            while k * step_s + length <= total + 1e-9:
                t0, t1 = k * step_s, k * step_s + length
                a = bisect.bisect_left(times, t0)
                b = bisect.bisect_left(times, t1 - 1e-9)
                if b > a:
                    windows.append((a, b, t0, t1))
                k += 1
        for clip, (a, b, t0, t1) in enumerate(windows):
            keep = self._sample(index, a, b, t0, t1)
            nbytes = len(keep) * index.width * index.height * 3
            seek = index.key_before(min(keep))
            out.append(
                ClipPlan(
                    clip,
                    seek,
                    keep,
                    index.time_base,
                    t0,
                    t1,
                    nbytes=nbytes,
                    stream=self.stream,
                    size=size,
                    earlier=index.keys_before(seek, BACK_KEYS),
                )
            )
        return out

    def _random_window(
        self, index: VideoIndex, name: str, pass_index: int
    ) -> list[tuple[int, int, float, float]]:
        # Keyed by (seed, stream) and counted from (video, pass): pass 0 draws what a key
        # without the pass drew, each later pass its own window.
        rng = rng_lib.generator(self.seed, rng_lib.VIDEO_WINDOW, rng_lib.stable_hash(name), pass_index)
        pts = index.pts
        if self.clip_frames is not None:
            room = len(pts) - self.clip_frames
            if room < 0:
                return []
            a = int(rng.integers(0, room + 1))
            b = a + self.clip_frames
            return [(a, b, index.seconds(pts[a]), index.seconds(pts[b]) if b < len(pts) else index.end())]
        length = float(self.clip_seconds or 0)
        room_s = index.end() - length
        if room_s < -1e-9:
            return []
        t0 = round(float(rng.random()) * max(0.0, room_s), 6)
        times = [index.seconds(p) for p in pts]
        a, b = bisect.bisect_left(times, t0), bisect.bisect_left(times, t0 + length - 1e-9)
        if b == a:  # no frame starts inside the window (a gap in a variable frame rate): the
            a, b = max(0, a - 1), max(1, a)  # one on screen at its start, so every pass has its clip
        return [(a, b, t0, t0 + length)]

    def _sample(self, index: VideoIndex, a: int, b: int, t0: float, t1: float) -> tuple[int, ...]:
        n = b - a
        if self.frames is not None:  # uniform by index: the middle of each of K equal parts
            return tuple(index.pts[a + (2 * j + 1) * n // (2 * self.frames)] for j in range(self.frames))
        if self.fps is not None:  # by timestamp: the frame on screen at each tick
            times = [index.seconds(index.pts[i]) for i in range(a, b)]
            ticks = int((t1 - t0) * self.fps + 1e-9)
            picks = [max(0, bisect.bisect_left(times, t0 + j / self.fps + 1e-9) - 1) for j in range(ticks)]
            return tuple(index.pts[a + i] for i in picks)
        return index.pts[a:b]

    # -- listing and reading -------------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        skipped: list[str] = []
        self.skipped_files = []  # the members _shard_clips leaves out while listing
        listed = files.list_each(
            paths,
            lambda p: [(p, self.clips(p))],
            on_error=self.on_error,
            operator=self.operator_name,
            skipped=skipped,
        )
        self.skipped_files = [*skipped, *self.skipped_files]
        step = self.clips_per_split or _plan.target(sum(len(c) for _, c in listed), lanes, MIN_SPLIT_CLIPS)
        splits: list[Split] = []
        for path, plans in listed:
            n = len(plans)
            runs = (
                [(a, min(a + step, n)) for a in range(0, n, step)]
                if self.clips_per_split
                else _plan.ranges([0, n], step, refine=True)
            )
            splits.extend(Split(path, a, b, weight=_decoded(plans[a:b])) for a, b in runs)
        return splits

    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        return self.read_split_in_pass(split, position, 0)

    def read_split_in_pass(
        self, split: Split, position: int, pass_index: int
    ) -> Iterator[tuple[int, Record]]:
        first = split.start if position == START else position
        if not split.start <= first <= split.stop:
            raise DataError(
                f"{self.operator_name}: cannot resume clips [{split.start}, {split.stop}) of "
                f"{split.path} at clip {first}; did the video change since the checkpoint?"
            )
        plans = self.clips(split.path, pass_index)
        if split.stop > len(plans):
            raise DataError(
                f"{self.operator_name}: {split.path} has {len(plans)} clips, not the {split.stop} "
                "its split was listed with; did the video change since the splits were listed?"
            )
        return self._records(split.path, plans, first, split.stop)

    @staticmethod
    def _records(path: str, plans: list[ClipPlan], first: int, stop: int) -> Iterator[tuple[int, Record]]:
        for k in range(first, stop):
            p = plans[k]
            yield k + 1, Record(p, path, f"clip {k} ({p.start:.3f}s to {p.end:.3f}s)", k)

    # -- decoding (runs in workers): the clip's descriptor; DecodeVideo decodes it ---------
    def decode(self, record: Record, operator: str) -> list[Any]:
        plan: ClipPlan = record.payload
        name = files.relative_name(record.path, self.pattern)
        element: dict[str, Any] = {
            "__key__": f"{name}#{plan.clip}"
            if plan.member is None
            else f"{name}/{plan.member.name}#{plan.clip}",
            "video": record.path,
            "clip": plan.clip,
            "start": plan.start,
            "end": plan.end,
            PLAN_FIELD: plan,
        }
        if plan.member is not None:
            element["member"] = plan.member.name
        if plan.caption is not None:
            element["txt"] = member_text(record.path, plan.caption, operator)
        elif self.caption_ext:
            element["txt"] = sibling_text(record.path, self.caption_ext, operator)
        return [element]


def _decoded(plans: list[ClipPlan]) -> int:
    """What a run of clips costs: about the frames decoded, counted as timestamps spanned."""
    return max(1, sum(len(p.pts) for p in plans))
