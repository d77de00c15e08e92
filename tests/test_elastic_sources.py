"""Elastic determinism with the Arrow, text-file and WebDataset sources mixed, tokenized and packed.

Every run is compared, digest by digest, with one uninterrupted single-rank inline run.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import pyarrow as pa
import pyarrow.feather as feather
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
from helpers import Corpus, tagged_texts

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.engine.simulate import global_digests

LANES, STEPS = 4, 8


class Caption(beam.DoFn):  # type: ignore[misc]
    """A WebDataset sample's caption, for the tokenizer (module level: pickled by reference)."""

    def process(self, sample: dict[str, Any]) -> Iterator[str]:
        yield sample["txt"]


@dataclass(frozen=True)
class Files:
    arrow: str
    text: str
    tar: str
    tokenizer_json: str


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, corpus: Corpus) -> Files:
    root = tmp_path_factory.mktemp("sources")
    books = tagged_texts("web", 30, seed=1)
    for i in range(2):  # Feather v2 files of 3 record batches each
        table = pa.table({"text": books[i * 15 : (i + 1) * 15]})
        feather.write_feather(table, str(root / f"books{i}.arrow"), chunksize=5, compression="uncompressed")
    (root / "notes").mkdir()
    for i, text in enumerate(tagged_texts("code", 12, seed=2)):
        data = text.encode()
        name = root / "notes" / (f"{i:02d}.txt.gz" if i % 4 == 0 else f"{i:02d}.txt")
        name.write_bytes(gzip.compress(data) if i % 4 == 0 else data)
    captions = tagged_texts("web", 24, seed=3, max_words=12)
    for shard in range(2):
        with tarfile.open(root / f"pics{shard}.tar", "w") as tar:
            for i in range(shard * 12, shard * 12 + 12):
                for ext, data in (("jpg", bytes(50 + i)), ("txt", captions[i].encode())):
                    info = tarfile.TarInfo(f"{i:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return Files(
        arrow=str(root / "*.arrow"),
        text=str(root / "notes" / "*"),
        tar=str(root / "*.tar"),
        tokenizer_json=corpus.tokenizer_json,
    )


def sources_spec(files: Files, *, seed: int = 0) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        books = p | "books" >> ops.ReadArrow(files.arrow)
        notes = p | "notes" >> ops.ReadTextFiles(files.text)
        pics = p | "pics" >> ops.ReadWebDataset(files.tar, samples_per_split=4)
        captions = pics | "caption" >> beam.ParDo(Caption())
        docs = (books, notes, captions) | "mix" >> ops.Mix(weights=[0.4, 0.3, 0.3])
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(files.tokenizer_json))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=4))

    return zf.LoaderSpec(build, lanes=LANES, seed=seed, global_batch_size=BATCH)


@pytest.fixture(scope="module")
def spec(files: Files) -> zf.LoaderSpec:
    return sources_spec(files)


reference = reference_fixture(STEPS)
test_any_topology_and_resume_points_give_the_reference_batches = any_topology_test(STEPS, examples=8)
test_world_sizes_give_the_reference_batches = world_sizes_test(
    STEPS, [w for w in WORLD_SIZES if w in (1, 3, 12)]
)
test_processes_backend_resumes_a_threads_run = resume_test(
    STEPS, 3, [Segment(4, "threads", 2, 2, 3, 2), Segment(2, "processes", 2, 2, 4, 3)], slow=True
)


def test_every_source_contributes_and_a_second_seed_differs(
    files: Files, spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    final: list[dict[str, Any]] = []
    global_digests(spec, steps=STEPS, final_state=final)
    cursors = [ls["cursor"]["sources"] for ls in final[0]["lane_states"]]
    for index, label in enumerate(["books", "notes", "pics"]):
        assert any(c[index] != [0, -1] for c in cursors), f"{label} was never read"
    other = global_digests(sources_spec(files, seed=1), steps=STEPS)
    assert all(a != b for a, b in zip(other, reference, strict=True))
