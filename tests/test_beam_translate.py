"""The Beam translation: lane order restored from any arrival order, refusals named, the bounded
read of endless sources, and Beam's multi-process mode (batches equal to the Loader's)."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from helpers import Corpus, example_spec, run_batches

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest
from zephon_flow.core.errors import DataError, StageError, UnsupportedTransformError
from zephon_flow.engine.materialize import WriteSteps, materialize, read_materialized
from zephon_flow.runners.beam import Translation, draws_at_step, order_lanes
from zephon_flow.runners.beam.order import OrderedStage, Resequencer
from zephon_flow.runners.beam.pieces import END, Piece
from zephon_flow.runners.beam.read import DecodeChunk, ReadLane
from zephon_flow.runners.dofns import DoFnLaneState, StatefulInvoker


def _digests(spec: zf.LoaderSpec, steps: int) -> list[str]:
    return [batch_digest(b) for b in run_batches(spec, steps)]


def _how(spec: zf.LoaderSpec, passes: int = 4) -> Translation:
    return Translation(
        lanes=spec.lanes, seed=spec.seed, per_lane=spec.per_lane, passes=passes, chunk_records=3
    )


def test_resequencer_releases_runs_in_order_and_refuses_duplicates() -> None:
    order: Resequencer[str] = Resequencer()
    assert list(order.put(2, "c", where="w")) == []
    assert list(order.put(1, "b", where="w")) == []
    assert list(order.put(0, "a", where="w")) == ["a", "b", "c"]
    assert list(order.put(3, "d", where="w")) == ["d"]
    with pytest.raises(StageError, match=r"lane 5: element 1 arrived twice \(the next expected is 4\)"):
        list(order.put(1, "again", where="lane 5"))


def _scheduled(corpus: Corpus) -> zf.LoaderSpec:
    """The example pipeline with a mix whose weights move over steps (one LaneStage per lane)."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text", split_bytes=500)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
        docs = (web, code) | "mix" >> ops.Mix(schedule=[(0, [0.9, 0.1]), (4, [0.1, 0.9])])
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=4))

    return zf.LoaderSpec(build, lanes=4, global_batch_size=12)


@pytest.mark.parametrize("mix", ["constant weights", "a schedule"])
def test_chunks_arriving_in_any_order_give_the_loaders_batches(
    mix: str, corpus: Corpus, tmp_path: Path
) -> None:
    # Read and decode every lane's chunks here, then hand them to Beam shuffled: the mix (its
    # own stage, or one LaneStage with the back) must restore each source's order per lane.
    spec = example_spec(corpus) if mix == "constant weights" else _scheduled(corpus)
    plan, how = spec.compile(), _how(spec)
    assert draws_at_step(plan) == (mix == "a schedule")
    decode = DecodeChunk(plan.front_segment())
    chunks = [
        decoded
        for i, sp in enumerate(plan.sources)
        for lane in range(spec.lanes)
        for raw in ReadLane(
            sp.source, sp.label, i, lanes=spec.lanes, seed=spec.seed, passes=4, chunk_records=3
        ).process(lane)
        for decoded in decode.process(raw)
    ]
    assert len(chunks) > 8 * spec.lanes  # several chunks per lane and source: order matters
    random.Random(0).shuffle(chunks)
    with beam.Pipeline(runner=FnApiRunner()) as p:
        shuffled = p | beam.Create(chunks, reshuffle=False).with_output_types(tuple[int, Any])
        _ = order_lanes(plan, shuffled, how) | beam.ParDo(WriteSteps(str(tmp_path), 10))
    assert [batch_digest(b) for _, b in read_materialized(str(tmp_path))] == _digests(spec, 10)


class _Cell:
    """Stands in for a Beam ``ReadModifyWriteState`` when a DoFn is called directly."""

    def __init__(self) -> None:
        self.value: Any = None

    def read(self) -> Any:
        return self.value

    def write(self, value: Any) -> None:
        self.value = value


def test_a_stateful_stage_sees_its_lane_in_order_whatever_the_arrival() -> None:
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 50, size=int(n), dtype=np.int32) for n in rng.integers(1, 20, size=24)]
    pieces = [Piece(i, [(d, (0, 0, i))], END if i == len(docs) - 1 else None) for i, d in enumerate(docs)]
    stage = OrderedStage("pack", ops.Pack(seq_len=8), seed=1)
    stage.setup()
    cell = _Cell()
    out = [o for piece in reversed(pieces) for o in stage.process((2, piece), state=cell)]
    assert [p.seq for _, p in out] == list(range(len(docs)))  # all released once piece 0 came
    invoker, st = StatefulInvoker("pack", ops.Pack(seq_len=8), seed=1), DoFnLaneState()
    expected = [o for i, d in enumerate(docs) for o in invoker.process(2, d, st, (0, 0, i))]
    expected += invoker.fire_timers(2, st, None)
    got = [value for _, p in out for value, _ in p.items]
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected, strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in b)
    with pytest.raises(StageError, match=r"DoFn 'pack': lane 2: element 3 arrived twice"):
        list(stage.process((2, pieces[3]), state=cell))


