"""Memory and resume cost of the video pipeline on one two-hour 1080p video: bounded by the clips in flight.

Run from the repository root::

    .venv/bin/python -m bench.video_long                         # 2 h of 1080p H.264, 1,000 clips
    .venv/bin/python -m bench.video_long --minutes 10 --clips 200   # a shorter run

The video is synthesised with PyAV: a 10-second 1080p segment (a still gradient with a moving
box: it encodes fast at a very low bitrate, ultrafast, a key frame every 24 frames) encoded
once and repeated by copying its packets with shifted timestamps (no re-encoding), so two
hours take seconds to write and are a real two-hour H.264 stream of 172,800 frames to
demux, index, seek and decode.

In a fresh interpreter (its peak RSS, ``VmHWM``, is its own): the cold listing (demuxing the
file's packet headers into the clip plan, then cached); the embedded ``zf.Loader`` (inline
backend: every decode in this one process, one lane, one clip a step) over
``ReadVideo(clip_frames=16, frames=8) -> DecodeVideo(size=112)`` for ``--clips`` steps, with the
peak RSS after it; the checkpoint after step 1 and after the last step (clip 1 and clip
1,000), their sizes; and the time from ``zf.Loader(state=...)`` to the first batch for each
checkpoint, alternated ``--resumes`` times. Nothing is asserted; results go to
``bench/results/video_long.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def peak_rss_mb() -> float:
    """This process's peak RSS (``VmHWM``: unlike ``ru_maxrss``, not inherited through exec
    from the parent that forked it)."""
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


STARTED = peak_rss_mb()  # the bare interpreter, before the imports below

import apache_beam as beam  # noqa: E402
import av  # noqa: E402
import numpy as np  # noqa: E402

import zephon_flow as zf  # noqa: E402
from zephon_flow import operators as ops  # noqa: E402

IMPORTED = peak_rss_mb()  # Beam, PyAV, numpy, zephon-flow

DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "video_long.json")
CLIP, KEEP, SIZE, FPS, GOP = 16, 8, 112, 24, 24
WIDTH, HEIGHT, SEGMENT_SECONDS = 1920, 1080, 10


def _segment(path: Path) -> None:
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    still = np.stack([x * 255 // WIDTH, y * 255 // HEIGHT, (x + y) % 256], -1).astype(np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.gop_size = GOP
        stream.codec_context.options = {
            "preset": "ultrafast",
            "crf": "38",
            "sc_threshold": "0",
            "keyint_min": str(GOP),
        }
        for i in range(SEGMENT_SECONDS * FPS):
            rgb = still.copy()
            top, left = (i * 7) % (HEIGHT - 120), (i * 13) % (WIDTH - 160)
            rgb[top : top + 120, left : left + 160] = (255 - 10 * (i % 24), 40, 200)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())


def synthesise_long(path: Path, minutes: float) -> Path:
    """``minutes`` of 1080p H.264: one encoded segment, its packets repeated with shifted
    timestamps (every segment starts with a key frame, so each copy decodes on its own)."""
    segment = path.with_name("segment.mp4")
    _segment(segment)
    copies = max(1, round(minutes * 60 / SEGMENT_SECONDS))
    with av.open(str(segment)) as src, av.open(str(path), "w") as dst:
        ist = src.streams.video[0]
        ost = dst.add_stream_from_template(ist)
        packets = [p for p in src.demux(ist) if p.size]
        span = len(packets) * int(packets[0].duration)
        for k in range(copies):
            for p in packets:
                q = av.Packet(bytes(p))
                assert p.pts is not None and p.dts is not None
                q.pts, q.dts, q.duration = p.pts + k * span, p.dts + k * span, p.duration
                q.is_keyframe, q.time_base, q.stream = p.is_keyframe, p.time_base, ost
                dst.mux(q)
    segment.unlink()
    return path


def frames_only(element: dict[str, Any]) -> dict[str, Any]:
    return {"frames": element["frames"]}


def make_spec(path: str) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        clips = p | "videos" >> ops.ReadVideo(path, clip_frames=CLIP, frames=KEEP)
        decoded = clips | "decode" >> beam.ParDo(ops.DecodeVideo(size=SIZE))
        return decoded | "frames" >> beam.ParDo(ops.Map(frames_only))

    return zf.LoaderSpec(build, lanes=1, seed=0, global_batch_size=1)


def measure(path: str, clips: int, resumes: int) -> dict[str, Any]:
    """The fresh interpreter's part (see the module's docstring)."""
    t0 = time.perf_counter()
    planned = len(ops.ReadVideo(path, clip_frames=CLIP, frames=KEEP).clips(path))
    listing = time.perf_counter() - t0
    listed_peak = peak_rss_mb()
    spec = make_spec(path)
    states: dict[int, bytes] = {}
    rss: list[float] = []
    t0 = time.perf_counter()
    with zf.Loader(spec, rank=0, world_size=1) as loader:
        for step, batch in loader:
            assert np.asarray(batch["frames"]).shape == (1, KEEP, SIZE, SIZE, 3)
            if step + 1 in (1, clips):
                states[step + 1] = zf.encode_state(loader.state())
            if step % 100 == 0:
                rss.append(rss_mb())
            if step + 1 >= clips:
                break
    streamed = time.perf_counter() - t0
    streamed_peak = peak_rss_mb()
    resume: dict[int, list[float]] = {at: [] for at in states}
    for _ in range(resumes):
        for at, state in states.items():
            t0 = time.perf_counter()
            with zf.Loader(spec, rank=0, world_size=1, state=state) as loader:
                step, _ = next(iter(loader))
            resume[at].append(time.perf_counter() - t0)
            assert step == at
    first, last = (statistics.median(resume[at]) for at in (1, clips))
    return {
        "clips_planned": planned,
        "listing_seconds_cold": round(listing, 2),
        "peak_rss_mb": {
            "interpreter": round(STARTED, 1),
            "after_imports": round(IMPORTED, 1),
            "after_listing": round(listed_peak, 1),
            "after_streaming": round(streamed_peak, 1),
        },
        "rss_mb_every_100_clips": [round(r, 1) for r in rss],
        "streamed_clips": clips,
        "streamed_seconds": round(streamed, 1),
        "checkpoint_bytes": {f"clip {at}": len(s) for at, s in states.items()},
        "resume_to_first_batch_seconds": {
            f"clip {at}": round(statistics.median(v), 3) for at, v in resume.items()
        },
        "resume_runs": {f"clip {at}": [round(t, 3) for t in v] for at, v in resume.items()},
        f"resume_ratio_clip_{clips}_over_clip_1": round(last / first, 3),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=120)
    parser.add_argument("--clips", type=int, default=1000)
    parser.add_argument("--resumes", type=int, default=3)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the fresh interpreter's part
    args = parser.parse_args(argv)
    if args.measure:
        got = measure(args.measure, args.clips, args.resumes)
        print(json.dumps(got))
        return got
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = synthesise_long(Path(tmp) / "long.mp4", args.minutes)
        made = time.perf_counter() - t0
        with av.open(str(path)) as container:
            frames = container.streams.video[0].frames
        env = {**os.environ, "ZEPHON_CACHE_DIR": str(Path(tmp) / "cache")}  # a cold index
        counts = ["--clips", str(args.clips), "--resumes", str(args.resumes)]
        done = subprocess.run(
            [sys.executable, "-m", "bench.video_long", "--measure", str(path), *counts],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        )
        result = {
            "video": {
                "minutes": args.minutes,
                "size": f"{WIDTH}x{HEIGHT}",
                "codec": "h264",
                "frames": frames,
                "file_mb": round(path.stat().st_size / 2**20, 1),
                "synthesis_seconds": round(made, 1),
                "decoded_whole_gb": round(frames * WIDTH * HEIGHT * 3 / 2**30, 1),
            },
            **json.loads(done.stdout.strip().splitlines()[-1]),
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
