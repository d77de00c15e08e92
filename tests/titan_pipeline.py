"""The torchtitan tests' pipeline, without torchtitan: bytes of JSONL documents as token ids,
packed to ``SEQ_LEN + 1`` and shuffled, over the folder ``ZEPHON_TITAN_DATA`` names.

``expected_rows`` is what torchtitan must train on, row by row, computed by a plain
``zf.Loader``: the digest of each row's input and labels as ``ZephonTitanDataLoader`` makes them.
"""

from __future__ import annotations

import hashlib
import json
import os

import apache_beam as beam
import numpy as np

import zephon_flow as zf
from zephon_flow import operators as ops

SEQ_LEN = 16
GLOBAL_BATCH = 4
LANES = 4
IGNORE_INDEX = -100


def byte_ids(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def write_data(folder: str, documents: int = 400) -> None:
    """``docs.jsonl`` (``documents`` of them) and ``short.jsonl`` (30, for the finite pipeline)."""
    for name, count in (("docs.jsonl", documents), ("short.jsonl", 30)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            for i in range(count):
                f.write(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor " * (i % 13)}) + "\n")


def spec(global_batch_size: int = GLOBAL_BATCH) -> zf.LoaderSpec:
    """The test pipeline (``titan_pipeline:spec`` in a torchtitan config): endless."""
    return _spec("docs.jsonl", None, global_batch_size, split_bytes=2000)


def finite_spec() -> zf.LoaderSpec:
    """One pass over 30 documents (``titan_pipeline:finite_spec``): the ranks must agree on
    its last step."""
    return _spec("short.jsonl", 1, GLOBAL_BATCH, split_bytes=300)


def _spec(name: str, epochs: int | None, global_batch_size: int, *, split_bytes: int) -> zf.LoaderSpec:
    path = os.path.join(os.environ["ZEPHON_TITAN_DATA"], name)

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(path, split_bytes=split_bytes, epochs=epochs)
        ids = docs | "bytes" >> beam.ParDo(ops.Map(byte_ids))
        seqs = ids | "pack" >> beam.ParDo(ops.Pack(seq_len=SEQ_LEN + 1))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=8))

    return zf.LoaderSpec(build, lanes=LANES, seed=11, global_batch_size=global_batch_size)


def row_digest(inputs: np.ndarray, labels: np.ndarray) -> str:
    """One row's digest: its int64 input ids and labels."""
    data = inputs.astype(np.int64).tobytes() + b"|" + labels.astype(np.int64).tobytes()
    return hashlib.sha256(data).hexdigest()


def expected_rows(steps: int | None, of: zf.LoaderSpec | None = None) -> list[list[str]]:
    """Per step (up to ``steps``, or all), the digests of the global batch's rows, from one
    ``zf.Loader`` of every lane of ``of`` (default: ``spec()``)."""
    out = []
    with zf.Loader(of or spec()) as loader:
        for step, batch in loader:
            ids, segments = batch["input_ids"].astype(np.int64), batch["segment_ids"]
            labels = ids[:, 1:].copy()
            labels[segments[:, 1:] < 0] = IGNORE_INDEX
            out.append([row_digest(i, t) for i, t in zip(ids[:, :-1], labels, strict=True)])
            if step + 1 == steps:
                break
    return out
