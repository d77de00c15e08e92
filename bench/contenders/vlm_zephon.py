"""VLM contender: zephon-flow embedded (``zf.Loader(backend="processes", workers=2)``).

The pipeline: ``ReadWebDataset`` (fields ``jpg;png`` and ``txt``, ``epochs=None``) ->
``DecodeImage(draft_size=size)`` -> ``ResizeImage(size)`` -> ``TokenizeField`` (the HF engine,
the limit's own, EOS appended) -> ``PackMultimodal``; ``lanes`` lanes, ``global_batch`` sequences
per batch. The task's ``backend`` (default ``processes``) may name another backend.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

from bench.vlm import VlmWorkload, contender_main, measure


def make_spec(w: VlmWorkload) -> Any:
    """The vision-language workload as a zephon-flow pipeline."""
    import apache_beam as beam

    import zephon_flow as zf
    from zephon_flow import operators as ops

    def vlm(p: beam.Pipeline) -> beam.PCollection:
        samples = p | "read" >> ops.ReadWebDataset(
            w.tars, fields=("jpg;png", "txt"), samples_per_split=w.samples_per_split, epochs=None
        )
        decoded = samples | "decode" >> beam.ParDo(ops.DecodeImage(draft_size=w.size))
        resized = decoded | "resize" >> beam.ParDo(ops.ResizeImage(w.size))
        tokens = resized | "tok" >> beam.ParDo(
            ops.TokenizeField(w.tokenizer, field="txt", eos_token=w.eos_token, engine="hf")
        )
        return tokens | "pack" >> beam.ParDo(
            ops.PackMultimodal(
                w.seq_len,
                image_token_id=w.image_token_id,
                tokens_per_image=w.tokens_per_image,
                max_images=w.max_images,
                pad_id=w.pad_id,
            )
        )

    return zf.LoaderSpec(vlm, lanes=w.lanes, seed=w.seed, global_batch_size=w.global_batch)


def run(w: VlmWorkload, task: dict[str, Any]) -> dict[str, Any]:
    import zephon_flow as zf

    start = time.perf_counter()
    loader = zf.Loader(make_spec(w), backend=task.get("backend", "processes"), workers=int(task["workers"]))

    def batches() -> Iterator[dict[str, Any]]:
        for _step, batch in loader:
            yield batch

    try:
        return measure(batches(), w, start=start, steps=int(task["steps"]), warmup=int(task["warmup"]))
    finally:
        loader.close()


if __name__ == "__main__":
    sys.exit(contender_main("zephon", run))
