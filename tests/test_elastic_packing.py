"""Elastic determinism with best-fit packing and labels: every topology and resume point agree.

The pipeline is the DESIGN.md example with ``Pack(strategy="best_fit", labels=True)``, whose
pending documents and open bins are lane state; every run is compared, digest by digest, with
one uninterrupted single-rank inline run.
"""

from __future__ import annotations

import apache_beam as beam
import pytest
from elastic import BATCH, WORLD_SIZES, Segment, any_topology_test, reference_fixture, resume_test
from helpers import Corpus, run_batches

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.engine.simulate import global_digests

LANES, STEPS = 4, 8


def best_fit_spec(corpus: Corpus, *, seed: int = 0) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text", split_bytes=500)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.7, 0.3])
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        pack = ops.Pack(seq_len=24, strategy="best_fit", buffer=6, open_bins=3, labels=True)
        seqs = toks | "pack" >> beam.ParDo(pack)
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=4))

    return zf.LoaderSpec(build, lanes=LANES, seed=seed, global_batch_size=BATCH)


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return best_fit_spec(corpus)


reference = reference_fixture(STEPS)


def test_best_fit_pads_and_labels(spec: zf.LoaderSpec) -> None:
    batches = run_batches(spec, STEPS)
    assert sorted(batches[0]) == [
        "documents",
        "documents_count",
        "input_ids",
        "labels",
        "position_ids",
        "segment_ids",
    ]
    pads = sum(int((b["segment_ids"] == -1).sum()) for b in batches)
    assert pads > 0, "best_fit pads the sequences it cannot fill"


test_any_topology_and_resume_points_give_the_reference_batches = any_topology_test(
    STEPS, examples=6, resumes=2
)
test_processes_backend_resumes_a_threads_run_from_more_ranks = resume_test(
    STEPS, 4, [Segment(max(WORLD_SIZES), "threads", 2, 2, 3, 2), Segment(1, "processes", 2, 2, 4, 3)]
)


def test_another_seed_gives_other_batches(corpus: Corpus, reference: list[tuple[int, str]]) -> None:
    digests = global_digests(best_fit_spec(corpus, seed=1), steps=STEPS)
    assert all(a != b for a, b in zip(digests, reference, strict=True))
