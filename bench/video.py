"""Frames/s of the video pipeline (ReadVideo + DecodeVideo in the Loader) against the same decodes without it.

Run from the repository root::

    .venv/bin/python -m bench.video            # 8 videos of 20 s at 320x240, a 12-minute 160x120 one
    .venv/bin/python -m bench.video --quick    # a smoke run

The videos are synthesised here with PyAV (H.264, 24 fps, a key frame every 24 frames; no
downloads). Every clip is 16 frames of which 8 are kept (``frames=8``), resized to 112x112
(center crop, bilinear). Contenders, each in ``--procs`` processes:

* **zephon**: ``zf.Loader`` over ``ReadVideo -> DecodeVideo -> Map(frames only)``, the
  processes backend with ``--procs`` workers, world size 1; frames delivered in batches.
* **alone**: ``multiprocessing.Pool(--procs)`` mapping ``DecodeVideo.decode`` over the same
  clip plans: the seek, decode and resize with no engine.
* **torch**: a ``torch.utils.data.DataLoader`` (``num_workers=--procs``) whose dataset opens
  the file with PyAV, seeks to the clip's key frame, decodes with FFmpeg's default threading,
  keeps the same frames and resizes them with Pillow (the common hand-written loader); and
  **torch_1thread**, the same with the decoder single-threaded as ``DecodeVideo``'s.

Also: the loader's first-batch latency; the peak RSS of one process streaming clips of the long
video (inline backend) next to what the whole video decoded at its size would take; and the
time to read and decode the first clip when resuming at clip 1 and at clip 1,000 of the long
video (``read_split`` at the position plus one ``DecodeVideo``, operator level). Nothing here
is asserted; results go to ``bench/results/video.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
import av
import numpy as np

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.operators.video_source import ClipPlan


def peak_rss_mb() -> float:
    """This process's peak RSS (``VmHWM``: unlike ``ru_maxrss``, not inherited through exec
    from the parent that forked it)."""
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


IMPORTED_RSS_MB = peak_rss_mb()
DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "video.json")
CLIP, KEEP, SIZE, BATCH = 16, 8, 112, 8


def synthesise(path: Path, seconds: int, width: int, height: int, *, seed: int = 0) -> Path:
    """An H.264 video of a moving gradient with noise (so it compresses like footage)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    noise = rng.integers(0, 24, size=(8, height, width, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = 24
        stream.codec_context.options = {"preset": "ultrafast", "sc_threshold": "0"}
        for i in range(seconds * 24):
            rgb = np.stack([(x + i * 3) % 256, (y + seed * 40) % 256, (x + y + i) % 256], -1).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb + noise[i % 8], format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def frames_only(element: dict[str, Any]) -> dict[str, Any]:
    return {"frames": element["frames"]}


def zephon_spec(pattern: str) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        clips = p | "videos" >> ops.ReadVideo(pattern, clip_frames=CLIP, frames=KEEP)
        decoded = clips | "decode" >> beam.ParDo(ops.DecodeVideo(size=SIZE, resample="bilinear"))
        return decoded | "frames" >> beam.ParDo(ops.Map(frames_only))

    return zf.LoaderSpec(build, lanes=4, seed=0, global_batch_size=BATCH)


def run_zephon(pattern: str, clips: int, procs: int) -> tuple[float, float]:
    """(frames/s, first-batch seconds) delivering ``clips`` clips."""
    start = time.perf_counter()
    loader = zf.Loader(zephon_spec(pattern), rank=0, world_size=1, backend="processes", workers=procs)
    frames, first = 0, 0.0
    try:
        for _, batch in loader:
            if not first:
                first = time.perf_counter() - start
                t0, frames = time.perf_counter(), 0
            frames += int(np.asarray(batch["frames"]).shape[0]) * KEEP
            if frames >= clips * KEEP:
                break
    finally:
        loader.close()
    return frames / (time.perf_counter() - t0), first


_DECODER = ops.DecodeVideo(size=SIZE, resample="bilinear")


def _decode_one(job: tuple[str, ClipPlan]) -> int:
    return int(_DECODER.decode(*job).shape[0])


def run_alone(jobs: list[tuple[str, ClipPlan]], procs: int) -> float:
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        pool.map(_decode_one, jobs[: procs * 2])  # warm: imports and first opens, as the loader's first batch
        start = time.perf_counter()
        # Chunks of about a split's clips (runs of one video), as the loader's lanes read them.
        frames = sum(pool.map(_decode_one, jobs, chunksize=max(1, len(jobs) // (procs * 8))))
    return frames / (time.perf_counter() - start)


class TorchClips:
    """A map-style dataset: a clip per index, decoded the hand-written way."""

    def __init__(self, jobs: list[tuple[str, ClipPlan]], *, single_thread: bool = False) -> None:
        self.jobs = jobs
        self.single_thread = single_thread

    def __len__(self) -> int:
        return len(self.jobs)

    def __getitem__(self, i: int) -> np.ndarray:
        from PIL import Image

        path, plan = self.jobs[i]
        wanted, got = set(plan.pts), {}
        with av.open(path) as container:
            stream = container.streams.video[0]
            if self.single_thread:  # as DecodeVideo decodes
                stream.codec_context.thread_type = "NONE"
                stream.codec_context.thread_count = 1
            container.seek(plan.seek, stream=stream, backward=True)
            for frame in container.decode(stream):
                if frame.pts in wanted:
                    im = frame.to_image()
                    side = min(im.size)
                    box = (
                        (im.width - side) / 2,
                        (im.height - side) / 2,
                        (im.width + side) / 2,
                        (im.height + side) / 2,
                    )
                    got[frame.pts] = np.asarray(im.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=box))
                if frame.pts >= plan.pts[-1]:
                    break
        return np.stack([got[p] for p in plan.pts])


def run_torch(jobs: list[tuple[str, ClipPlan]], procs: int, *, single_thread: bool = False) -> float:
    import torch.utils.data

    dataset: Any = TorchClips(jobs, single_thread=single_thread)  # a map-style dataset by protocol
    loader: Any = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=procs)
    frames, start = 0, 0.0
    for i, batch in enumerate(loader):
        if i == 0:
            start, frames = time.perf_counter(), 0
            continue
        frames += int(batch.shape[0]) * KEEP
    return frames / (time.perf_counter() - start)


def long_video(path: str, clips: int) -> dict[str, Any]:
    """Peak RSS streaming ``clips`` clips of one long video inline, and resume costs."""
    source = ops.ReadVideo(path, clip_frames=CLIP, frames=KEEP, clips_per_split=10**6)
    (split,) = source.splits(1)
    listed = peak_rss_mb()
    for _, record in source.read_split(split, 0):
        (clip,) = source.decode(record, "bench")
        next(_DECODER.process(clip))
        if record.offset + 1 >= clips:
            break
    peak = peak_rss_mb()
    index = source.clips(path)
    resume: dict[str, float] = {}
    for at in (1, min(1000, split.stop - 1)):
        t0 = time.perf_counter()
        _, record = next(iter(source.read_split(split, at)))
        next(_DECODER.process(source.decode(record, "bench")[0]))
        resume[f"clip {at}"] = time.perf_counter() - t0
    with av.open(path) as container:
        s = container.streams.video[0]
        whole_mb = s.frames * s.codec_context.width * s.codec_context.height * 3 / 2**20
    return {
        "clips_planned": len(index),
        "peak_rss_mb_after_imports": round(IMPORTED_RSS_MB, 1),
        "peak_rss_mb_after_listing": round(listed, 1),
        "peak_rss_mb_after_streaming": round(peak, 1),
        "whole_video_decoded_mb": round(whole_mb, 1),
        "resume_seconds": {k: round(v, 4) for k, v in resume.items()},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--videos", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--long-minutes", type=float, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="2 short videos and a 2-minute long one")
    parser.add_argument("--long-only", help=argparse.SUPPRESS)  # the fresh process's part
    args = parser.parse_args(argv)
    if args.long_only:
        long = long_video(args.long_only, 200)
        print(json.dumps(long))
        return long
    if args.quick:
        args.videos, args.seconds, args.long_minutes, args.repeats = 2, 4, 2, 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        for v in range(args.videos):
            synthesise(root / f"v{v}.mp4", args.seconds, 320, 240, seed=v)
        (root / "long").mkdir()
        long_path = synthesise(root / "long" / "long.mp4", int(args.long_minutes * 60), 160, 120)
        made = time.perf_counter() - t0
        pattern = str(root / "*.mp4")
        source = ops.ReadVideo(pattern, clip_frames=CLIP, frames=KEEP)
        jobs = [(p, plan) for p in source.paths() for plan in source.clips(p)]
        rates: dict[str, list[float]] = {"zephon": [], "alone": [], "torch": [], "torch_1thread": []}
        firsts = []
        for _ in range(args.repeats):  # back to back, so a noisy neighbour hurts all alike
            rates["alone"].append(run_alone(jobs, args.procs))
            zephon, first = run_zephon(pattern, len(jobs), args.procs)
            rates["zephon"].append(zephon)
            firsts.append(first)
            rates["torch"].append(run_torch(jobs, args.procs))
            rates["torch_1thread"].append(run_torch(jobs, args.procs, single_thread=True))
        zephon, alone, torch_rate = (statistics.median(rates[k]) for k in ("zephon", "alone", "torch"))
        # In a fresh interpreter, so its peak RSS is its own: imports, listing, then 200 clips.
        done = subprocess.run(
            [sys.executable, "-m", "bench.video", "--long-only", str(long_path)],
            check=True,
            capture_output=True,
            text=True,
        )
        long = json.loads(done.stdout)
        result = {
            "setup": {
                "videos": args.videos,
                "seconds": args.seconds,
                "clips": len(jobs),
                "procs": args.procs,
                "cpus": os.cpu_count(),
                "synthesis_seconds": round(made, 1),
                "av": av.__version__,
            },
            "frames_per_second": {
                "zephon": round(zephon, 1),
                "alone": round(alone, 1),
                "torch": round(torch_rate, 1),
                "torch_1thread": round(statistics.median(rates["torch_1thread"]), 1),
            },
            "ratios": {
                "zephon/alone": round(zephon / alone, 3),
                "zephon/torch": round(zephon / torch_rate, 3),
            },
            "runs": {k: [round(r, 1) for r in v] for k, v in rates.items()},
            "first_batch_seconds": round(statistics.median(firsts), 3),
            "long_video": {"minutes": args.long_minutes, "size": "160x120", **long},
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
