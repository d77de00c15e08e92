"""``materialize(steps=N)`` computes only what N global batches need: each lane stops reading once
its windows of steps ``< N`` are made, and the batches are still the ``Loader``'s, bit for bit."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.coders import VarIntCoder
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.transforms.userstate import BagStateSpec, TimeDomain, TimerSpec, on_timer
from apache_beam.utils.timestamp import MAX_TIMESTAMP
from helpers import Corpus, run_batches, tagged_texts, write_jsonl

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest
from zephon_flow.core.schedule import WindowLengths
from zephon_flow.engine.materialize import GlobalBatches, WriteSteps, materialize, read_materialized
from zephon_flow.runners.beam.bounded import outputs_before

DOCS = 3000  # one pass of the long source


class Counted(beam.DoFn):  # type: ignore[misc]
    """Passes each record on and appends one byte to ``path``: the file's size is how many
    records went through the stateless front (Beam runs it in this process)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    def process(self, text: str) -> Iterator[str]:
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)
        yield text


class Lengths(beam.DoFn):  # type: ignore[misc]
    """A user's stateful DoFn: a document's length, except every length divisible by three,
    held back until the end of the lane's input (a timer)."""

    HELD = BagStateSpec("held", VarIntCoder())
    END = TimerSpec("end", TimeDomain.WATERMARK)

    def process(
        self,
        element: tuple[int, Any],
        held: Any = beam.DoFn.StateParam(HELD),
        end: Any = beam.DoFn.TimerParam(END),
    ) -> Iterator[dict[str, Any]]:
        n = len(element[1])
        if n % 3:
            yield {"length": np.int64(n)}
        else:
            end.set(MAX_TIMESTAMP)
            held.add(n)

    @on_timer(END)
    def finish(self, held: Any = beam.DoFn.StateParam(HELD)) -> Iterator[dict[str, Any]]:
        lengths = list(held.read())
        held.clear()
        for n in lengths:
            yield {"length": np.int64(n)}


def _counted(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _spec(corpus: Corpus, docs: str, counter: Path, *, epochs: int | None) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        text = p | "docs" >> ops.ReadJsonl(docs, field="text", split_bytes=4000, epochs=epochs)
        seen = text | "count" >> beam.ParDo(Counted(str(counter)))
        toks = seen | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=5))

    return zf.LoaderSpec(build, lanes=4, seed=3, global_batch_size=8)


@pytest.fixture(scope="module")
def long_docs(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("long") / "docs.jsonl", tagged_texts("web", DOCS, seed=4))


def _digests(spec: zf.LoaderSpec, steps: int) -> list[str]:
    return [batch_digest(b) for b in run_batches(spec, steps)]


def test_two_steps_of_an_endless_source_read_a_few_chunks_not_the_pass(
    corpus: Corpus, long_docs: str, tmp_path: Path
) -> None:
    counter = tmp_path / "read"
    spec = _spec(corpus, long_docs, counter, epochs=None)
    done = materialize(spec, steps=2, out=str(tmp_path / "two"))
    read_for_two = _counted(counter)
    assert (done.steps, done.ended) == (2, False)
    assert [batch_digest(b) for _, b in read_materialized(str(tmp_path / "two"))] == _digests(spec, 2)
    # Each of the 4 lanes needs 4 sequences of 16 tokens (a few documents): it reads its first
    # chunk (64 records) and no more, where the whole pass is 3000 records.
    assert 0 < read_for_two <= 4 * 64
    counter.unlink()
    with beam.Pipeline(runner=FnApiRunner()) as p:  # every step of the pass, as before
        _ = p | GlobalBatches(spec) | beam.ParDo(WriteSteps(str(tmp_path / "all"), 2))
    assert _counted(counter) == DOCS
    assert [batch_digest(b) for _, b in read_materialized(str(tmp_path / "all"))] == _digests(spec, 2)


