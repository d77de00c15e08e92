"""Contender: Hugging Face ``datasets`` streaming (peers' venv), the usual recipe.

``load_dataset("json", streaming=True)`` per source, ``interleave_datasets`` by the workload's
weights, repeated without end (``repeat(None)``: the resume study's 10,000 steps outrun one
epoch of the data), ``map(batched=True)`` to tokenize (the same HF tokenizer, EOS appended), a second
batched ``map`` that concatenates the batch's documents and cuts them into ``seq_len`` pieces
(the remainder of each map batch is dropped, as in the ``group_texts`` recipe), ``shuffle``
with a buffer (each worker holds ``shuffle_total / workers``), ``split_dataset_by_node`` for
ranks, batched by torchdata's ``StatefulDataLoader`` (which saves the datasets' own
``state_dict`` per worker, as ``datasets`` documents for resuming).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from bench.contenders.harness import Peer, TorchSession, main
from bench.workload import TextWorkload, load_tokenizer, shards

MAP_BATCH = 256  # documents per map batch (tokenize, then pack)


class _Tokenize:
    def __init__(self, w: TextWorkload) -> None:
        self.w = w
        self.tok: Any = None

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self.tok is None:
            self.tok, self.eos = load_tokenizer(self.w)
        encoded = self.tok.encode_batch(batch["text"], add_special_tokens=False)
        return {"ids": [[*e.ids, self.eos] for e in encoded]}


class _Pack:
    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        docs = [np.asarray(d, dtype=np.int32) for d in batch["ids"]]
        ids = np.concatenate(docs)
        starts = np.zeros(len(ids), dtype=bool)
        starts[np.cumsum([0, *(len(d) for d in docs[:-1])])] = True
        n = len(ids) // self.seq_len
        out: dict[str, list[Any]] = {"input_ids": [], "position_ids": [], "segment_ids": []}
        for i in range(n):
            sl = slice(i * self.seq_len, (i + 1) * self.seq_len)
            st = starts[sl].copy()
            st[0] = True
            seg = np.cumsum(st, dtype=np.int32) - 1
            first = np.flatnonzero(st)
            pos = np.arange(self.seq_len, dtype=np.int32) - first[seg].astype(np.int32)
            out["input_ids"].append(ids[sl])
            out["position_ids"].append(pos)
            out["segment_ids"].append(seg)
        return out


def _collate(items: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    return {k: np.stack([np.asarray(x[k], dtype=np.int32) for x in items]) for k in items[0]}


def build_dataset(w: TextWorkload, rank: int, world_size: int, workers: int) -> Any:
    from datasets import interleave_datasets, load_dataset
    from datasets.distributed import split_dataset_by_node

    names = sorted(w.sources)
    streams = [
        load_dataset("json", data_files=shards(w.sources[n]), split="train", streaming=True).select_columns(
            ["text"]
        )
        for n in names
    ]
    total = sum(w.weights[n] for n in names)
    ds = interleave_datasets(
        streams,
        probabilities=[w.weights[n] / total for n in names],
        seed=w.seed,
        stopping_strategy="all_exhausted",
    ).repeat(None)  # epochs without end, as every other contender's stream (10,000 steps outrun one)
    ds = ds.map(_Tokenize(w), batched=True, batch_size=MAP_BATCH, remove_columns=["text"])
    ds = ds.map(_Pack(w.seq_len), batched=True, batch_size=MAP_BATCH, remove_columns=["ids"])
    ds = ds.shuffle(seed=w.seed, buffer_size=max(1, w.shuffle_total // max(1, workers)))
    if world_size > 1:
        ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
    return ds


class HfDatasets(Peer):
    name = "hf_datasets"

    def open(
        self, workload: TextWorkload, *, rank: int, world_size: int, workers: int, state: bytes | None
    ) -> TorchSession:
        from torchdata.stateful_dataloader import StatefulDataLoader

        ds = build_dataset(workload, rank, world_size, workers)
        loader = StatefulDataLoader(
            ds, batch_size=workload.global_batch // world_size, num_workers=workers, collate_fn=_collate
        )
        return TorchSession(loader, state=state)


if __name__ == "__main__":
    sys.exit(main(HfDatasets))
