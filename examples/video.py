"""Captioned video clips for a video-language model: clips planned from the files' indexes, decoded by seeking, packed.

    python examples/video.py --make 6 --out videos/      # synthesise 6 small captioned videos
    python examples/video.py --pattern 'videos/*.mp4'   # print the first batches' shapes and digests
    zephon digest examples/video.py:spec                 # the same spec, by ``ZEPHON_VIDEO_GLOB``

Each video file (``.mp4``, ``.mkv``, ``.webm``, ``.mov``) is cut into clips of ``CLIP_FRAMES``
frames; ``FRAMES`` frames are taken uniformly from each clip, resized to ``SIZE``, and packed
with the clip's caption (the sibling ``.txt`` file, as bytes + 2: no tokenizer to train) into
sequences of ``SEQ_LEN`` tokens, ``TOKENS_PER_FRAME`` placeholders per frame. A lane's
position is a clip of a video, so a resume decodes one clip, not the video up to it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

# isort: off
import zephon_flow as zf  # first: it quiets notices Beam logs when imported

import apache_beam as beam
import numpy as np

# isort: on
from zephon_flow import operators as ops

CLIP_FRAMES, FRAMES, SIZE = 8, 4, 32
SEQ_LEN, TOKENS_PER_FRAME, MAX_CLIPS = 160, 4, 3
VIDEO_TOKEN, PAD = 1, 0
LANES, GLOBAL_BATCH, SEED = 4, 8, 1234


def caption_ids(element: dict[str, Any]) -> dict[str, Any]:
    """The caption as byte ids (+2: 0 pads, 1 is the video placeholder)."""
    ids = np.frombuffer(element["txt"].encode("utf-8"), dtype=np.uint8).astype(np.int32) + 2
    return {**element, "text_ids": ids}


def spec(pattern: str | None = None) -> zf.LoaderSpec:
    """``ReadVideo -> DecodeVideo -> caption ids -> PackVideo`` over the videos of ``pattern``
    (default: ``$ZEPHON_VIDEO_GLOB``); each needs a sibling ``.txt`` caption."""
    glob = pattern or os.environ.get("ZEPHON_VIDEO_GLOB")
    if not glob:
        raise zf.SpecError("examples/video.py: give spec(pattern) or set ZEPHON_VIDEO_GLOB")

    def build(p: beam.Pipeline) -> beam.PCollection:
        clips = p | "videos" >> ops.ReadVideo(glob, clip_frames=CLIP_FRAMES, frames=FRAMES, caption_ext="txt")
        frames = clips | "decode" >> beam.ParDo(ops.DecodeVideo(size=SIZE))
        tokens = frames | "caption" >> beam.ParDo(ops.Map(caption_ids))
        return tokens | "pack" >> beam.ParDo(
            ops.PackVideo(
                SEQ_LEN,
                video_token_id=VIDEO_TOKEN,
                tokens_per_frame=TOKENS_PER_FRAME,
                frames=FRAMES,
                max_clips=MAX_CLIPS,
                pad_id=PAD,
            )
        )

    return zf.LoaderSpec(build, lanes=LANES, seed=SEED, global_batch_size=GLOBAL_BATCH)


def make_videos(root: Path, n: int, *, frames: int = 48, width: int = 96, height: int = 64) -> str:
    """``n`` small H.264 videos (a moving gradient, 8 fps, a key frame every 8 frames) with captions."""
    import av  # the ``video`` extra

    root.mkdir(parents=True, exist_ok=True)
    y, x = np.mgrid[0:height, 0:width]
    for v in range(n):
        with av.open(str(root / f"clip{v:03d}.mp4"), "w") as container:
            stream = container.add_stream("libx264", rate=8)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.codec_context.gop_size = 8
            for i in range(frames + 8 * v):
                rgb = np.stack([(x * 3 + i * 8) % 256, (y * 4 + v * 40) % 256, (x + y + i) % 256], -1)
                frame = av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        (root / f"clip{v:03d}.txt").write_text(f"a gradient drifting right, video {v}")
    return str(root / "*.mp4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make", type=int, default=0, help="synthesise this many videos into --out first")
    parser.add_argument("--out", default="videos", help="where --make writes")
    parser.add_argument("--pattern", help="the videos' glob (default: --out's *.mp4)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    pattern = make_videos(Path(args.out), args.make) if args.make else args.pattern or f"{args.out}/*.mp4"
    loader = zf.Loader(spec(pattern), rank=0, world_size=1)
    try:
        for step, batch in loader:
            if step >= args.steps:
                break
            shapes = {k: list(np.asarray(v).shape) for k, v in sorted(batch.items())}
            print(step, zf.batch_digest(batch)[:16], shapes)
    finally:
        loader.close()


if __name__ == "__main__":
    main()
