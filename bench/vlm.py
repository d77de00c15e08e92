"""The vision-language workload: its definition, its steps as plain functions, and how a run is timed.

The work, as every contender does it: read WebDataset-style tars (an image ``.png`` or ``.jpg``
and a ``.txt`` caption per sample), decode each image to RGB (JPEG draft at the target size,
EXIF orientation applied, transparency composited over white), resize it by center crop
(bicubic) to ``size x size`` (336), tokenize the caption with the bench's GPT-2 HF tokenizer
(EOS appended), and pack samples into sequences of ``seq_len`` (2048) tokens: per sample
``tokens_per_image`` (576, a 336 px image in 14 px patches) image placeholder ids
(``image_token_id``, an id past GPT-2's vocabulary) then its caption, at most ``max_images``
(3: 4 x 576 > 2048) images per sequence, a sample never split (zephon-flow's
``PackMultimodal`` rule). No shuffle. Batches are ``global_batch`` (8) sequences.

This module holds what the three contenders' processes share (``bench/contenders/vlm_*.py``):
the ``VlmWorkload`` (plain data, written to JSON by the orchestrator), the plain steps that the
limit and torch's ``DataLoader`` use (``iter_samples``, ``decode_resize``, ``PlainPacker``),
and ``measure``/``contender_main``, which time every loader the same way.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np

from bench.contenders.harness import emit_outcome, rate, time_batches
from bench.workload import encode, load_tokenizer

IMAGE_EXTS = ("jpg", "png")
_ALPHA_MODES = ("RGBA", "LA", "La", "RGBa", "PA")
_WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")
_ORIENTATION = 0x0112  # the EXIF tag


@dataclass(frozen=True)
class VlmWorkload:
    """Where the data is and the pipeline's geometry; the same for every contender."""

    tars: str  # glob of the WebDataset tars, read in sorted order
    tokenizer: str  # tokenizer.json (HF ``tokenizers``)
    size: int = 336
    seq_len: int = 2048
    tokens_per_image: int = 576
    max_images: int = 3
    image_token_id: int = 50257  # GPT-2's vocabulary ends at 50256: never a caption token
    pad_id: int = 0
    global_batch: int = 8
    lanes: int = 4  # zephon-flow's lanes
    samples_per_split: int = 32  # zephon-flow's ReadWebDataset splits
    seed: int = 0
    eos_token: str = "<|endoftext|>"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> VlmWorkload:
        return VlmWorkload(**json.loads(text))


def load_workload(path: str) -> VlmWorkload:
    with open(path, encoding="utf-8") as f:
        return VlmWorkload.from_json(f.read())


# -- the steps as plain functions ----------------------------------------------------------------


def shards(w: VlmWorkload) -> list[str]:
    import glob

    found = sorted(glob.glob(w.tars))
    if not found:
        raise FileNotFoundError(f"no tar matches {w.tars!r}")
    return found


def iter_samples(w: VlmWorkload, part: int = 0, parts: int = 1) -> Iterator[tuple[str, bytes, str]]:
    """``(key, image bytes, caption)`` of every ``parts``-th sample from ``part``, one pass over
    the shards in order. Members are grouped by key (the name up to the basename's first dot);
    only the chosen samples' data is read."""
    number = 0
    for path in shards(w):
        with tarfile.open(path, "r:") as tar:
            key, members = None, {}
            for info in [*tar.getmembers(), None]:
                name = None if info is None else info.name.rpartition("/")[2]
                this = None if name is None else name.partition(".")[0]
                if key is not None and this != key:
                    if number % parts == part:
                        image = next((members[e] for e in IMAGE_EXTS if e in members), None)
                        if image is not None and "txt" in members:
                            caption = tar.extractfile(members["txt"]).read().decode("utf-8")  # type: ignore[union-attr]
                            yield key, tar.extractfile(image).read(), caption  # type: ignore[union-attr]
                    number += 1
                    members = {}
                if info is None or name is None or not info.isfile():
                    continue
                key = this
                members[name.partition(".")[2].lower()] = info