def test_a_finite_stream_stops_at_the_steps_or_ends_before_them(
    corpus: Corpus, long_docs: str, tmp_path: Path
) -> None:
    counter = tmp_path / "read"
    spec = _spec(corpus, long_docs, counter, epochs=1)
    done = materialize(spec, steps=5, out=str(tmp_path / "five"))
    assert (done.steps, done.ended) == (5, False) and 0 < _counted(counter) < DOCS // 4
    assert [batch_digest(b) for _, b in read_materialized(str(tmp_path / "five"))] == _digests(spec, 5)
    # A short finite stream (60 documents) ends before 10,000 steps: its end-of-input timers fire
    # (Shuffle's buffer drains, Pack's last sequence) and the last batch is padded, as before.
    short = _spec(corpus, corpus.web_jsonl, tmp_path / "short", epochs=1)
    done = materialize(short, steps=10_000, out=str(tmp_path / "short-out"))
    expected = _digests(short, 10_000)
    assert done.ended and done.steps == len(expected) < 10_000
    assert [batch_digest(b) for _, b in read_materialized(str(tmp_path / "short-out"))] == expected


def test_bounded_and_unbounded_translations_agree_at_every_cut(corpus: Corpus, tmp_path: Path) -> None:
    # A user's stateful DoFn that holds outputs back to the end of a finite input: every N cuts
    # the lanes' outputs at another point, and the steps before the cut must not move.
    def build(p: beam.Pipeline) -> beam.PCollection:
        text = p | "docs" >> ops.ReadJsonl(corpus.web_jsonl, field="text", split_bytes=700, epochs=1)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content", epochs=None)
        mixed = (text, code) | "mix" >> ops.Mix(weights=[0.6, 0.4])
        toks = mixed | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        return toks | "lengths" >> beam.ParDo(Lengths())

    spec = zf.LoaderSpec(build, lanes=2, seed=9, global_batch_size={0: 2, 3: 4})
    expected = _digests(spec, 1000)
    assert 6 < len(expected) < 1000
    with beam.Pipeline(runner=FnApiRunner()) as p:
        _ = p | GlobalBatches(spec, passes=3) | beam.ParDo(WriteSteps(str(tmp_path / "all"), 1000))
    assert [batch_digest(b) for _, b in read_materialized(str(tmp_path / "all"))] == expected
    for steps in (1, 4, len(expected), len(expected) + 1):
        done = materialize(spec, steps=steps, out=str(tmp_path / f"n{steps}"), passes=3)
        assert (done.steps, done.ended) == (min(steps, len(expected)), steps > len(expected))
        written = read_materialized(str(tmp_path / f"n{steps}"))
        assert [batch_digest(b) for _, b in written] == expected[:steps], steps


def test_a_lane_needs_the_outputs_before_its_window() -> None:
    assert outputs_before(3, 0) == 0 and outputs_before(3, 5) == 15
    lengths = zf.LoaderSpec(lambda p: p, lanes=2, global_batch_size={0: 2, 3: 4})
    by_step = WindowLengths(lengths.batch_schedule, 2)
    assert [outputs_before(by_step, s) for s in range(6)] == [0, 1, 2, 3, 5, 7]


def test_steps_must_be_positive() -> None:
    with pytest.raises(zf.SpecError, match=r"GlobalBatches: steps must be a positive integer or None, got 0"):
        GlobalBatches(zf.LoaderSpec(lambda p: p, lanes=1, global_batch_size=1), steps=0)


def test_the_bench_runs_and_its_contenders_agree(
    corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    from bench import materialize_steps as bench

    counter = str(tmp_path / "records")
    spec = bench.text_mix(
        corpus.web_jsonl, corpus.code_parquet, corpus.tokenizer_json, counter, seq_len=16, lanes=2, batch=4
    )
    reference = _digests(spec, 10_000)
    rows = bench.measure(spec, counter, steps=2, repeats=1, reference=reference)
    assert all(row["same_batches"] and row["seconds"] > 0 for row in rows.values())
    assert rows["whole pass, bounded"]["steps"] == len(reference) > 2 == rows["steps 2, bounded"]["steps"]
    # (the corpus is one chunk per lane and source: the bounded run reads all of it too)
    assert (
        0 < rows["steps 2, bounded"]["records_read"] <= rows["steps 2, whole pass (before)"]["records_read"]
    )
    assert "| steps 2, bounded | 2 |" in bench.report(rows)
