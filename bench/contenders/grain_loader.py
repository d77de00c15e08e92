"""Contender: Grain (0.2.18) with its own mixing, packing, shuffling and processes (peers' venv).

Each source is a random-access ``MapDataset`` over its JSONL lines (a line-offset index built at
start), ``MapDataset.mix`` by the workload's weights, sliced ``[rank::world_size]``, tokenized
by ``map`` (the same HF tokenizer, EOS appended), then ``to_iter_dataset``,
``ConcatThenSplitIterDataset`` (Grain's concat packing), ``WindowShuffleIterDataset`` (window
``shuffle_total / workers``), ``batch`` and ``mp_prefetch`` over ``workers`` processes. The
checkpoint is the iterator's ``get_state()``.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from bench.contenders.harness import Batch, Peer, main
from bench.workload import TextWorkload, encode, load_tokenizer, shards


class JsonlLines:
    """Random access to the ``text`` of every line of some JSONL files (``os.pread``: Grain may
    read from several threads of a worker at once)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        index: list[tuple[int, int, int]] = []
        for k, path in enumerate(paths):
            with open(path, "rb") as f:
                offset = 0
                for line in f:
                    index.append((k, offset, len(line)))
                    offset += len(line)
        self.index = np.asarray(index, dtype=np.int64)
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> str:
        k, offset, length = (int(x) for x in self.index[i])
        fd = self._fds.get(k)
        if fd is None:
            fd = self._fds.setdefault(k, os.open(self.paths[k], os.O_RDONLY))
        return str(json.loads(os.pread(fd, length, offset))["text"])

    def __getstate__(self) -> dict[str, Any]:
        return {"paths": self.paths, "index": self.index, "_fds": {}}


class _Encode:
    def __init__(self, w: TextWorkload) -> None:
        self.w = w
        self.tok: Any = None

    def __call__(self, text: str) -> dict[str, np.ndarray]:
        if self.tok is None:
            self.tok, self.eos = load_tokenizer(self.w)
        return {"input_ids": encode(self.tok, self.eos, text)}


def _rename(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "input_ids": x["input_ids"].astype(np.int32, copy=False),
        "position_ids": x["input_ids_positions"].astype(np.int32, copy=False),
        "segment_ids": x["input_ids_segment_ids"].astype(np.int32) - 1,  # Grain counts from 1, pad 0
    }


def _stack(items: Any) -> dict[str, np.ndarray]:
    return {k: np.stack([x[k] for x in items]) for k in items[0]}


def build(w: TextWorkload, rank: int, world_size: int, workers: int) -> Any:
    import grain
    from grain import experimental as gx

    names = sorted(w.sources)
    sources = [grain.MapDataset.source(JsonlLines(shards(w.sources[n]))) for n in names]
    ds = grain.MapDataset.mix(sources, weights=[w.weights[n] for n in names])
    ds = ds[rank::world_size].map(_Encode(w)).to_iter_dataset()
    it = gx.ConcatThenSplitIterDataset(ds, length_struct={"input_ids": w.seq_len}).map(_rename)
    it = gx.WindowShuffleIterDataset(it, window_size=max(1, w.shuffle_total // workers), seed=w.seed)
    it = it.batch(w.global_batch // world_size, batch_fn=_stack)
    return it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))


class _Session:
    def __init__(self, it: Any) -> None:
        self._it = it

    def batches(self) -> Iterator[Batch]:
        yield from self._it

    def checkpoint(self) -> bytes:
        return pickle.dumps(self._it.get_state())

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


class GrainLoader(Peer):
    name = "grain"

    def open(
        self, workload: TextWorkload, *, rank: int, world_size: int, workers: int, state: bytes | None
    ) -> _Session:
        it = iter(build(workload, rank, world_size, workers))
        if state is not None:
            it.set_state(pickle.loads(state))
        return _Session(it)


if __name__ == "__main__":
    sys.exit(main(GrainLoader))
