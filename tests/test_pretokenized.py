"""Pre-tokenized data: integer-list columns of Parquet and Arrow, and Hugging Face save_to_disk
folders, packed without Tokenize; their column types checked when the files are listed; the
elastic contract (world sizes, backends, resumes) on them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from elastic import WORLD_SIZES, Segment, any_topology_test, reference_fixture, resume_test, world_sizes_test

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.engine.materialize import materialize, read_materialized
from zephon_flow.engine.simulate import global_digests

LANES, STEPS = 4, 6
ACCEPTED = (
    "a column must hold text (string or large_string) or token ids (list, large_list or "
    "fixed_size_list of int8..int64 or uint8..uint64)"
)


def documents(n: int, *, seed: int = 0) -> list[list[int]]:
    """``n`` documents of 1..40 token ids below 50,000 (seeded)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, int(rng.integers(1, 41))).tolist() for _ in range(n)]


def save_to_disk(folder: Path, docs: list[list[int]], *, shards: int = 2, column: str = "input_ids") -> str:
    """The layout ``datasets.Dataset.save_to_disk`` writes: ``dataset_info.json``, ``state.json``
    listing the data files, and the data as Arrow IPC stream files (written with pyarrow)."""
    folder.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    per = -(-len(docs) // shards)
    for i, name in enumerate(names):
        table = pa.table({column: pa.array(docs[i * per : (i + 1) * per], type=pa.list_(pa.int32()))})
        with pa.OSFile(str(folder / name), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=7):
                writer.write_batch(batch)
    (folder / "dataset_info.json").write_text(json.dumps({"features": {column: {"_type": "Sequence"}}}))
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    return str(folder)


def packed(source: beam.PTransform, *, lanes: int = 1, batch: int = 2, seq_len: int = 16) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        tokens = p | "src" >> source
        return tokens | "pack" >> beam.ParDo(ops.Pack(seq_len=seq_len))

    return zf.LoaderSpec(build, lanes=lanes, seed=3, global_batch_size=batch)


@pytest.mark.parametrize(
    "list_type",
    [pa.list_(pa.int64()), pa.large_list(pa.uint16()), pa.list_(pa.int8()), pa.large_list(pa.int32())],
    ids=str,
)
def test_an_integer_list_parquet_column_is_packed_without_tokenize(
    tmp_path: Path, list_type: pa.DataType
) -> None:
    docs = [[i % 100 + 1] * (1 + i % 5) for i in range(40)]  # every id fits int8 and uint16
    pq.write_table(
        pa.table({"ids": pa.array(docs, type=list_type)}), tmp_path / "a.parquet", row_group_size=8
    )
    source = ops.ReadParquet(str(tmp_path / "a.parquet"), column="ids", epochs=1)
    records = [r for s in source.splits() for _, r in source.read_split(s, -1)]
    decoded = [d for r in records for d in source.decode(r, "op")]
    assert all(d.dtype == np.int32 for d in decoded)
    assert [d.tolist() for d in decoded] == docs
    # Packed to the end of the pass: every token once, the rest padding (segment -1).
    spec = packed(ops.ReadParquet(str(tmp_path / "a.parquet"), column="ids", epochs=1))
    with zf.Loader(spec) as loader:
        batches = [b for _, b in loader]
    ids = np.concatenate([b["input_ids"] for b in batches])
    seg = np.concatenate([b["segment_ids"] for b in batches])
    assert ids.shape == (8, 16) and ids.dtype == np.int32
    assert sorted(ids[seg >= 0].tolist()) == sorted(t for d in docs for t in d)


def test_fixed_size_lists_and_nulls(tmp_path: Path) -> None:
    column = pa.array([[1, 2, 3], None, [7, 8, 9]], type=pa.list_(pa.int64(), 3))
    path = tmp_path / "a.arrow"
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, pa.schema([("ids", column.type)])) as w:
        w.write_batch(pa.record_batch([column], names=["ids"]))
    source = ops.ReadArrow(str(path), column="ids")
    records = [r for s in source.splits() for _, r in source.read_split(s, -1)]
    assert [None if r.payload is None else r.payload.tolist() for r in records] == [
        [1, 2, 3],
        None,
        [7, 8, 9],
    ]
    assert [d.tolist() for r in records for d in source.decode(r, "op")] == [[1, 2, 3], [7, 8, 9]]


def test_a_token_id_outside_int32_is_refused_by_its_row(tmp_path: Path) -> None:
    docs = [[1, 2], [3], [4, 2**31], [5]]
    pq.write_table(
        pa.table({"ids": pa.array(docs, type=pa.list_(pa.int64()))}), tmp_path / "a.parquet", row_group_size=2
    )
    source = ops.ReadParquet(str(tmp_path / "a.parquet"), column="ids", label="toks")
    message = (
        f"ReadParquet('toks'): the column 'ids' in {tmp_path / 'a.parquet'} at row group 1 row 0 "
        "holds the token id 2147483648, outside int32 (-2**31..2**31-1)"
    )
    with pytest.raises(DataError, match=re.escape(message)):
        [r for s in source.splits() for _, r in source.read_split(s, -1)]


