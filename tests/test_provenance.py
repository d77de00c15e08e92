"""Provenance: the runner tells stateful DoFns which source record each element came from."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
import pytest
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec
from helpers import make_corpus, run_batches

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest, concat, split_ragged, stack
from zephon_flow.core.errors import SpecError, StageError
from zephon_flow.engine.simulate import global_digests


class Trace(beam.DoFn):  # type: ignore[misc]
    """Stateful: emits each document's text (as utf-8 bytes in a fixed array) with its record id."""

    SEEN = ReadModifyWriteStateSpec("seen", PickleCoder())

    def process(
        self,
        element: tuple[int, str],
        seen: Any = beam.DoFn.StateParam(SEEN),
        doc: Any = zf.ProvenanceParam,
    ) -> Iterator[dict[str, np.ndarray]]:
        _, text = element
        seen.write((seen.read() or 0) + 1)
        raw = text.encode()[:64].ljust(64, b"\0")
        yield {"doc": np.asarray(doc, dtype=np.int64), "text": np.frombuffer(raw, dtype=np.uint8).copy()}


def traced_spec(tmp_path: Path, *, lanes: int = 4) -> zf.LoaderSpec:
    corpus = make_corpus(tmp_path / "corpus", n_web=40, n_code=30)

    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, split_bytes=300)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.5, 0.5])
        return docs | "trace" >> beam.ParDo(Trace())

    return zf.LoaderSpec(build, lanes=lanes, seed=3, global_batch_size=8)


def record_text(spec: zf.LoaderSpec, doc: np.ndarray) -> str:
    """The text of the record a provenance id names, read straight from the file."""
    source_index, split_index, offset = (int(x) for x in doc)
    source = spec.compile().sources[source_index].source
    split = source.splits(spec.lanes)[split_index]
    if isinstance(source, ops.ReadJsonl):
        with open(split.path, "rb") as f:
            f.seek(offset)
            text: str = json.loads(f.readline())["text"]
            return text
    assert split.start <= offset < split.stop  # a Parquet record's offset is its row in the file
    table = pq.read_table(split.path, columns=["content"])
    value: str = table.column(0)[offset].as_py()
    return value


def test_each_element_names_the_record_it_came_from(tmp_path: Path) -> None:
    spec = traced_spec(tmp_path)
    batches = run_batches(spec, steps=12)
    checked = set()
    for batch in batches:
        for doc, text in zip(batch["doc"], batch["text"], strict=True):
            expected = record_text(spec, doc).encode()[:64]
            assert bytes(text).rstrip(b"\0") == expected
            checked.add(int(doc[0]))
    assert checked == {0, 1}  # both sources were traced


def test_provenance_is_the_same_on_every_topology(tmp_path: Path) -> None:
    spec = traced_spec(tmp_path)
    reference = global_digests(spec, steps=8)
    assert global_digests(spec, steps=8, world_size=2, backend="threads", workers=2) == reference
    with zf.Loader(spec, world_size=1) as loader:
        for step, _ in loader:
            if step == 2:
                state = loader.state_dict()
                break
    assert global_digests(spec, steps=5, world_size=4, state=state) == reference[3:]


def test_stateless_dofns_cannot_ask_for_provenance(tmp_path: Path) -> None:
    class Stateless(beam.DoFn):  # type: ignore[misc]
        def process(self, text: str, doc: Any = zf.ProvenanceParam) -> Iterator[str]:
            yield text

    corpus = make_corpus(tmp_path / "corpus", n_web=5, n_code=5)

    def build(p: beam.Pipeline) -> beam.PCollection:
        return p | "web" >> ops.ReadJsonl(corpus.web_jsonl) | "s" >> beam.ParDo(Stateless())

    with pytest.raises(SpecError, match="stateless DoFn 's' asks for doc"):
        zf.LoaderSpec(build, lanes=1, seed=0, global_batch_size=1).compile()


# -- ragged fields in batches ----------------------------------------------------------------
def sample(n_docs: int, base: int) -> dict[str, np.ndarray]:
    docs = np.arange(base, base + 3 * n_docs, dtype=np.int64).reshape(n_docs, 3)
    return {"input_ids": np.full(4, base, dtype=np.int32), "documents": docs}


def test_stack_concatenates_documents_and_counts_them() -> None:
    samples = [sample(2, 0), sample(0, 100), sample(3, 200)]
    batch = stack(samples, where="test")
    assert sorted(batch) == ["documents", "documents_count", "input_ids"]
    assert batch["documents"].shape == (5, 3)
    assert batch["documents_count"].tolist() == [2, 0, 3]
    parts = split_ragged(batch)
    for part, s in zip(parts, samples, strict=True):
        np.testing.assert_array_equal(part, s["documents"])
    # Rank slices concatenated in rank order give the global batch.
    whole = concat([stack(samples[:1], where="a"), stack(samples[1:], where="b")])
    assert batch_digest(whole) == batch_digest(batch)


@pytest.mark.parametrize("shape", [(), (5,), (0,), (2, 3), (4, 0), (2, 3, 4)])
@pytest.mark.parametrize("order", ["C", "F"])
def test_stack_gives_numpy_stack_of_every_field(shape: tuple[int, ...], order: str) -> None:
    rng = np.random.default_rng(len(shape))
    layout: Any = order  # "C" or "F"
    values = [np.asarray(rng.integers(-9, 9, shape), dtype=np.int16, order=layout) for _ in range(7)]
    values[3] = values[3][...]  # a view among them
    got = stack([{"x": v} for v in values], where="test")["x"]
    want = np.stack(values)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert stack([[1, 2], [3, 4]], where="test")["data"].tolist() == [[1, 2], [3, 4]]  # not arrays
    with pytest.raises(StageError, match=r"test, field 'x': sample 1 is >i2\[2\], expected int16\[2\]"):
        stack([{"x": np.zeros(2, "<i2")}, {"x": np.zeros(2, ">i2")}], where="test")


def test_stack_says_what_usually_makes_samples_differ() -> None:
    ids = [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32)]
    with pytest.raises(
        StageError, match=r"sample 1 is int32\[3\], expected int32\[5\]; .* end the pipeline with Pack"
    ):
        stack(ids, where="test")
    with pytest.raises(StageError, match=r"sample 1 is <U2\[\], expected <U5\[\]; the pipeline ends in text"):
        stack(["hello", "hi"], where="test")
    with pytest.raises(
        StageError, match=r"sample 1 is int32\[2, 2\], expected int32\[4\]$"
    ):  # no plain cause
        stack([np.zeros(4, np.int32), np.zeros((2, 2), np.int32)], where="test")


def test_stack_refuses_documents_of_another_width() -> None:
    bad = sample(1, 0)
    bad["documents"] = np.zeros((1, 2), dtype=np.int64)
    with pytest.raises(
        StageError, match=r"test, field 'documents': sample 1 is int64\[1, 2\], expected int64\[n, 3\]"
    ):
        stack([sample(1, 0), bad], where="test")
