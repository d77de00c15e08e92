"""VLM contender: PyTorch ``DataLoader`` over an ``IterableDataset`` doing the same steps in plain code.

Worker ``k`` of ``workers`` takes every ``workers``-th sample of the tars (``bench.vlm.iter_samples``),
decodes and resizes its image (``decode_resize``, the same pixels as zephon-flow's operators),
tokenizes its caption with the HF tokenizer and packs with ``PackMultimodal``'s rule
(``PlainPacker``), epoch after epoch; the loader batches ``global_batch`` sequences
(``num_workers=workers``, ``prefetch_factor=2``). Batches have zephon-flow's shapes, without its
``documents`` provenance field.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

from bench.vlm import VlmWorkload, contender_main, measure, plain_sequences


def _dataset(w: VlmWorkload) -> Any:
    import torch.utils.data as tud

    class VlmPipeline(tud.IterableDataset):  # type: ignore[misc, type-arg]
        def __iter__(self) -> Iterator[dict[str, Any]]:
            info = tud.get_worker_info()
            worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
            yield from plain_sequences(w, worker, workers)

    return VlmPipeline()


def run(w: VlmWorkload, task: dict[str, Any]) -> dict[str, Any]:
    import torch

    start = time.perf_counter()
    workers = int(task["workers"])
    loader = torch.utils.data.DataLoader(
        _dataset(w),
        batch_size=w.global_batch,
        num_workers=workers,
        prefetch_factor=2 if workers > 0 else None,
        persistent_workers=False,
    )
    it = iter(loader)

    def batches() -> Iterator[dict[str, Any]]:
        for batch in it:
            yield {k: v.numpy() for k, v in batch.items()}

    try:
        return measure(batches(), w, start=start, steps=int(task["steps"]), warmup=int(task["warmup"]))
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


if __name__ == "__main__":
    sys.exit(contender_main("torch_dataloader", run))
