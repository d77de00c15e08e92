"""Beam's bundle lifecycle, deterministically: a bundle is one element at its stage.

``start_bundle``, ``process`` and ``finish_bundle`` run around every element, on every backend
and in the lanes' back alike, so what ``finish_bundle`` emits has a place in the lane's order
and the batches do not depend on chunks, workers or resume points; ``setup`` runs once per
instance before its first element and ``teardown`` when the loader (or the worker) ends.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to
from bundle_dofns import (
    BufferedLengths,
    Doubled,
    EmitsFromStart,
    PlainFinish,
    RunningTotal,
    Traced,
    TracedTotal,
    traces,
)
from checkpointing import assert_equal_output_after_checkpoint
from helpers import DocKey, run_batches, tagged_texts, write_jsonl

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest
from zephon_flow.errors import StageError

BACKENDS = [("inline", 1), ("threads", 2), ("processes", 2)]


def _texts(n: int) -> list[str]:
    return tagged_texts("web", n, seed=1)


def _lengths_spec(jsonl: str, *back: tuple[str, beam.DoFn], lanes: int = 4, batch: int = 8) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(jsonl, field="text", split_bytes=400, epochs=1)
        out = docs | "lengths" >> beam.ParDo(BufferedLengths())
        for label, dofn in back:
            out = out | label >> beam.ParDo(dofn)
        return out

    return zf.LoaderSpec(build, lanes=lanes, seed=1, global_batch_size=batch)


def _rows(batches: list[dict[str, Any]], field: str) -> list[int]:
    return [int(v) for b in batches for v, ok in zip(b[field], b["valid"], strict=True) if ok]


def test_the_issue_example_gives_every_row_on_every_backend_as_beam_does(tmp_path: Path) -> None:
    # 200 documents, epochs=1; the DoFn buffers lengths in process, flushes in finish_bundle.
    texts = _texts(200)
    spec = _lengths_spec(write_jsonl(tmp_path / "docs.jsonl", texts))
    runs = {b: run_batches(spec, backend=b, workers=w) for b, w in BACKENDS}
    digests = {b: [batch_digest(x) for x in runs[b]] for b in runs}
    assert digests["threads"] == digests["inline"]
    assert digests["processes"] == digests["inline"]
    lengths = _rows(runs["inline"], "length")
    assert len(lengths) == 200  # none dropped (198 when finish_bundle's outputs were lost)
    assert sorted(lengths) == sorted(len(t) for t in texts)
    # Beam's DirectRunner gives the same rows (its bundles are its own; the rows are not).
    with beam.Pipeline(runner="DirectRunner", options=PipelineOptions([])) as p:
        out = p | beam.Create(texts) | beam.ParDo(BufferedLengths()) | beam.Map(lambda s: int(s["length"]))
        assert_that(out, equal_to(lengths))


def test_finish_bundle_outputs_follow_their_element_in_the_back_and_resume_exactly(tmp_path: Path) -> None:
    # A stateful DoFn with bundle methods, then a stateless one that emits only from finish_bundle.
    spec = _lengths_spec(
        write_jsonl(tmp_path / "docs.jsonl", _texts(24)),
        ("total", RunningTotal()),
        ("doubled", Doubled()),
        lanes=2,
        batch=4,
    )
    runs = {b: [batch_digest(x) for x in run_batches(spec, backend=b, workers=w)] for b, w in BACKENDS}
    assert runs["threads"] == runs["inline"] and runs["processes"] == runs["inline"]
    batches = run_batches(spec)
    lengths, totals = _rows(batches, "length"), _rows(batches, "total")
    # Each element's bundle: its sample, then finish_bundle's marker (length -1, one element made).
    assert lengths[1::2] == [-1] * 24 and totals[1::2] == [2] * 24
    assert sorted(lengths[0::2]) == sorted(len(t) for t in _texts(24))
    assert len(runs["inline"]) == 12
    ref = assert_equal_output_after_checkpoint(spec, 11)
    assert [d for _, d in ref.digests] == runs["inline"][:11]


@pytest.mark.parametrize(("backend", "workers"), BACKENDS)
def test_setup_once_per_instance_a_bundle_per_element_teardown_at_close(
    backend: str, workers: int, tmp_path: Path
) -> None:
    folders = {name: tmp_path / name for name in ("front", "stateful", "back")}
    for folder in folders.values():
        folder.mkdir()
    jsonl = write_jsonl(tmp_path / "docs.jsonl", _texts(30))

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(jsonl, split_bytes=300, epochs=1)
        traced = docs | "front" >> beam.ParDo(Traced(str(folders["front"])))
        keys = traced | "key" >> beam.ParDo(DocKey())
        counted = keys | "stateful" >> beam.ParDo(TracedTotal(str(folders["stateful"])))
        return counted | "back" >> beam.ParDo(Traced(str(folders["back"])))

    spec = zf.LoaderSpec(build, lanes=3, seed=2, global_batch_size=6)
    spec.compile()
    assert all(traces(f) == [] for f in folders.values())  # nothing runs at spec build
    loader = zf.Loader(spec, backend=backend, workers=workers)
    steps = sum(1 for _ in loader)
    assert steps == 7
    loader.close()
    lanes = 3  # the end of each lane's input is one more (empty) bundle of the stateful DoFn
    for name, folder in folders.items():
        instances = traces(folder)
        assert instances, name
        processed = 0
        for calls in instances:
            assert calls[0] == "setup" and calls[-1] == "teardown", (name, calls)
            bundles = " ".join(calls[1:-1]).replace("finish", "finish|").split("|")
            assert bundles[-1] == "", (name, calls)
            counts = collections.Counter(b.strip() for b in bundles[:-1])
            # Only the stateful DoFn has empty bundles: the timers at the end of each lane's input.
            assert counts.keys() <= {"start process finish", "start finish"}, (name, calls)
            assert counts["start finish"] == (lanes if name == "stateful" else 0), (name, calls)
            processed += counts["start process finish"]
        assert processed == 30, name
    # One instance per loader in this process, one per worker process that ran chunks.
    assert len(traces(folders["stateful"])) == 1 and len(traces(folders["back"])) == 1
    assert len(traces(folders["front"])) == (1 if backend != "processes" else len(traces(folders["front"])))
    assert 1 <= len(traces(folders["front"])) <= workers


def test_start_bundle_that_emits_is_refused_by_name(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", _texts(4))

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(str(tmp_path / "d.jsonl"), field="text", epochs=1)
        return docs | "early" >> beam.ParDo(EmitsFromStart())

    spec = zf.LoaderSpec(build, lanes=1, seed=0, global_batch_size=1)
    with pytest.raises(StageError) as info:
        run_batches(spec, 1)
    assert str(info.value).splitlines()[0] == (
        "DoFn 'early': start_bundle() returned generator; it may only prepare the bundle (Beam "
        "refuses output from it too): emit from process() or finish_bundle()"
    )


def test_finish_bundle_that_yields_plain_values_is_refused_by_name(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "d.jsonl", _texts(4))

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(jsonl, field="text", epochs=1)
        return docs | "plain" >> beam.ParDo(PlainFinish())

    spec = zf.LoaderSpec(build, lanes=1, seed=0, global_batch_size=1)
    with pytest.raises(StageError) as info:
        run_batches(spec, 1)
    assert str(info.value).splitlines()[0] == (
        "DoFn 'plain': finish_bundle() yielded a dict; as on Beam, it must yield WindowedValue "
        "objects, e.g. GlobalWindows.windowed_value(value) (from apache_beam.transforms.window)"
    )


def test_loaders_of_one_spec_run_their_own_copies(tmp_path: Path) -> None:
    # Two loaders of one spec at once (ranks in one process): each sets up and tears down its own.
    folder = tmp_path / "trace"
    folder.mkdir()
    jsonl = write_jsonl(tmp_path / "docs.jsonl", _texts(12))

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(jsonl, split_bytes=300, epochs=1)
        return docs | "front" >> beam.ParDo(Traced(str(folder))) | "key" >> beam.ParDo(DocKey())

    spec = zf.LoaderSpec(build, lanes=2, seed=2, global_batch_size=2)
    sync = zf.ThreadEndSync(2)
    first, second = (zf.Loader(spec, rank=r, world_size=2, end_sync=sync) for r in range(2))
    for a, b in zip(first, second, strict=True):
        assert a[0] == b[0]
    first.close()
    calls = traces(folder)
    assert len(calls) == 2
    assert collections.Counter(c[-1] for c in calls) == {"teardown": 1, "finish": 1}
    second.close()
    assert [c[-1] for c in traces(folder)] == ["teardown", "teardown"]
