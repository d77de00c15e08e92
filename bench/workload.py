"""The text workload every contender runs, and plain-Python steps for the loaders that lack them.

Imported by zephon-flow's contenders (main venv) and by the peers (their own venv), so it needs
only the standard library, numpy and ``tokenizers``. A ``TextWorkload`` is plain data written to
JSON by the orchestrator and read back by each contender's process.

The steps, as every contender performs them: read the JSONL shards of 3 sources (one document
per line, field ``text``), mix them by weight, tokenize each document with the same GPT-2 HF
tokenizer (EOS appended), concat-pack into sequences of ``seq_len`` tokens, shuffle with a
buffer, batch. A sequence is ``{"input_ids", "position_ids", "segment_ids"}`` (int32), as
zephon-flow's ``Pack`` gives it; padding is ``segment_ids == -1``.
"""

from __future__ import annotations

import glob
import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

Sequence_ = dict[str, np.ndarray]


@dataclass(frozen=True)
class TextWorkload:
    """Where the data is and the pipeline's geometry; the same for every contender."""

    tokenizer: str  # tokenizer.json (HF ``tokenizers``)
    sources: dict[str, str]  # source name -> glob of its JSONL shards (read in sorted order)
    weights: dict[str, float]  # source name -> mixing weight
    seq_len: int = 2048
    global_batch: int = 64
    lanes: int = 8  # zephon-flow's lanes; peers' shuffle buffers add up to the same total
    shuffle_per_lane: int = 32
    seed: int = 0
    eos_token: str = "<|endoftext|>"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def shuffle_total(self) -> int:
        """Sequences held in shuffle buffers across the whole loader (zephon: per lane x lanes)."""
        return self.lanes * self.shuffle_per_lane

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> TextWorkload:
        return TextWorkload(**json.loads(text))

    def replace(self, **changes: Any) -> TextWorkload:
        values = asdict(self)
        values.update(changes)
        return TextWorkload(**values)


def load_workload(path: str) -> TextWorkload:
    with open(path, encoding="utf-8") as f:
        return TextWorkload.from_json(f.read())


# -- plain steps, for loaders without their own ------------------------------------------------


def iter_lines(shards: Sequence[str], part: int, parts: int) -> Iterator[str]:
    """Documents of ``shards`` (in order, repeated forever) whose line number is ``part`` mod
    ``parts``: a disjoint share per worker. Skipped lines are not parsed."""
    if not shards:
        raise ValueError("a source needs at least one shard")
    while True:
        n = 0
        for path in shards:
            with open(path, "rb") as f:
                for line in f:
                    if n % parts == part:
                        text = json.loads(line)["text"]
                        if text:
                            yield text
                    n += 1


def shards(pattern: str) -> list[str]:
    found = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    if not found:
        raise ValueError(f"no shard matches {pattern!r}")
    return found


def iter_mixed(workload: TextWorkload, part: int, parts: int) -> Iterator[str]:
    """Documents drawn from the sources by weight (a seeded draw per document)."""
    names = sorted(workload.sources)
    streams = [iter_lines(shards(workload.sources[n]), part, parts) for n in names]
    weights = [workload.weights[n] for n in names]
    rng = random.Random(workload.seed * 1_000_003 + part)
    while True:
        (i,) = rng.choices(range(len(names)), weights=weights)
        yield next(streams[i])


class Packer:
    """Concat packing into ``seq_len``, documents spilling over into the next sequence."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self._ids: list[np.ndarray] = []
        self._pos: list[np.ndarray] = []
        self._seg: list[np.ndarray] = []
        self._fill = 0
        self._docs = 0

    def add(self, ids: np.ndarray) -> Iterator[Sequence_]:
        start = 0
        while start < len(ids):
            take = min(self.seq_len - self._fill, len(ids) - start)
            self._ids.append(ids[start : start + take])
            self._pos.append(np.arange(take, dtype=np.int32))
            self._seg.append(np.full(take, self._docs, dtype=np.int32))
            self._docs += 1
            self._fill += take
            start += take
            if self._fill == self.seq_len:
                yield {
                    "input_ids": np.concatenate(self._ids).astype(np.int32, copy=False),
                    "position_ids": np.concatenate(self._pos),
                    "segment_ids": np.concatenate(self._seg),
                }
                self._ids, self._pos, self._seg, self._fill, self._docs = [], [], [], 0, 0


class ShuffleBuffer:
    """A classic shuffle buffer: fill to ``size``, then emit a random element per element added."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self._items: list[Sequence_] = []
        self._rng = random.Random(seed)

    def add(self, item: Sequence_) -> Iterator[Sequence_]:
        self._items.append(item)
        if len(self._items) >= self.size:
            i = self._rng.randrange(len(self._items))
            self._items[i], self._items[-1] = self._items[-1], self._items[i]
            yield self._items.pop()


def load_tokenizer(workload: Any) -> tuple[Any, int]:
    """The HF tokenizer and its EOS id, for any workload with ``tokenizer`` and ``eos_token``
    (text or VLM). Tokenizer threads are off: every contender gets the same 2 cores through its
    own workers, not through the tokenizer's thread pool."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(workload.tokenizer)
    eos = tok.token_to_id(workload.eos_token)
    if eos is None:
        raise ValueError(f"{workload.tokenizer}: no token {workload.eos_token!r}")
    return tok, int(eos)


def encode(tok: Any, eos: int, text: str) -> np.ndarray:
    ids = tok.encode(text, add_special_tokens=False).ids
    ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def plain_sequences(workload: TextWorkload, part: int, parts: int) -> Iterator[Sequence_]:
    """The whole pipeline for one worker's share, with a shuffle buffer of its share's size."""
    tok, eos = load_tokenizer(workload)
    packer = Packer(workload.seq_len)
    shuffle = ShuffleBuffer(max(1, workload.shuffle_total // parts), workload.seed * 7_919 + part)
    for text in iter_mixed(workload, part, parts):
        for seq in packer.add(encode(tok, eos, text)):
            yield from shuffle.add(seq)


def real_tokens(batch: dict[str, Any]) -> int:
    """Non-pad tokens in a batch (``segment_ids >= 0``)."""
    return int((np.asarray(batch["segment_ids"]) >= 0).sum())


def digest(batch: dict[str, Any]) -> str:
    """sha256 over every field's name, dtype, shape and bytes, in sorted field order: the same
    formula as ``zephon_flow.batch_digest``, so that every contender's batches compare."""
    import hashlib

    h = hashlib.sha256()
    for key in sorted(batch):
        arr = np.ascontiguousarray(np.asarray(batch[key]))
        h.update(f"{key}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def concat(parts: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Rank slices (in rank order) joined into a global batch."""
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in sorted(parts[0])}
