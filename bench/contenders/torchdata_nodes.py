"""Contender: ``torchdata.nodes`` (0.11) pipeline (peers' venv).

``IterableWrapper`` over the mixed documents of this rank (``bench.workload.iter_mixed``),
``ParallelMapper`` tokenizing in ``workers`` processes (in order), a small custom ``BaseNode``
that packs and shuffles (its state: the packer's carry, the shuffle buffer and the RNG, as the
nodes API asks a custom node to keep), ``Batcher``, a collating ``Mapper``, ``Loader``. Its
checkpoint is ``Loader.state_dict()``; ``IterableWrapper`` resumes by skipping the documents
it already gave.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from bench.contenders.harness import Peer, TorchSession, main
from bench.workload import Packer, TextWorkload, encode, iter_mixed, load_tokenizer


class _Encode:
    def __init__(self, w: TextWorkload) -> None:
        self.w = w
        self.tok: Any = None

    def __call__(self, text: str) -> np.ndarray:
        if self.tok is None:
            self.tok, self.eos = load_tokenizer(self.w)
        return encode(self.tok, self.eos, text)


class _Documents:
    """Re-iterable: ``IterableWrapper`` calls ``iter`` again on every reset."""

    def __init__(self, w: TextWorkload, part: int, parts: int) -> None:
        self.w, self.part, self.parts = w, part, parts

    def __iter__(self) -> Iterator[str]:
        return iter_mixed(self.w, self.part, self.parts)


def _collate(items: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([x[k] for x in items]) for k in items[0]}


def _pack_shuffle_node(source: Any, seq_len: int, buffer: int, seed: int) -> Any:
    from torchdata.nodes import BaseNode

    class PackShuffle(BaseNode):  # type: ignore[misc, type-arg]
        def __init__(self) -> None:
            super().__init__()
            self.source = source

        def reset(self, initial_state: dict[str, Any] | None = None) -> None:
            super().reset(initial_state)
            self.packer = Packer(seq_len)
            self.items: list[dict[str, np.ndarray]] = []
            self.ready: list[dict[str, np.ndarray]] = []
            self.rng = random.Random(seed)
            if initial_state is None:
                self.source.reset()
                return
            self.source.reset(initial_state["source"])
            p = initial_state["packer"]
            self.packer._ids, self.packer._pos, self.packer._seg = (
                list(p["ids"]),
                list(p["pos"]),
                list(p["seg"]),
            )
            self.packer._fill, self.packer._docs = p["fill"], p["docs"]
            self.items, self.ready = initial_state["items"], initial_state["ready"]
            self.rng.setstate(initial_state["rng"])

        def next(self) -> dict[str, np.ndarray]:
            while not self.ready:
                for seq in self.packer.add(next(self.source)):
                    self.items.append(seq)
                    if len(self.items) >= buffer:
                        i = self.rng.randrange(len(self.items))
                        self.items[i], self.items[-1] = self.items[-1], self.items[i]
                        self.ready.append(self.items.pop())
            return self.ready.pop(0)

        def get_state(self) -> dict[str, Any]:
            p = self.packer
            return {
                "source": self.source.state_dict(),
                # copies: Prefetcher keeps this state while the node goes on
                "packer": {
                    "ids": list(p._ids),
                    "pos": list(p._pos),
                    "seg": list(p._seg),
                    "fill": p._fill,
                    "docs": p._docs,
                },
                "items": list(self.items),
                "ready": list(self.ready),
                "rng": self.rng.getstate(),
            }

    return PackShuffle()


class TorchdataNodes(Peer):
    name = "torchdata_nodes"

    def open(
        self, workload: TextWorkload, *, rank: int, world_size: int, workers: int, state: bytes | None
    ) -> TorchSession:
        from torchdata import nodes

        docs = nodes.IterableWrapper(_Documents(workload, rank, world_size))
        ids = nodes.ParallelMapper(
            docs, map_fn=_Encode(workload), num_workers=workers, method="process", in_order=True
        )
        seqs = _pack_shuffle_node(ids, workload.seq_len, workload.shuffle_total, workload.seed)
        batches = nodes.Mapper(nodes.Batcher(seqs, batch_size=workload.global_batch // world_size), _collate)
        loader = nodes.Loader(nodes.Prefetcher(batches, prefetch_factor=2))
        return TorchSession(loader, state=state)


if __name__ == "__main__":
    sys.exit(main(TorchdataNodes))
