"""Elastic determinism: the global batches are the same under every topology and resume point.

Every run is compared, digest by digest, with one uninterrupted single-rank inline run.
"""

from __future__ import annotations

import apache_beam as beam
import pytest
from elastic import (
    BATCH,
    WORLD_SIZES,
    Segment,
    any_topology_test,
    reference_fixture,
    resume_test,
    run_in_segments,
    world_sizes_test,
)
from helpers import Corpus, example_spec

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.demo_data import DemoData
from zephon_flow.engine.simulate import global_digests

LANES, STEPS = 4, 10


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=LANES, global_batch_size=BATCH, seq_len=16, buffer=4)


reference = reference_fixture(STEPS)
test_any_topology_and_resume_points_give_the_reference_batches = any_topology_test(STEPS, examples=12)
test_every_world_size_gives_the_reference_batches = world_sizes_test(STEPS, WORLD_SIZES)


test_processes_backend_resumes_a_threads_run_from_more_ranks = resume_test(
    STEPS, 3, [Segment(6, "threads", 2, 2, 3, 2), Segment(1, "processes", 2, 2, 4, 3)]
)
test_processes_backend_on_two_ranks_then_back_to_inline = resume_test(
    STEPS, 6, [Segment(2, "processes", 2, 2, 16, 4), Segment(12, "inline", 1, 1, 1, 1)]
)


def test_loader_options_do_not_change_the_batches(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    for options in (
        {"prefetch": 1, "chunk_records": 1, "prefetch_chunks": 1},
        {"prefetch": 5, "chunk_records": 64, "prefetch_chunks": 8},
        {"prefetch": 2, "chunk_records": 7, "prefetch_chunks": 2, "backend": "threads", "workers": 3},
    ):
        assert global_digests(spec, steps=STEPS, **options) == reference, options


def test_the_same_seed_twice_gives_the_same_batches(corpus: Corpus, reference: list[tuple[int, str]]) -> None:
    fresh = example_spec(corpus, lanes=LANES, global_batch_size=BATCH, seq_len=16, buffer=4)
    assert global_digests(fresh, steps=STEPS) == reference


def test_two_seeds_give_different_batches(corpus: Corpus, reference: list[tuple[int, str]]) -> None:
    other = example_spec(corpus, lanes=LANES, global_batch_size=BATCH, seq_len=16, buffer=4, seed=1)
    digests = global_digests(other, steps=STEPS)
    assert len(digests) == STEPS
    assert all(a != b for a, b in zip(digests, reference, strict=True))


def test_real_data_is_elastic(demo: DemoData) -> None:
    def build(p: beam.Pipeline) -> beam.PCollection:
        prose = p | "prose" >> ops.ReadJsonl(demo.docs_jsonl, split_bytes=64_000)
        code = p | "code" >> ops.ReadParquet(demo.code_parquet, column="content")
        docs = (prose, code) | "mix" >> ops.Mix(weights=[0.6, 0.4])
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(demo.tokenizer_json))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=128))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=16))

    real = zf.LoaderSpec(build, lanes=4, seed=3, global_batch_size=8)
    ref = global_digests(real, steps=8)
    plan = [
        Segment(4, "threads", 2, 2, 4, 2),
        Segment(1, "inline", 1, 2, 16, 4),
        Segment(8, "threads", 2, 1, 2, 3),
    ]
    assert run_in_segments(real, 8, [3, 5], plan) == ref
