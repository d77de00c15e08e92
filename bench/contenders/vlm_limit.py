"""VLM contender: the limit of the work itself, decode + resize + caption tokenize in 2 processes.

No loader, no packing, no batches: each of ``workers`` spawned processes holds its share of the
samples (every ``workers``-th) in memory as bytes, does a few untimed, waits at a barrier with
the others, then runs ``decode_resize`` and the HF tokenizer (EOS appended) over its share in
order, whole passes only (so every process sees its share's mix of small stamps and large
photos), until it has done at least its part of ``steps x global_batch x max_images`` images.
images/s = all processes' images over the slowest one's time; caption tokens/s likewise.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from bench.contenders.limit import run_parts
from bench.vlm import VlmWorkload, contender_main, decode_resize, iter_samples
from bench.workload import encode, load_tokenizer

WARM_SAMPLES = 8


def _worker(w: VlmWorkload, part: int, parts: int, target: int, barrier: Any, out: Any) -> None:
    tok, eos = load_tokenizer(w)
    samples = [(data, caption) for _key, data, caption in iter_samples(w, part, parts)]
    for data, caption in samples[:WARM_SAMPLES]:
        decode_resize(data, w.size)
        encode(tok, eos, caption)
    passes = max(1, math.ceil(target / max(1, len(samples))))
    barrier.wait()
    start, cpu = time.perf_counter(), time.process_time()
    images = tokens = 0
    for _ in range(passes):
        for data, caption in samples:
            decode_resize(data, w.size)
            tokens += len(encode(tok, eos, caption))
            images += 1
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    out.put({"part": part, "images": images, "tokens": tokens, "seconds": seconds, "cpu_seconds": cpu})


def run(w: VlmWorkload, task: dict[str, Any]) -> dict[str, Any]:
    workers = int(task["workers"])
    target = int(task["steps"]) * w.global_batch * w.max_images // workers
    results = run_parts(_worker, (w,), workers, target)
    seconds = max(r["seconds"] for r in results)
    images, tokens = sum(r["images"] for r in results), sum(r["tokens"] for r in results)
    return {
        "images": images,
        "caption_tokens": tokens,
        "seconds": seconds,
        "images_per_s": images / seconds,
        "caption_tokens_per_s": tokens / seconds,
        "worker_seconds": [r["seconds"] for r in results],
        "cpu_seconds": sum(r["cpu_seconds"] for r in results),  # the work alone, every process
    }


if __name__ == "__main__":
    sys.exit(contender_main("limit", run))
