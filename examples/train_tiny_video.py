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
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader

import zephon_flow as zf
from zephon_flow.torch import ZephonDataset


def _video_example() -> ModuleType:
    """``examples/video.py``, the pipeline this trains on (registered by name: its caption
    function is pickled by reference)."""
    name = "zephon_video_example"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "video.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


VIDEO = _video_example()
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
class TinyVideoLM(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Embedding(SEQ_LEN, dim)
        self.patches = nn.Linear(PATCH * PATCH * 3, dim)
        self.frame_index = nn.Embedding(FRAMES, dim)  # which frame of its clip a patch is from
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"].long()
        x = self.tokens(ids) + self.positions(batch["position_ids"].long())
        videos = batch["videos"].float() / 255.0  # [B, clips, frames, H, W, C]
        b, m, t = videos.shape[:3]
        side = SIZE // PATCH
        patches = videos.reshape(b, m, t, side, PATCH, side, PATCH, 3).permute(0, 1, 2, 3, 5, 4, 6, 7)
        patches = patches.reshape(b, m, t, TOKENS_PER_FRAME, -1)
        embedded = self.patches(patches) + self.frame_index.weight[None, None, :, None, :]
        embedded = embedded.reshape(b, m * t * TOKENS_PER_FRAME, -1)  # in placeholder order
        slots = ids == VIDEO.VIDEO_TOKEN
        for row in range(b):
            count = int(slots[row].sum())
            x[row, slots[row]] = embedded[row, :count]
        seg = batch["segment_ids"].long()
        causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
        allowed = causal & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
        allowed |= torch.eye(SEQ_LEN, dtype=torch.bool)  # padding attends to itself
        mask = ~allowed.repeat_interleave(self.blocks.layers[0].self_attn.num_heads, dim=0)
        return self.head(self.blocks(x, mask=mask))  # type: ignore[no-any-return]


def loss_of(model: TinyVideoLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss on the caption bytes of each sample (not on placeholders or padding)."""
    logits = model(batch)
    ids, seg = batch["input_ids"].long(), batch["segment_ids"].long()
    target = ids[:, 1:].clone()
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
    target[~same | (target == VIDEO.VIDEO_TOKEN) | (target == VIDEO.PAD)] = -100
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)


# -- training ----------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out = Path(args.out)
    data = out / "videos"
    pattern = str(data / "*.mp4") if data.is_dir() else write_videos(data, args.videos)
    model = TinyVideoLM()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ds = ZephonDataset.from_loader(VIDEO.spec(pattern))
    if args.resume:
        # get_state_dict gives the optimizer's state its full shape (moments included) to load into.
        model_state, optim_state = get_state_dict(model, optim)
        dcp.load({"model": model_state, "optim": optim_state, "data": ds}, checkpoint_id=args.resume)
        set_state_dict(model, optim, model_state_dict=model_state, optim_state_dict=optim_state)
        print(f"resumed from {args.resume} at step {ds.next_step}")
    logged = []
    with open(out / "log.jsonl", "a", encoding="utf-8") as log:
        for step, batch in DataLoader(ds, batch_size=None, num_workers=0):
            if step >= args.steps:
                break
            loss = loss_of(model, batch)
            optim.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optim.step()
            digest = zf.batch_digest({k: v.numpy() for k, v in batch.items()})
            logged.append({"step": step, "loss": loss.item(), "digest": digest})
            log.write(json.dumps(logged[-1]) + "\n")
            if (step + 1) % args.checkpoint_every == 0:
                where = out / f"step-{step + 1:06d}"
                model_state, optim_state = get_state_dict(model, optim)
                # A resumed run writes the later checkpoints again (DCP warns that it replaces them).
                dcp.save({"model": model_state, "optim": optim_state, "data": ds}, checkpoint_id=where)
                print(f"step {step}: loss {loss.item():.3f}; checkpoint at step {step + 1}: {where}")
    return logged


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description="train a tiny video-language model from zephon-flow on CPU")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--videos", type=int, default=16, help="videos to synthesise (first run in --out)")
    parser.add_argument("--out", default="run-video")
    parser.add_argument("--resume", help="a checkpoint directory OUT/step-NNNNNN")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return train(args)


if __name__ == "__main__":
    main()
