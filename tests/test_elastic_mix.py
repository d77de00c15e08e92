"""Elastic determinism with a mixture schedule and a source that runs out (renormalize).

Random world sizes, backends, worker counts and resume points must give the batches of one
uninterrupted single-rank inline run, digest by digest.
"""

from __future__ import annotations

import apache_beam as beam
import pytest
from helpers import Corpus
from hypothesis import given, settings
from hypothesis import strategies as st
from test_elastic_property import WORLD_SIZES, Segment, run_in_segments, segments

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.simulate import global_digests

LANES, BATCH, STEPS = 4, 12, 16


def mix_spec(corpus: Corpus) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text", split_bytes=500)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content", epochs=1)
        docs = (web, code) | "mix" >> ops.Mix(
            schedule=[(0, [0.1, 0.9]), (8, [0.6, 0.4]), (12, [0.5, 0.5])],
            interpolation="linear",
            exhausted="renormalize",
        )
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=4))

    return zf.LoaderSpec(build, lanes=LANES, seed=7, global_batch_size=BATCH)


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return mix_spec(corpus)


@pytest.fixture(scope="module")
def reference(spec: zf.LoaderSpec) -> list[tuple[int, str]]:
    final: list[dict[str, object]] = []
    ref = global_digests(spec, steps=STEPS, final_state=final)
    assert len(ref) == STEPS and len({d for _, d in ref}) == STEPS
    # The run covers what it is meant to: some lane dropped the code source from its mix.
    lane_states = final[0]["lane_states"]
    assert isinstance(lane_states, list)
    assert any(ls["cursor"]["exhausted"] == [1] for ls in lane_states)
    return ref


@settings(max_examples=8, deadline=None)
@given(
    cuts=st.lists(st.integers(1, STEPS - 1), max_size=3, unique=True).map(sorted),
    plan=st.lists(segments, min_size=4, max_size=4),
)
def test_a_scheduled_renormalizing_mix_is_elastic(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]], cuts: list[int], plan: list[Segment]
) -> None:
    assert run_in_segments(spec, STEPS, cuts, plan) == reference


@pytest.mark.slow
def test_processes_backend_with_a_schedule(spec: zf.LoaderSpec, reference: list[tuple[int, str]]) -> None:
    plan = [Segment(WORLD_SIZES[-1], "threads", 2, 2, 3, 2), Segment(2, "processes", 2, 2, 4, 3)]
    assert run_in_segments(spec, STEPS, [9], plan) == reference
