"""Test-only helpers for the vision-language operators: generated images, a tiny sample source, a spec.

``ReadImageFolder`` stands in for the WebDataset tar source: every image file is one split
holding one record, decoded into a WebDataset-like sample ``{"__key__", <ext>, "txt"}``.
"""

from __future__ import annotations

import io
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
from helpers import random_text
from PIL import Image

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.source import START, Record, Source, Split


def encode(image: Image.Image, fmt: str, **save: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def gradient(width: int, height: int, *, seed: int = 0) -> Image.Image:
    """A smooth RGB picture with some noise: compresses like a photo, differs per seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    noisy = rgb + rng.integers(-20, 21, size=rgb.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


class ReadImageFolder(Source):
    """Samples from image files: one split per file; the caption is the sibling ``.txt`` file."""

    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        return [Split(path, 0, 1) for path in paths]

    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        if position != START:
            return
        with open(split.path, "rb") as f:
            image = f.read()
        with open(os.path.splitext(split.path)[0] + ".txt", "rb") as f:
            caption = f.read()
        yield 1, Record((image, caption), split.path, "the whole file", 0)

    def decode(self, record: Record, operator: str) -> list[Any]:
        image, caption = record.payload
        stem, ext = os.path.splitext(os.path.basename(record.path))
        return [{"__key__": stem, ext.lstrip("."): image, "txt": caption}]


def write_captioned_images(root: Path, n: int, *, seed: int = 0, ext: str = "jpg") -> str:
    """``n`` JPEG (or PNG) images of varied sizes with captions; returns the glob of the images."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n):
        image = gradient(rng.randint(20, 90), rng.randint(20, 90), seed=seed * 1000 + i)
        data = encode(image, "JPEG", quality=85) if ext == "jpg" else encode(image, "PNG")
        (root / f"{i:05d}.{ext}").write_bytes(data)
        (root / f"{i:05d}.txt").write_text(f"image {i} {random_text(rng, rng.randint(1, 12))}")
    return str(root / f"*.{ext}")


def vlm_spec(
    pattern: str,
    tokenizer_json: str,
    *,
    lanes: int = 4,
    seed: int = 0,
    global_batch_size: int = 4,
    size: int = 8,
    seq_len: int = 24,
    tokens_per_image: int = 4,
    max_images: int = 3,
    epochs: int | None = None,
) -> zf.LoaderSpec:
    """``images -> DecodeImage -> ResizeImage -> TokenizeField -> PackMultimodal``."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        samples = p | "images" >> ReadImageFolder(pattern, epochs=epochs)
        decoded = samples | "decode" >> beam.ParDo(ops.DecodeImage(field="jpg", draft_size=size))
        resized = decoded | "resize" >> beam.ParDo(ops.ResizeImage(size))
        tokens = resized | "caption" >> beam.ParDo(ops.TokenizeField(tokenizer_json, field="txt"))
        return tokens | "pack" >> beam.ParDo(
            ops.PackMultimodal(
                seq_len, image_token_id=1, tokens_per_image=tokens_per_image, max_images=max_images
            )
        )

    return zf.LoaderSpec(build, lanes=lanes, seed=seed, global_batch_size=global_batch_size)


class ParseSample(beam.DoFn):  # type: ignore[misc]
    """``"key|5 6|7"`` -> ``{"__key__": "key", "text_ids": [5, 6], "image": 2x2x1 of 7}``."""

    def __init__(self, side: int = 2) -> None:
        self.side = side

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        key, ids, fill = text.split("|")
        yield {
            "__key__": key,
            "text_ids": np.asarray([int(t) for t in ids.split()], dtype=np.int32),
            "image": np.full((self.side, self.side, 1), int(fill), dtype=np.uint8),
        }
