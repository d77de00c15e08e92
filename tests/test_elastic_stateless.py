"""Elastic determinism with ops.Map, ops.Filter and ops.FlatMap, batched and not, at every place in a lane.

The pipeline has the helpers in a source's own chain (before the mix), in the common front
(after it, around Tokenize) and in the ordered back (between Pack and Shuffle, run inline on
the lane's thread). Every run is compared, digest by digest, with one uninterrupted
single-rank inline run.
"""

from __future__ import annotations

from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from elastic import (
    BATCH,
    WORLD_SIZES,
    Segment,
    any_topology_test,
    reference_fixture,
    resume_test,
    world_sizes_test,
)
from helpers import Corpus

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.engine.simulate import global_digests

LANES, STEPS = 4, 10


def halves(text: str) -> list[str]:
    """A document becomes its two halves (by words): several outputs per record."""
    words = text.split()
    mid = len(words) // 2
    return [" ".join(part) for part in (words[:mid], words[mid:]) if part]


def not_a_multiple_of_three(text: str) -> bool:
    """Drops about a third of the documents (a record with no output)."""
    return len(text.split()) % 3 != 0


def swap_words_batch(texts: list[str]) -> list[str]:
    return [t.replace("alpha", "omega").replace("lazy", "quick") for t in texts]


def long_enough_batch(docs: list[np.ndarray]) -> list[bool]:
    return [len(d) >= 4 for d in docs]


def with_total(sample: dict[str, np.ndarray]) -> dict[str, Any]:
    return {**sample, "total": np.int64(sample["input_ids"].sum())}


def stateless_spec(corpus: Corpus, *, seed: int = 0) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text", split_bytes=500)
        web = web | "halves" >> beam.ParDo(ops.FlatMap(halves))
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
        code = code | "thin" >> beam.ParDo(ops.Filter(not_a_multiple_of_three))
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.6, 0.4])
        docs = docs | "swap" >> beam.ParDo(ops.Map(swap_words_batch, batched=True))
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        toks = toks | "long" >> beam.ParDo(ops.Filter(long_enough_batch, batched=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))
        seqs = seqs | "total" >> beam.ParDo(ops.Map(with_total))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=4))

    return zf.LoaderSpec(build, lanes=LANES, seed=seed, global_batch_size=BATCH)


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return stateless_spec(corpus)


reference = reference_fixture(STEPS)
test_any_topology_and_resume_points_give_the_reference_batches = any_topology_test(STEPS, examples=6)
test_other_world_sizes_give_the_reference_batches = world_sizes_test(
    STEPS, [w for w in WORLD_SIZES if w in (2, 3, 12)]
)
test_processes_backend_resumes_a_threads_run = resume_test(
    STEPS, 4, [Segment(6, "threads", 2, 2, 3, 2), Segment(2, "processes", 2, 2, 5, 3)], slow=True
)


def test_the_helpers_are_where_the_test_says(spec: zf.LoaderSpec) -> None:
    plan = spec.compile()
    assert [[s.label for s in sp.chain] for sp in plan.sources] == [["halves"], ["thin"]]
    assert [s.label for s in plan.common] == ["swap", "tok", "long"]
    assert [s.label for s in plan.back] == ["pack", "total", "shuffle"]
    with zf.Loader(spec) as loader:
        batch = next(iter(loader))[1]
    assert batch["total"].tolist() == batch["input_ids"].sum(axis=1).tolist()


def test_two_seeds_give_different_batches(corpus: Corpus, reference: list[tuple[int, str]]) -> None:
    other = global_digests(stateless_spec(corpus, seed=1), steps=STEPS)
    assert all(a != b for a, b in zip(other, reference, strict=True))
