"""Test-only helpers for the video operators: tiny synthesized videos (never committed) and a spec."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import apache_beam as beam
import av
import numpy as np

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError
from zephon_flow.operators._video_scale import rgb

#: Encoders PyAV 18.1.0's wheels carry here, by container.
CODECS = {".mp4": "libx264", ".mkv": "libx264", ".webm": "libvpx-vp9", ".mov": "mpeg4"}


def picture(i: int, width: int, height: int, *, seed: int = 0) -> np.ndarray:
    """Frame ``i``: a gradient moving with ``i`` plus a bar, different per frame and seed."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 4 + i * 9 + seed * 31) % 256, (y * 5 + i * 3) % 256, (x + y + seed * 7) % 256], -1)
    rgb[:, (i * 3) % width] = 255
    return rgb.astype(np.uint8)


def make_video(
    path: Path,
    frames: int,
    *,
    width: int = 64,
    height: int = 48,
    fps: int = 8,
    gop: int = 8,
    seed: int = 0,
    codec: str | None = None,
    rotation: int = 0,
    times: Sequence[float] | None = None,
    pix_fmt: str = "yuv420p",
    options: dict[str, str] | None = None,
    audio_seconds: float | None = None,
    muxer: dict[str, str] | None = None,
) -> Path:
    """Writes a small video; ``times`` (seconds, ascending) gives a variable frame rate (or a
    late start), ``options`` the encoder's (over libx264's defaults here), ``audio_seconds`` a
    silent AAC track of that length after the video's, ``muxer`` the container's options
    (``{"movflags": "frag_keyframe+empty_moov"}``: a fragmented MP4)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", options=muxer or {}) as container:
        stream = container.add_stream(codec or CODECS[path.suffix], rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        stream.codec_context.gop_size = gop
        stream.codec_context.thread_count = 1
        defaults = {"bf": "2", "sc_threshold": "0", "keyint_min": str(gop)}
        if stream.codec_context.name == "libx264" or options:
            stream.codec_context.options = {
                **(defaults if stream.codec_context.name == "libx264" else {}),
                **(options or {}),
            }
        sound = None if audio_seconds is None else container.add_stream("aac", rate=8000)
        if times is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotation:
            stream.set_display_rotation(rotation)
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(picture(i, width, height, seed=seed), format="rgb24")
            if times is not None:
                frame.pts, frame.time_base = round(times[i] * 1000), Fraction(1, 1000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        if sound is not None:
            mux_silence(container, sound, audio_seconds or 0.0)
    return path


def mux_silence(container: Any, stream: Any, seconds: float) -> None:
    """``seconds`` of silence on the audio ``stream`` (8 kHz mono)."""
    samples, rate = round(seconds * 8000), 8000
    for t in range(0, samples, 1024):
        n = min(1024, samples - t)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, n), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = rate, t
        container.mux(stream.encode(frame))
    container.mux(stream.encode())


def write_videos(root: Path, n: int, *, frames: int = 24, ext: str = ".mp4", captions: bool = True) -> str:
    """``n`` videos of varied lengths with sibling captions; returns their glob."""
    for i in range(n):
        make_video(root / f"v{i:03d}{ext}", frames + 8 * (i % 3), seed=i)
        if captions:
            (root / f"v{i:03d}.txt").write_text(f"video {i} " + "word " * (1 + i % 4))
    return str(root / f"*{ext}")


def video_spec(
    pattern: str,
    tokenizer_json: str,
    *,
    lanes: int = 4,
    seed: int = 0,
    global_batch_size: int = 4,
    frames: int = 2,
    size: int = 8,
    seq_len: int = 24,
    max_clips: int = 2,
    epochs: int | None = None,
    on_error: str = "raise",
    window: str = "all",
) -> zf.LoaderSpec:
    """``ReadVideo -> DecodeVideo(size) -> TokenizeField -> PackVideo``."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        clips = p | "videos" >> ops.ReadVideo(
            pattern,
            clip_frames=8,
            frames=frames,
            caption_ext="txt",
            epochs=epochs,
            on_error=on_error,
            window=window,
        )
        decoded = clips | "decode" >> beam.ParDo(ops.DecodeVideo(size=size))
        tokens = decoded | "caption" >> beam.ParDo(ops.TokenizeField(tokenizer_json, field="txt"))
        return tokens | "pack" >> beam.ParDo(
            ops.PackVideo(seq_len, video_token_id=1, tokens_per_frame=2, frames=frames, max_clips=max_clips)
        )

    return zf.LoaderSpec(build, lanes=lanes, seed=seed, global_batch_size=global_batch_size)


def linear(path: Path) -> dict[int, np.ndarray]:
    """Every frame of the file decoded front to back (single-threaded), by pts."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_type = "NONE"
        return {f.pts: rgb(f).copy() for f in container.decode(stream)}


def garble(path: Path, count: int = 300) -> None:
    """Overwrites ``count`` bytes in the middle of ``path`` with other values (damage a
    decoder meets inside the frames, not in the container's header)."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + count):
        data[i] = (data[i] * 7 + 13) % 256
    path.write_bytes(bytes(data))


def decode_failures(path: Path, plans: Sequence[Any]) -> list[str]:
    """The ``DataError`` messages of the clips of ``plans`` that ``DecodeVideo`` refuses."""
    failed = []
    for plan in plans:
        try:
            ops.DecodeVideo().decode(str(path), plan)
        except DataError as exc:
            failed.append(str(exc))
    return failed


def frames_and_clip(element: dict[str, Any]) -> dict[str, Any]:
    """A clip's frames and number: what ``clip_spec`` batches."""
    return {"frames": element["frames"], "clip": np.int64(element["clip"])}


def clip_spec(pattern: str, *, size: int = 16, lanes: int = 2, **read: Any) -> zf.LoaderSpec:
    """``ReadVideo(pattern, **read) -> DecodeVideo(size) -> frames and clip number``, two clips a
    global batch: a bare pipeline to compare topologies on odd files."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        clips = p | "videos" >> ops.ReadVideo(pattern, **read)
        decoded = clips | "decode" >> beam.ParDo(ops.DecodeVideo(size=size))
        return decoded | "frames" >> beam.ParDo(ops.Map(frames_and_clip))

    return zf.LoaderSpec(build, lanes=lanes, seed=0, global_batch_size=lanes)
