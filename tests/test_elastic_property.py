"""Elastic determinism: the global batches are the same under every topology and resume point.

Every run is compared, digest by digest, with one uninterrupted single-rank inline run.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import pytest
from helpers import Corpus, example_spec
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.demo_data import DemoData
from zephon_flow.simulate import global_digests

LANES, BATCH, STEPS = 4, 12, 10
WORLD_SIZES = [w for w in range(1, BATCH + 1) if BATCH % w == 0]  # 1, 2, 3, 4, 6, 12 (> LANES)


@dataclass(frozen=True)
class Segment:
    """One stretch of a run on one topology."""

    world_size: int
    backend: str
    workers: int
    prefetch: int
    chunk_records: int
    prefetch_chunks: int

    def options(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "backend": self.backend,
            "workers": self.workers,
            "prefetch": self.prefetch,
            "chunk_records": self.chunk_records,
            "prefetch_chunks": self.prefetch_chunks,
        }


segments = st.builds(
    Segment,
    world_size=st.sampled_from(WORLD_SIZES),
    backend=st.sampled_from(["inline", "threads"]),
    workers=st.integers(1, 3),
    prefetch=st.integers(1, 3),
    chunk_records=st.integers(1, 20),
    prefetch_chunks=st.integers(1, 4),
)


def run_in_segments(
    spec: zf.LoaderSpec, steps: int, cuts: list[int], plan: list[Segment]
) -> list[tuple[int, str]]:
    """Runs ``steps`` batches, stopping after each of ``cuts`` batches and resuming on the next
    segment's topology from the merged state, carried as checkpoint bytes."""
    bounds = [0, *cuts, steps]
    digests: list[tuple[int, str]] = []
    state: bytes | None = None
    for (start, stop), seg in zip(itertools.pairwise(bounds), plan, strict=False):
        final: list[dict[str, Any]] = []
        got = global_digests(spec, steps=stop - start, state=state, final_state=final, **seg.options())
        assert [s for s, _ in got] == list(range(start, stop))
        digests += got
        state = zf.encode_state(final[0])
    return digests


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=LANES, global_batch_size=BATCH, seq_len=16, buffer=4)


@pytest.fixture(scope="module")
def reference(spec: zf.LoaderSpec) -> list[tuple[int, str]]:
    ref = global_digests(spec, steps=STEPS)
    assert len(ref) == STEPS and len({d for _, d in ref}) == STEPS
    return ref


@settings(max_examples=12, deadline=None)
@given(
    cuts=st.lists(st.integers(1, STEPS - 1), max_size=3, unique=True).map(sorted),
    plan=st.lists(segments, min_size=4, max_size=4),
)
def test_any_topology_and_resume_points_give_the_reference_batches(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]], cuts: list[int], plan: list[Segment]
) -> None:
    assert run_in_segments(spec, STEPS, cuts, plan) == reference


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_world_size_gives_the_reference_batches(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]], world_size: int
) -> None:
    assert global_digests(spec, steps=STEPS, world_size=world_size, backend="threads", workers=2) == reference


def test_processes_backend_resumes_a_threads_run_from_more_ranks(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    plan = [Segment(6, "threads", 2, 2, 3, 2), Segment(1, "processes", 2, 2, 4, 3)]
    assert run_in_segments(spec, STEPS, [3], plan) == reference


def test_processes_backend_on_two_ranks_then_back_to_inline(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    plan = [Segment(2, "processes", 2, 2, 16, 4), Segment(12, "inline", 1, 1, 1, 1)]
    assert run_in_segments(spec, STEPS, [6], plan) == reference


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