def test_column_types_are_checked_when_the_files_are_listed(tmp_path: Path) -> None:
    pq.write_table(pa.table({"ids": pa.array([[1.5]])}), tmp_path / "floats.parquet")
    source = ops.ReadParquet(str(tmp_path / "floats.parquet"), column="ids", label="toks")
    message = (
        f"ReadParquet('toks'): the column 'ids' in {tmp_path / 'floats.parquet'} has type "
        f"list<element: double>; {ACCEPTED} (token ids must be integers)"
    )
    with pytest.raises(DataError, match=re.escape(message) + "$"):
        source.splits()
    pq.write_table(pa.table({"ids": ["text"]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"ids": [[1, 2]]}), tmp_path / "c.parquet")
    mixed = ops.ReadParquet(str(tmp_path / "[bc].parquet"), column="ids", label="toks")
    with pytest.raises(DataError) as err:
        mixed.splits()
    assert str(err.value) == (
        f"ReadParquet('toks'): the column 'ids' holds text in {tmp_path / 'b.parquet'} but token ids "
        f"in {tmp_path / 'c.parquet'}; a source reads one kind: give the text files and the "
        "tokenized ones sources of their own"
    )


def test_a_save_to_disk_folder_is_read_by_its_listed_files(tmp_path: Path) -> None:
    docs = documents(30)
    folder = save_to_disk(tmp_path / "hf", docs)
    by_folder = ops.ReadArrow(folder, column="input_ids")
    assert by_folder.paths() == [f"{folder}/data-00000-of-00002.arrow", f"{folder}/data-00001-of-00002.arrow"]
    assert ops.ReadArrow(f"{folder}/*", column="input_ids").paths() == by_folder.paths()
    records = [r for s in by_folder.splits() for _, r in by_folder.read_split(s, -1)]
    assert sorted(r.payload.tolist() for r in records) == sorted(docs)
    first = global_digests(packed(ops.ReadArrow(folder, column="input_ids"), lanes=2, batch=4), steps=4)
    second = global_digests(
        packed(ops.ReadArrow(f"{folder}/*", column="input_ids"), lanes=2, batch=4), steps=4
    )
    assert first == second


def test_a_folder_that_is_not_save_to_disk_output_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(SpecError) as err:
        ops.ReadArrow(str(tmp_path / "plain"), label="toks").paths()
    assert str(err.value) == (
        f"ReadArrow('toks'): '{tmp_path / 'plain'}' is a folder without state.json (not a Hugging "
        f"Face save_to_disk folder); give a glob of its Arrow files, e.g. '{tmp_path / 'plain' / '*.arrow'}'"
    )
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(SpecError) as err:
        ops.ReadArrow(str(tmp_path / "dd"), label="toks").paths()
    assert str(err.value) == (
        f"ReadArrow('toks'): '{tmp_path / 'dd'}' is a Hugging Face DatasetDict folder (splits: train, "
        f"test); a source reads one split: name its folder, e.g. ReadArrow('{tmp_path / 'dd' / 'train'}')"
    )


def test_the_datasets_package_writes_folders_read_the_same(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    docs = documents(25, seed=1)
    datasets.Dataset.from_dict({"input_ids": docs}).save_to_disk(str(tmp_path / "hf"))
    ours = save_to_disk(tmp_path / "ours", docs, shards=1)
    theirs = global_digests(packed(ops.ReadArrow(str(tmp_path / "hf"), column="input_ids"), batch=2), steps=5)
    assert theirs == global_digests(packed(ops.ReadArrow(ours, column="input_ids"), batch=2), steps=5)


# -- the elastic contract on pre-tokenized data ----------------------------------------------
@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> zf.LoaderSpec:
    root = tmp_path_factory.mktemp("pretokenized")
    hf = save_to_disk(root / "hf", documents(60, seed=2), shards=2)
    table = pa.table({"tokens": pa.array(documents(40, seed=3), type=pa.large_list(pa.uint16()))})
    pq.write_table(table, root / "code.parquet", row_group_size=6)

    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadArrow(hf, column="input_ids")
        code = p | "code" >> ops.ReadParquet(str(root / "code.parquet"), column="tokens")
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.6, 0.4])
        seqs = docs | "pack" >> beam.ParDo(ops.Pack(seq_len=24, labels=True))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=4))

    return zf.LoaderSpec(build, lanes=LANES, seed=7, global_batch_size=12)


reference = reference_fixture(STEPS)
test_any_topology_and_resume_points_give_the_reference_batches = any_topology_test(STEPS, examples=5)
test_world_sizes_give_the_reference_batches = world_sizes_test(
    STEPS, [w for w in WORLD_SIZES if w in (1, 3, 12)]
)
test_processes_backend_resumes_a_threads_run = resume_test(
    STEPS, 2, [Segment(4, "threads", 2, 2, 3, 2), Segment(2, "processes", 2, 2, 4, 3)]
)


def test_beams_own_runner_gives_the_reference_batches(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]], tmp_path: Path
) -> None:
    materialize(spec, steps=STEPS, out=str(tmp_path / "out"), passes=2)
    got: list[Any] = [(s, batch_digest(b)) for s, b in read_materialized(str(tmp_path / "out"))]
    assert got == reference


def test_a_save_to_disk_folder_on_a_remote_filesystem(tmp_path: Path) -> None:
    """Through Beam's FileSystems (here ``zfmem://``, as ``gs://`` would be)."""
    from test_files import MEMORY

    docs = documents(12, seed=4)
    local = save_to_disk(tmp_path / "hf", docs, shards=2)
    MEMORY.clear()
    try:
        for f in Path(local).iterdir():
            MEMORY[f"zfmem://bkt/hf/{f.name}"] = f.read_bytes()
        data = ["zfmem://bkt/hf/data-00000-of-00002.arrow", "zfmem://bkt/hf/data-00001-of-00002.arrow"]
        for pattern in ("zfmem://bkt/hf", "zfmem://bkt/hf/*"):
            source = ops.ReadArrow(pattern, column="input_ids")
            assert source.paths() == data
            records = [r for s in source.splits() for _, r in source.read_split(s, -1)]
            assert sorted(r.payload.tolist() for r in records) == sorted(docs)
    finally:
        MEMORY.clear()
