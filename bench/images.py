"""Images/s of DecodeImage + ResizeImage on one core, next to Pillow alone doing the same work.

Run from the repository root::

    .venv/bin/python -m bench.images                 # 300 images, 5 repeats, 224 px
    .venv/bin/python -m bench.images --quick         # a tiny smoke run

The images are JPEGs generated here (smooth shapes plus sensor-like noise, 500x375 to
1024x768, quality 90; no downloads). Both contenders decode every image to RGB and resize it
to ``size x size`` by center crop (bicubic), in this process, one image at a time:

* **pillow**: ``Image.open``, ``draft`` (when on), ``convert("RGB")``, ``resize`` of the
  central box, ``np.asarray``: the least work that gives the same pixels.
* **zephon**: ``ops.DecodeImage(draft_size=size)`` then ``ops.ResizeImage(size)`` on
  WebDataset-like samples ``{"__key__", "jpg"}``, called as the runner calls stateless DoFns.

Each configuration (JPEG draft on, and off) runs both contenders back to back in every repeat,
their order alternating, so that a noisy neighbour hurts both alike; medians over repeats and
the median of the paired ratios are reported. Rates are images per CPU second of this process
(``time.process_time``: everything runs in its one thread, so this is "per core" and robust to
other processes competing for the cores), with the wall-clock ratio alongside. Nothing here is
asserted.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import PIL
from PIL import Image

from bench.stats import median
from zephon_flow import operators as ops

DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "images.json")
SIZES = ((500, 375), (640, 480), (800, 600), (1024, 768))


def make_jpegs(n: int, *, seed: int = 0) -> list[bytes]:
    """``n`` photo-like JPEGs: low-frequency colour fields plus mild noise."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        x, y = np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32)
        channels = []
        for _ in range(3):
            fx, fy = rng.uniform(0.002, 0.02, size=2).tolist()
            phase = rng.uniform(0, 6.28)
            channels.append(128 + 100 * np.outer(np.cos(y * fy), np.sin(x * fx + phase)))
        pixels = np.stack(channels, axis=-1) + rng.integers(-10, 11, size=(h, w, 3))
        buf = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def pillow_alone(data: bytes, size: int, draft: bool) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        if draft:
            im.draft("RGB", (size, size))
        rgb = im.convert("RGB")
    w, h = rgb.size
    side = min(w, h)  # the central square
    box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
    return np.asarray(rgb.resize((size, size), Image.Resampling.BICUBIC, box=box))


def zephon_ops(size: int, draft: bool) -> Callable[[bytes], np.ndarray]:
    decode = ops.DecodeImage(field="jpg", draft_size=size if draft else None)
    resize = ops.ResizeImage(size)

    def run(data: bytes) -> np.ndarray:
        (decoded,) = decode.process({"__key__": "k", "jpg": data})
        (resized,) = resize.process(decoded)
        image: np.ndarray = resized["image"]
        return image

    return run


def timed(fn: Callable[[bytes], np.ndarray], images: Sequence[bytes]) -> tuple[float, float]:
    """Images per CPU second (of this one-threaded process) and per wall second of ``fn``."""
    cpu, wall = time.process_time(), time.perf_counter()
    for data in images:
        fn(data)
    return len(images) / (time.process_time() - cpu), len(images) / (time.perf_counter() - wall)


def measure(images: Sequence[bytes], *, size: int, repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for draft in (True, False):
        tag = "draft" if draft else "full"
        ours = zephon_ops(size, draft)

        def theirs(data: bytes, draft: bool = draft) -> np.ndarray:
            return pillow_alone(data, size, draft)

        # Same pixels, or the comparison means nothing.
        for data in images[:5]:
            if not np.array_equal(ours(data), theirs(data)):
                raise SystemExit(f"bench.images: zephon and Pillow disagree on the pixels ({tag})")
        runs: dict[str, list[float]] = {"pillow": [], "zephon": [], "pillow_wall": [], "zephon_wall": []}
        for r in range(repeats):
            order = ("pillow", "zephon") if r % 2 == 0 else ("zephon", "pillow")
            for name in order:
                per_cpu_s, per_wall_s = timed(theirs if name == "pillow" else ours, images)
                runs[name].append(per_cpu_s)
                runs[f"{name}_wall"].append(per_wall_s)
        paired = [z / p for z, p in zip(runs["zephon"], runs["pillow"], strict=True)]
        results[tag] = {
            "pillow_images_per_s": median(runs["pillow"]),
            "zephon_images_per_s": median(runs["zephon"]),
            "zephon_over_pillow": median(runs["zephon"]) / median(runs["pillow"]),
            "zephon_over_pillow_paired_median": median(paired),
            "zephon_over_pillow_wall": median(runs["zephon_wall"]) / median(runs["pillow_wall"]),
            "runs": runs,
        }
    results["draft_speedup_zephon"] = (
        results["draft"]["zephon_images_per_s"] / results["full"]["zephon_images_per_s"]
    )
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="4 images, 1 repeat")
    args = parser.parse_args(argv)
    n, repeats = (4, 1) if args.quick else (args.images, args.repeats)
    images = make_jpegs(n)
    report = {
        "images": n,
        "repeats": repeats,
        "size": args.size,
        "mean_jpeg_bytes": int(statistics.mean(len(d) for d in images)),
        "pillow_version": PIL.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        **measure(images, size=args.size, repeats=repeats),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    for tag in ("draft", "full"):
        r = report[tag]
        print(
            f"{tag:5}  pillow {r['pillow_images_per_s']:8.1f} img/cpu-s   zephon {r['zephon_images_per_s']:8.1f} img/cpu-s"
            f"   ratio {r['zephon_over_pillow']:.3f} (paired median {r['zephon_over_pillow_paired_median']:.3f},"
            f" wall clock {r['zephon_over_pillow_wall']:.3f})"
        )
    print(f"draft speed-up (zephon): {report['draft_speedup_zephon']:.2f}x   -> {args.out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
