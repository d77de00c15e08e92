"""The demo corpus and pipeline the single-machine benchmarks share: its texts, and its zephon-flow spec.

The corpus is ``zephon_flow.demo_data``'s (prose JSONL and code Parquet, built and cached on
first use); the pipeline is the issue's demo pipeline: ``ReadJsonl`` (prose, in 64 KiB splits)
and ``ReadParquet`` (code, column ``content``), ``Mix``, ``Tokenize`` (EOS appended),
``Pack(512)``, ``Shuffle(64)``; 8 lanes, global batch 32.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

SEQ_LEN = 512
GLOBAL_BATCH = 32
LANES = 8
SHUFFLE_BUFFER = 64
JSONL_SPLIT_BYTES = 64 * 1024  # as zephon_flow.demo: the prose file is dealt in several splits


def load_texts(docs_jsonl: str, code_parquet: str) -> tuple[list[str], list[str]]:
    """Prose documents and code files, as the pipeline's sources yield them (empties dropped)."""
    import pyarrow.parquet as pq

    prose: list[str] = []
    with open(docs_jsonl, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                text = json.loads(line)["text"]
                if text:
                    prose.append(text)
    column = pq.read_table(code_parquet, columns=["content"])["content"].to_pylist()
    code = [text for text in column if text]
    return prose, code


def pipeline_spec(
    docs_jsonl: str,
    code_parquet: str,
    tokenizer_json: str,
    *,
    weights: Sequence[float],
    seed: int,
    tokenize: dict[str, Any] | None = None,
    per_element: bool = False,
) -> Any:
    """The demo pipeline over the corpus, mixed by ``weights`` (prose, code); ``tokenize`` holds
    extra ``Tokenize`` keyword arguments (an ``engine``); ``per_element`` hides ``Tokenize``'s
    batched path (``process_batch``), for a before/after comparison."""
    import apache_beam as beam

    import zephon_flow as zf
    from bench._per_element import PerElementTokenize
    from zephon_flow import operators as ops

    extra = dict(tokenize or {})
    tokenizer = PerElementTokenize if per_element else ops.Tokenize

    def text_mix(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(docs_jsonl, field="text", split_bytes=JSONL_SPLIT_BYTES)
        code = p | "code" >> ops.ReadParquet(code_parquet, column="content")
        mixed = (docs, code) | "mix" >> ops.Mix(weights=list(weights))
        toks = mixed | "tok" >> beam.ParDo(tokenizer(tokenizer_json, append_eos=True, **extra))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=SEQ_LEN))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=SHUFFLE_BUFFER))

    return zf.LoaderSpec(text_mix, lanes=LANES, seed=seed, global_batch_size=GLOBAL_BATCH)
