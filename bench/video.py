"""Frames/s of the video pipeline (ReadVideo + DecodeVideo in the Loader) against the same decodes without it.

Run from the repository root::

    .venv/bin/python -m bench.video                    # 240p H.264, 360p VP9, 720p and 1080p H.264
    .venv/bin/python -m bench.video --configs 240p-h264 --repeats 5
    .venv/bin/python -m bench.video --quick            # a smoke run
    .venv/bin/python -m bench.video --first-only --configs 240p-h264 --first-batch 7

The videos are synthesised here with PyAV (24 fps, a key frame every 24 frames; a moving
gradient with noise, so it compresses like footage; no downloads). Every clip is 16 frames of
which 8 are kept (``frames=8``), resized to 112x112 (center crop, bilinear). Contenders, each
in ``--procs`` processes, run back to back in each repeat (so a noisy neighbour hurts all
alike; each repeat starts one contender later than the one before), medians reported:

* **zephon**: ``zf.Loader`` over ``ReadVideo(epochs=passes) -> DecodeVideo -> Map(frames
  only)``, the processes backend with ``--procs`` workers, world size 1; frames delivered in
  batches, to the end of the finite stream (the same clips as the others decode).
* **alone** (the limit): ``multiprocessing.Pool(--procs)`` mapping ``DecodeVideo.decode`` over
  the same clip plans: the same seek, decode and resize with no engine.
* **torch** (what a user would write): a ``torch.utils.data.DataLoader``
  (``num_workers=--procs``) whose dataset opens the file with PyAV, seeks to the clip's key
  frame, decodes with FFmpeg's default threading, keeps the same frames and resizes them with
  Pillow; **torch_1thread**, the same with the decoder single-threaded as ``DecodeVideo``'s;
  **torch_swscale**, the same resizing in FFmpeg (``to_ndarray(width=, height=)``, FFmpeg's
  default threads and rounding) as ``DecodeVideo`` does.

Also the first batch of the loader and of the torch DataLoader: in each repeat, in this
process (seconds from constructing it, every import done), and in ``--first-batch`` pairs of
fresh interpreters, alternated (``first_batch_child``: what a user's first run waits for, from
building the contender to its first batch, with the tree's CPU; ``--first-only`` runs only
these). The two-hour 1080p video's memory and resume costs are ``bench/video_long.py``. Nothing
here is asserted; results go to ``bench/results/video.json``.
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
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

import apache_beam as beam
import numpy as np
import psutil

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.batches import VALID_FIELD
from zephon_flow.operators.video_source import ClipPlan
from zephon_flow.runners.backends.processes import can_fork

DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "video.json")
CLIP, KEEP, SIZE, BATCH = 16, 8, 112, 8


class Config(NamedTuple):
    width: int
    height: int
    codec: str
    videos: int
    seconds: int


CONFIGS = {
    "240p-h264": Config(320, 240, "libx264", 8, 20),
    "360p-vp9": Config(640, 360, "libvpx-vp9", 4, 6),
    "720p-h264": Config(1280, 720, "libx264", 2, 6),
    "1080p-h264": Config(1920, 1080, "libx264", 2, 4),
    "360p-h264": Config(640, 360, "libx264", 4, 6),
    "720p-vp9": Config(1280, 720, "libvpx-vp9", 2, 6),
}
CONTENDERS = ("zephon", "alone", "torch", "torch_1thread", "torch_swscale")
#: The fewest clips a contender decodes in a run (30 batches).
MIN_CLIPS = 240


class Rate(NamedTuple):
    """Frames/s of wall time, and frames per CPU-second of the whole process tree (this process,
    its workers and theirs), both from the first batch to the last: on a shared machine a
    contender with more threads takes more of the cores from the neighbours, which the wall
    rate rewards and the CPU rate does not."""

    wall: float
    cpu: float


def tree_cpu() -> float:
    """CPU seconds used so far by this process and every live descendant."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        total += times.user + times.system
    return total


class Clock:
    """Wall and tree CPU from ``start()`` to ``rate(frames)``."""

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), tree_cpu()

    def rate(self, frames: int) -> Rate:
        return Rate(frames / (time.perf_counter() - self.wall), frames / max(1e-9, tree_cpu() - self.cpu))