def decode_resize(data: bytes, size: int) -> np.ndarray:
    """``DecodeImage(draft_size=size)`` then ``ResizeImage(size)`` in plain Pillow: the same pixels."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as opened:
        im: Image.Image = opened
        if im.format == "JPEG":
            im.draft(im.mode, (size, size))
        im.load()
        if im.getexif().get(_ORIENTATION, 1) in range(2, 9):
            im = ImageOps.exif_transpose(im)
        if im.mode in _WIDE_MODES:
            wide = np.asarray(im).astype(np.int64)
            im = Image.fromarray(((np.clip(wide, 0, 65535) * 255 + 32767) // 65535).astype(np.uint8))
        if im.mode in _ALPHA_MODES or "transparency" in im.info:
            rgba = im if im.mode == "RGBA" else im.convert("RGBA")
            if rgba.getchannel("A").getextrema() == (255, 255):  # compositing would change nothing
                im = rgba
            else:
                im = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        if im.mode != "RGB":
            im = im.convert("RGB")
        w, h = im.size
        side = float(min(w, h))
        box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
        return np.asarray(im.resize((size, size), Image.Resampling.BICUBIC, box=box), dtype=np.uint8)


class PlainPacker:
    """``PackMultimodal``'s rule in plain code: greedy, in order, a sample never split, at most
    ``max_images`` per sequence, a caption cut to fit; fields as ``PackMultimodal`` gives them
    (without its ``documents`` provenance)."""

    def __init__(self, w: VlmWorkload) -> None:
        self.w = w
        self._ids: list[np.ndarray] = []
        self._images: list[np.ndarray] = []
        self._used = 0
        self._truncated = 0

    def add(self, caption: np.ndarray, image: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        w = self.w
        room = w.seq_len - w.tokens_per_image
        ids = np.concatenate([np.full(w.tokens_per_image, w.image_token_id, dtype=np.int32), caption[:room]])
        if self._used + ids.size > w.seq_len:
            yield self._close()
        self._ids.append(ids)
        self._images.append(image)
        self._used += ids.size
        self._truncated += max(0, caption.size - room)
        if self._used == w.seq_len or len(self._images) == w.max_images:
            yield self._close()

    def _close(self) -> dict[str, np.ndarray]:
        w = self.w
        pad = w.seq_len - self._used
        images = np.zeros((w.max_images, *self._images[0].shape), dtype=np.uint8)
        images[: len(self._images)] = self._images
        out = {
            "input_ids": np.concatenate([*self._ids, np.full(pad, w.pad_id, dtype=np.int32)]),
            "position_ids": np.concatenate(
                [*(np.arange(a.size, dtype=np.int32) for a in self._ids), np.zeros(pad, dtype=np.int32)]
            ),
            "segment_ids": np.concatenate(
                [
                    *(np.full(a.size, i, dtype=np.int32) for i, a in enumerate(self._ids)),
                    np.full(pad, -1, dtype=np.int32),
                ]
            ),
            "images": images,
            "image_count": np.asarray(len(self._images), dtype=np.int32),
            "truncated_tokens": np.asarray(self._truncated, dtype=np.int32),
        }
        self._ids, self._images, self._used, self._truncated = [], [], 0, 0
        return out


def plain_sequences(w: VlmWorkload, part: int, parts: int) -> Iterator[dict[str, np.ndarray]]:
    """The whole pipeline for one worker's share (every ``parts``-th sample), epoch after epoch."""
    tok, eos = load_tokenizer(w)
    packer = PlainPacker(w)
    while True:
        for _key, data, caption in iter_samples(w, part, parts):
            yield from packer.add(encode(tok, eos, caption), decode_resize(data, w.size))


def counts(batch: dict[str, Any], w: VlmWorkload) -> tuple[int, int]:
    """(images, caption tokens) delivered in a batch; caption tokens are the non-pad,
    non-placeholder ids (EOS included)."""
    ids, seg = np.asarray(batch["input_ids"]), np.asarray(batch["segment_ids"])
    return int(np.asarray(batch["image_count"]).sum()), int(((seg >= 0) & (ids != w.image_token_id)).sum())


# -- timing, the same for every loader -----------------------------------------------------------


def measure(
    batches: Iterator[dict[str, Any]], w: VlmWorkload, *, start: float, steps: int, warmup: int
) -> dict[str, Any]:
    """The first batch, ``warmup`` untimed batches, ``steps`` timed ones (the window).

    Rates in the window are per second between the delivery of the last warm-up batch and of
    the last timed one; the window is also cut in halves (``half_rate_ratio``, near 1 when the
    loader's read-ahead has drained). End-to-end rates run from ``start`` (before the loader
    was built) to the last batch. ``padding_fraction`` is pad tokens over all tokens.
    """
    timed = time_batches(batches, partial(_counts, w), steps=steps, warmup=warmup)
    marks = timed.marks  # (delivery instant, images, caption tokens, pad tokens, tokens) per batch
    lo, hi = warmup, warmup + steps
    mid = lo + steps // 2
    halves = (rate(marks, lo, mid, 1), rate(marks, mid, hi, 1))
    elapsed = marks[-1][0] - start
    return {
        "ttfb_s": marks[0][0] - start,
        "steps": steps,
        "warmup": warmup,
        "seconds": marks[hi][0] - marks[lo][0],
        "images": sum(m[1] for m in marks[lo + 1 :]),
        "caption_tokens": sum(m[2] for m in marks[lo + 1 :]),
        "images_per_s": rate(marks, lo, hi, 1),
        "caption_tokens_per_s": rate(marks, lo, hi, 2),
        "end_to_end_images_per_s": sum(m[1] for m in marks) / elapsed,
        "end_to_end_caption_tokens_per_s": sum(m[2] for m in marks) / elapsed,
        "first_half_images_per_s": halves[0],
        "second_half_images_per_s": halves[1],
        "half_rate_ratio": halves[0] / halves[1] if halves[0] and halves[1] else None,
        "padding_fraction": sum(m[3] for m in marks) / max(1, sum(m[4] for m in marks)),
        "first_batch_shapes": {k: list(np.asarray(v).shape) for k, v in sorted(timed.first.items())},
        **timed.cores(lo, hi),
    }


def _counts(w: VlmWorkload, batch: dict[str, Any]) -> tuple[int, int, int, int]:
    """(images, caption tokens, pad tokens, tokens) of a batch."""
    seg = np.asarray(batch["segment_ids"])
    return (*counts(batch, w), int((seg < 0).sum()), int(seg.size))


def contender_main(name: str, run: Callable[[VlmWorkload, dict[str, Any]], dict[str, Any]]) -> int:
    """A contender process: ``--workload W.json --task '{"steps", "warmup", "workers"}'``; prints
    one ``BENCH-RESULT`` JSON line (``ok`` false and the error when ``run`` raised)."""
    parser = argparse.ArgumentParser(description=f"vision-language bench contender {name}")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--task", required=True)
    args = parser.parse_args()
    task = json.loads(args.task)
    return emit_outcome({"contender": name}, lambda: run(load_workload(args.workload), task))
