"""A tiny video-language model trained on CPU from zephon-flow's video pipeline, checkpointed and resumed on the same batches.

    python examples/train_tiny_video.py --steps 40 --checkpoint-every 10 --out run-video/
    python examples/train_tiny_video.py --steps 40 --out run-video/ --resume run-video/step-000010

The data is made here, offline: ``--videos`` small H.264 videos synthesised with PyAV, each a
pattern drifting one way (left, right, up or down) with a sibling ``.txt`` caption saying which.
The pipeline is ``examples/video.py``'s ``spec(pattern)``, unchanged: ``ReadVideo`` plans clips
of 8 frames from each file's index, ``DecodeVideo`` seeks and decodes 4 of them at 32x32, the
caption becomes byte ids, and ``PackVideo`` packs clips and captions into sequences of 160
tokens, 4 placeholders per frame. The model embeds each frame as 4 patches in place of its
placeholders and predicts the caption's bytes (attention stays inside each sample,
``segment_ids``); a caption's last word can only be told from the frames. Every
``--checkpoint-every`` steps model, optimizer and data state go into one
``torch.distributed.checkpoint`` directory; per step ``log.jsonl`` gets the step, the loss and
the batch digest, so a resumed run shows the same batches (and, on one machine, the same
losses) as the run it resumes: a resume inside a video decodes from the clip it stopped at.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from zephon_flow.torch import ZephonDataset


def _example(stem: str) -> ModuleType:
    """``examples/<stem>.py``, loaded by path (registered by name: ``video.py``'s caption
    function is pickled by reference)."""
    name = f"zephon_example_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


VIDEO = _example("video")  # the pipeline this trains on
VLM = _example("train_tiny_vlm")  # its model and training loop
SIZE, FRAMES, MAX_CLIPS = VIDEO.SIZE, VIDEO.FRAMES, VIDEO.MAX_CLIPS
SEQ_LEN, TOKENS_PER_FRAME = VIDEO.SEQ_LEN, VIDEO.TOKENS_PER_FRAME
PATCH = SIZE // 2  # 2 x 2 patches a frame: TOKENS_PER_FRAME of them
VOCAB = 256 + 2  # caption bytes + 2; 0 pads, 1 is the placeholder
DIRECTIONS = {"left": (0, -3), "right": (0, 3), "up": (-3, 0), "down": (3, 0)}
assert (SIZE // PATCH) ** 2 == TOKENS_PER_FRAME


# -- the data ----------------------------------------------------------------------------------
def write_videos(folder: Path, count: int, *, seed: int = 0) -> str:
    """``count`` captioned H.264 videos (48x32, 8 fps, a key frame every 8 frames, 24 to 40
    frames), each a pattern drifting one way; their glob."""
    import av  # the ``video`` extra

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:32, 0:48]
    names = list(DIRECTIONS)
    for v in range(count):
        direction = names[v % len(names)]
        dy, dx = DIRECTIONS[direction]
        phase = rng.integers(0, 64, size=3)
        with av.open(str(folder / f"v{v:03d}.mp4"), "w") as container:
            stream = container.add_stream("libx264", rate=8)
            stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
            stream.codec_context.gop_size = 8
            for i in range(24 + 8 * (v % 3)):
                yy, xx = y - dy * i, x - dx * i
                rgb = np.stack(
                    [(xx * 8 + phase[0]) % 256, (yy * 8 + phase[1]) % 256, ((xx + yy) * 4 + phase[2]) % 256],
                    -1,
                )
                frame = av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        (folder / f"v{v:03d}.txt").write_text(f"drifting {direction}")
    return str(folder / "*.mp4")


# -- the model ---------------------------------------------------------------------------------
class TinyVideoLM(VLM.TinyVLM):  # type: ignore[misc,name-defined]
    """The VLM example's model with each clip's frames where its placeholders are: 4 patches a
    frame, plus an embedding of the frame's place in its clip."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__(VOCAB, VIDEO.VIDEO_TOKEN, dim, seq_len=SEQ_LEN, patch_values=PATCH * PATCH * 3)
        self.frame_index = nn.Embedding(FRAMES, dim)

    def embed_media(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        videos = batch["videos"].float() / 255.0  # [B, clips, frames, H, W, C]
        b, m, t = videos.shape[:3]
        side = SIZE // PATCH
        patches = videos.reshape(b, m, t, side, PATCH, side, PATCH, 3).permute(0, 1, 2, 3, 5, 4, 6, 7)
        embedded = self.patches(patches.reshape(b, m, t, TOKENS_PER_FRAME, -1))
        embedded = embedded + self.frame_index.weight[None, None, :, None, :]
        return embedded.reshape(b, m * t * TOKENS_PER_FRAME, -1)  # type: ignore[no-any-return]


# -- training ----------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = Path(args.out) / "videos"
    pattern = str(data / "*.mp4") if data.is_dir() else write_videos(data, args.videos)
    model = TinyVideoLM()
    ds = ZephonDataset.from_loader(VIDEO.spec(pattern))
    # The VLM example's loss (caption tokens within a sample) and loop (DCP checkpoints, resume).
    return VLM.fit(ds, model, lambda batch: VLM.loss_of(model, batch), args)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = VLM.arguments("train a tiny video-language model from zephon-flow on CPU", "run-video")
    parser.add_argument("--videos", type=int, default=16, help="videos to synthesise (first run in --out)")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return train(args)  # type: ignore[no-any-return]


if __name__ == "__main__":
    main()
