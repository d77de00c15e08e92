"""Contender: PyTorch ``DataLoader`` (or torchdata's ``StatefulDataLoader``) over an
``IterableDataset`` doing the workload's steps (``bench.workload.plain_sequences``).

Options: ``loader=plain|stateful``. Each worker of each rank reads a disjoint share of every
source (line ``i`` goes to share ``i mod (world_size * workers)``), mixes, tokenizes, packs and
shuffles it with its part of the total shuffle buffer; the loader batches
``global_batch / world_size`` sequences. ``stateful`` checkpoints with ``state_dict()``, which for
an iterable dataset without its own ``state_dict`` records how many batches each worker gave,
and on resume skips that many again (torchdata's documented fallback). Runs in either venv.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from bench.contenders.harness import Batch, TorchSession, main
from bench.workload import TextWorkload, plain_sequences


def _dataset(w: TextWorkload, rank: int, world_size: int) -> Any:
    import torch.utils.data as tud

    class TextPipeline(tud.IterableDataset):  # type: ignore[misc, type-arg]
        def __iter__(self) -> Iterator[dict[str, Any]]:
            info = tud.get_worker_info()
            worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
            yield from plain_sequences(w, rank * workers + worker, world_size * workers)

    return TextPipeline()


def _to_numpy(batch: dict[str, Any]) -> Batch:
    return {k: v.numpy() for k, v in batch.items()}


class TorchLoader:
    def __init__(self, options: dict[str, str]) -> None:
        self.kind = options.get("loader", "plain")
        self.name = f"torch_{self.kind}"
        self.resumable = self.kind == "stateful"

    def open(
        self, workload: TextWorkload, *, rank: int, world_size: int, workers: int, state: bytes | None
    ) -> TorchSession:
        import torch

        kwargs: dict[str, Any] = {
            "batch_size": workload.global_batch // world_size,
            "num_workers": workers,
            "persistent_workers": False,
        }
        if workers > 0:
            kwargs["prefetch_factor"] = 2
        dataset = _dataset(workload, rank, world_size)
        if self.kind == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return TorchSession(StatefulDataLoader(dataset, **kwargs), _to_numpy, state=state)
        if state is not None:
            raise NotImplementedError("torch DataLoader has no state")
        return TorchSession(torch.utils.data.DataLoader(dataset, **kwargs), _to_numpy)


if __name__ == "__main__":
    sys.exit(main(TorchLoader))