def synthesise(
    path: Path, seconds: int, width: int, height: int, *, seed: int = 0, codec: str = "libx264"
) -> Path:
    """A video of a moving gradient with noise (so it compresses like footage)."""
    import av

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    amplitude = 24 if width * height <= 320 * 240 else 8  # finer grain at higher resolutions
    noise = rng.integers(0, amplitude, size=(8, height, width, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = 24
        if codec == "libx264":
            stream.codec_context.options = {"preset": "ultrafast", "sc_threshold": "0"}
        else:  # libvpx-vp9: fast, a key frame exactly every 24 frames
            stream.codec_context.options = {"deadline": "realtime", "cpu-used": "8", "keyint_min": "24"}
        for i in range(seconds * 24):
            rgb = np.stack([(x + i * 3) % 256, (y + seed * 40) % 256, (x + y + i) % 256], -1).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb + noise[i % 8], format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def frames_only(element: dict[str, Any]) -> dict[str, Any]:
    return {"frames": element["frames"]}


def zephon_spec(pattern: str, passes: int | None = None) -> zf.LoaderSpec:
    """The pipeline; ``passes``: a finite stream of that many passes over the clips."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        clips = p | "videos" >> ops.ReadVideo(pattern, clip_frames=CLIP, frames=KEEP, epochs=passes)
        decoded = clips | "decode" >> beam.ParDo(ops.DecodeVideo(size=SIZE, resample="bilinear"))
        return decoded | "frames" >> beam.ParDo(ops.Map(frames_only))

    return zf.LoaderSpec(build, lanes=4, seed=0, global_batch_size=BATCH)


def run_zephon(pattern: str, passes: int, procs: int) -> tuple[Rate, float, float]:
    """(rates after the first batch, first-batch seconds, the share of the tree's CPU that its
    own process took: lanes, dispatcher, batches) delivering ``passes`` passes over the
    clips. The stream is finite and read to its end, so the clock stops with the last clip
    decoded: stopping an endless stream after as many clips would charge the CPU of the clips
    its read-ahead (up to ``prefetch_chunks`` a lane, and ``prefetch`` batches) had decoded
    past them, about a tenth of the run's CPU here."""
    start, clock = time.perf_counter(), Clock()
    spec = zephon_spec(pattern, passes)
    loader = zf.Loader(spec, rank=0, world_size=1, backend="processes", workers=procs)
    frames, first, own = 0, 0.0, 0.0
    try:
        for _, batch in loader:
            if not first:
                first = time.perf_counter() - start
                clock.start()
                own = time.process_time()
                continue
            frames += int(np.count_nonzero(batch[VALID_FIELD])) * KEEP  # the last batch is padded
        own, tree = time.process_time() - own, tree_cpu() - clock.cpu
        return clock.rate(frames), first, own / max(1e-9, tree)
    finally:
        loader.close()


_DECODER = ops.DecodeVideo(size=SIZE, resample="bilinear")


def _decode_one(job: tuple[str, ClipPlan]) -> int:
    return int(_DECODER.decode(*job).shape[0])


def run_alone(jobs: list[tuple[str, ClipPlan]], procs: int) -> Rate:
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        pool.map(_decode_one, jobs[: procs * 2])  # warm: imports and first opens, as the loader's first batch
        clock = Clock()
        clock.start()
        # Chunks of about a split's clips (runs of one video), as the loader's lanes read them.
        frames = sum(pool.map(_decode_one, jobs, chunksize=max(1, len(jobs) // (procs * 8))))
        return clock.rate(frames)


class TorchClips:
    """A map-style dataset: a clip per index, decoded the hand-written way (``swscale``: resized
    by FFmpeg in the conversion to RGB, as ``DecodeVideo`` does, instead of by Pillow)."""

    def __init__(
        self, jobs: list[tuple[str, ClipPlan]], *, single_thread: bool = False, swscale: bool = False
    ) -> None:
        self.jobs = jobs
        self.single_thread = single_thread
        self.swscale = swscale

    def __len__(self) -> int:
        return len(self.jobs)

    def __getitem__(self, i: int) -> np.ndarray:
        import av  # imported by the parent before its workers fork (first_batch_child)

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
                    got[frame.pts] = self._resized(frame)
                if frame.pts >= plan.pts[-1]:
                    break
        return np.stack([got[p] for p in plan.pts])

    def _resized(self, frame: Any) -> np.ndarray:
        if self.swscale:  # cover SIZE x SIZE, keep the centre
            scale = SIZE / min(frame.width, frame.height)
            w, h = round(frame.width * scale), round(frame.height * scale)
            arr = frame.to_ndarray(format="rgb24", width=w, height=h)
            top, left = (h - SIZE) // 2, (w - SIZE) // 2
            return np.ascontiguousarray(arr[top : top + SIZE, left : left + SIZE])
        from PIL import Image

        im = frame.to_image()
        side = min(im.size)
        box = ((im.width - side) / 2, (im.height - side) / 2, (im.width + side) / 2, (im.height + side) / 2)
        return np.asarray(im.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=box))


def run_torch(jobs: list[tuple[str, ClipPlan]], procs: int, **how: bool) -> tuple[Rate, float]:
    """(rates after the first batch, first-batch seconds)."""
    import torch.utils.data

    start, clock = time.perf_counter(), Clock()
    dataset: Any = TorchClips(jobs, **how)  # a map-style dataset by protocol
    loader: Any = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=procs)
    batches = -(-len(jobs) // BATCH)
    frames, first = 0, 0.0
    for i, batch in enumerate(loader):
        if i == 0:
            first = time.perf_counter() - start
            clock.start()
            continue
        frames += int(batch.shape[0]) * KEEP
        if i == batches - 1:  # before the DataLoader ends its workers (their CPU with them)
            rate = clock.rate(frames)
    return rate, first


def run_contender(
    name: str, pattern: str, jobs: list[tuple[str, ClipPlan]], passes: int, procs: int
) -> tuple[Rate, float, float]:
    """One run of contender ``name``: (rates, first-batch seconds, the loader's own share of
    its tree's CPU; 0 where not measured)."""
    if name == "alone":
        return run_alone(jobs, procs), 0.0, 0.0
    if name == "zephon":
        return run_zephon(pattern, passes, procs)
    how = {"torch_1thread": {"single_thread": True}, "torch_swscale": {"swscale": True}}
    rate, first = run_torch(jobs, procs, **how.get(name, {}))
    return rate, first, 0.0


def first_batch_child(which: str, pattern: str, procs: int, launched: float) -> dict[str, float]:
    """In a fresh interpreter (``--first-child``, started at ``launched``, ``time.time()``): the
    seconds from its start to the contender's imports done (the interpreter, this module and
    zephon-flow, which both import; torch and PyAV for torch, as a user's dataset module would;
    the loader imports PyAV itself, in ``DecodeVideo()``), then from building the contender to its
    first batch (the loader: ``LoaderSpec`` and ``Loader()``, which compiles the pipeline, lists
    the clips from the index cache and starts the workers; torch: listing the clips from the same
    cache, then the ``DataLoader`` and its workers), and the CPU seconds of the whole process
    tree over that second span."""
    if which == "torch":
        import av  # noqa: F401
        import torch.utils.data
    t1, cpu = time.perf_counter(), tree_cpu()
    imports = time.time() - launched
    if which == "zephon":
        loader: Any = zf.Loader(
            zephon_spec(pattern), rank=0, world_size=1, backend="processes", workers=procs
        )
    else:
        source = ops.ReadVideo(pattern, clip_frames=CLIP, frames=KEEP)
        jobs = [(p, plan) for p in source.paths() for plan in source.clips(p)]
        dataset: Any = TorchClips(jobs)
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=procs)
    batches = iter(loader)  # kept until the CPU is read: its workers' CPU is counted while they live
    next(batches)
    first, cpu = time.perf_counter() - t1, tree_cpu() - cpu
    return {"imports": round(imports, 3), "first": round(first, 3), "cpu": round(cpu, 3)}


def first_batches(pattern: str, pairs: int, procs: int) -> dict[str, Any]:
    """``pairs`` fresh-process runs of each contender, alternated (which goes first alternates
    too), each timing its first batch as ``first_batch_child`` says; medians and every run."""
    source = ops.ReadVideo(pattern, clip_frames=CLIP, frames=KEEP)
    for path in source.paths():  # the index cache warm for both, as after a first run
        source.clips(path)
    runs: dict[str, list[dict[str, float]]] = {"zephon": [], "torch": []}
    root = str(Path(__file__).resolve().parent.parent)
    for i in range(pairs):
        for which in ("zephon", "torch") if i % 2 == 0 else ("torch", "zephon"):
            cmd = [
                sys.executable,
                "-m",
                "bench.video",
                "--procs",
                str(procs),
                "--first-child",
                which,
                pattern,
            ]
            cmd.append(repr(time.time()))
            out = subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True).stdout
            runs[which].append(json.loads(out.strip().splitlines()[-1]))
    median = {k: {f: round(statistics.median(r[f] for r in v), 3) for f in v[0]} for k, v in runs.items()}
    return {
        "pairs": pairs,
        "median": median,
        "zephon/torch": round(median["zephon"]["first"] / median["torch"]["first"], 3),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
    }


def make_videos(name: str, config: Config, root: Path) -> str:
    """The config's videos under ``root/name``; their glob."""
    folder = root / name
    folder.mkdir()
    for v in range(config.videos):
        synthesise(
            folder / f"v{v}.mp4", config.seconds, config.width, config.height, seed=v, codec=config.codec
        )
    return str(folder / "*.mp4")


def run_config(
    name: str, config: Config, root: Path, repeats: int, procs: int, passes: int, first_pairs: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    pattern = make_videos(name, config, root)
    made = time.perf_counter() - t0
    source = ops.ReadVideo(pattern, clip_frames=CLIP, frames=KEEP)
    # Each contender decodes the clips ``passes`` times over (and at least MIN_CLIPS clips), so
    # what its prefetch does before the clock starts (at its first batch) is a small part.
    once = [(p, plan) for p in source.paths() for plan in source.clips(p)]
    passes = max(passes, -(-MIN_CLIPS // len(once)))
    jobs = once * passes
    rates: dict[str, list[Rate]] = {k: [] for k in CONTENDERS}
    firsts: dict[str, list[float]] = {"zephon": [], "torch": []}
    own: list[float] = []
    forked: list[bool] = []
    for r in range(repeats):
        # Each repeat starts one contender later, so a neighbour's burst of load does not fall
        # on the same contender in every repeat.
        for name in CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]:
            if name == "zephon":
                forked.append(can_fork())  # else its workers come from the forkserver
            rate, first, share = run_contender(name, pattern, jobs, passes, procs)
            rates[name].append(rate)
            if name in firsts:
                firsts[name].append(first)
            if name == "zephon":
                own.append(share)
    median = {k: statistics.median(r.wall for r in v) for k, v in rates.items()}
    per_cpu = {k: statistics.median(r.cpu for r in v) for k, v in rates.items()}
    return {
        "videos": config.videos,
        "seconds": config.seconds,
        "size": f"{config.width}x{config.height}",
        "codec": config.codec,
        "clips": len(once),
        "passes": passes,
        "synthesis_seconds": round(made, 1),
        "frames_per_second": {k: round(v, 1) for k, v in median.items()},
        "frames_per_cpu_second": {k: round(v, 1) for k, v in per_cpu.items()},
        "ratios": {
            f"zephon/{k}": round(median["zephon"] / median[k], 3) for k in CONTENDERS if k != "zephon"
        },
        "ratios_per_cpu_second": {
            f"zephon/{k}": round(per_cpu["zephon"] / per_cpu[k], 3) for k in CONTENDERS if k != "zephon"
        },
        "first_batch_seconds": {k: round(statistics.median(v), 3) for k, v in firsts.items()},
        "zephon_own_process_cpu_share": round(statistics.median(own), 3),
        "zephon_workers_forked": forked,
        "first_batch_fresh": first_batches(pattern, first_pairs, procs) if first_pairs else None,
        "runs": {k: [[round(r.wall, 1), round(r.cpu, 1)] for r in v] for k, v in rates.items()},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs", default="240p-h264,360p-vp9,720p-h264,1080p-h264", help=f"of {sorted(CONFIGS)}"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3, help="times each contender decodes every clip")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="2 videos of 4 s at 240p, once")
    parser.add_argument(
        "--first-batch",
        type=int,
        default=5,
        metavar="PAIRS",
        help="fresh-process pairs (loader, torch DataLoader; alternated) timing the first batch; 0: none",
    )
    parser.add_argument("--first-only", action="store_true", help="only the fresh-process first batches")
    parser.add_argument(
        "--first-child", nargs=3, metavar=("WHICH", "PATTERN", "LAUNCHED"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.first_child:
        which, pattern, launched = args.first_child
        child = first_batch_child(which, pattern, args.procs, float(launched))
        print(json.dumps(child))
        return child
    names = args.configs.split(",")
    configs = {n: CONFIGS[n] for n in names}
    if args.quick:
        configs, args.repeats = {"240p-h264": Config(320, 240, "libx264", 2, 4)}, 1
    results: dict[str, Any] = {}
    result: dict[str, Any] = {
        "setup": {"procs": args.procs, "repeats": args.repeats, "cpus": os.cpu_count(), "av": version("av")},
        "configs": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, c in configs.items():  # written after each config: a long run stopped keeps the rest
            if args.first_only:
                pattern = make_videos(name, c, Path(tmp))
                results[name] = {"first_batch_fresh": first_batches(pattern, args.first_batch, args.procs)}
            else:
                results[name] = run_config(
                    name, c, Path(tmp), args.repeats, args.procs, args.passes, args.first_batch
                )
            results[name]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
            out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