def test_what_cannot_be_ordered_is_refused_by_name_before_beam_runs(corpus: Corpus, tmp_path: Path) -> None:
    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text")
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
        return (web, code) | "union" >> beam.Flatten()

    spec = zf.LoaderSpec(build, lanes=2, global_batch_size=2)
    with pytest.raises(
        UnsupportedTransformError,
        match=r"transform 'union' \(Flatten\): Flatten gives no order; combine sources with ops.Mix",
    ):
        materialize(spec, steps=2, out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_only_a_mix_whose_draw_follows_the_step_runs_mix_and_back_as_one_stage(corpus: Corpus) -> None:
    def spec_with(mix: ops.Mix) -> zf.LoaderSpec:
        def build(p: beam.Pipeline) -> beam.PCollection:
            web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text")
            code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
            return (web, code) | "mix" >> mix

        return zf.LoaderSpec(build, lanes=2, global_batch_size=2)

    assert not draws_at_step(spec_with(ops.Mix(weights=[1, 1])).compile())
    assert draws_at_step(spec_with(ops.Mix(schedule=[(0, [1, 0]), (5, [0, 1])])).compile())


def test_endless_sources_read_too_few_passes_name_the_option(corpus: Corpus, tmp_path: Path) -> None:
    spec = example_spec(corpus)
    with pytest.raises(
        DataError,
        match=r"1 pass\(es\) of the endless sources fill only \d+ of the 200 steps asked for; read more \(--passes \d+\)",
    ):
        materialize(spec, steps=200, out=str(tmp_path / "few"), passes=1)
    # The steps that were filled are the Loader's first ones.
    written = read_materialized(str(tmp_path / "few"))
    assert 0 < len(written) < 200
    assert [batch_digest(b) for _, b in written] == _digests(spec, len(written))


def test_a_finite_mix_that_outruns_the_passes_of_an_endless_source_says_so(
    corpus: Corpus, tmp_path: Path
) -> None:
    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text", epochs=3)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
        return (web, code) | "mix" >> ops.Mix(weights=[0.2, 0.8])

    spec = zf.LoaderSpec(build, lanes=2, global_batch_size=2)
    with pytest.raises(
        DataError,
        match=r"mix: lane \d drew past the 1 pass\(es\) read of the endless source 'code' before its finite input ended; read more passes \(zephon materialize --passes\)",
    ):
        materialize(spec, steps=10_000, out=str(tmp_path / "out"), passes=1)


def test_materialize_refuses_a_folder_with_step_files(corpus: Corpus, tmp_path: Path) -> None:
    (tmp_path / "step-00000000.parquet").write_bytes(b"old")
    with pytest.raises(
        zf.SpecError,
        match=r"already holds step files \(step-00000000.parquet, ...\); give an empty --out folder",
    ):
        materialize(example_spec(corpus), steps=2, out=str(tmp_path))


def test_beam_multi_process_mode_gives_the_loaders_batches(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Beam's worker processes unpickle the test's helpers by module name.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    )
    spec = example_spec(corpus)
    options = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]
    done = materialize(spec, steps=8, out=str(tmp_path), runner="FnApiRunner", beam_args=options, passes=3)
    assert (done.steps, done.ended) == (8, False)
    assert [batch_digest(b) for _, b in read_materialized(str(tmp_path))] == _digests(spec, 8)


def test_bad_input_on_beam_names_the_file_the_offset_and_the_operator(corpus: Corpus, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine words"}\n{not json\n')

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(str(bad), field="text", epochs=1)
        return docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))

    spec = zf.LoaderSpec(build, lanes=1, global_batch_size=1)
    with pytest.raises(DataError) as raised:
        run_batches(spec)
    expected = str(raised.value).split("\n")[0]
    assert str(bad) in expected and "byte 23" in expected and "ReadJsonl('docs')" in expected
    with pytest.raises(DataError, match=re.escape(expected)):
        materialize(spec, steps=5, out=str(tmp_path / "out"))
