"""Tests of ReadArrow: row-range splits over record batches, IPC file and stream formats, resume, errors."""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.ipc as ipc
import pytest
from apache_beam.testing.util import assert_that, equal_to
from checkpointing import assert_equal_output_after_checkpoint
from helpers import Corpus, DocKey, run_batches, source_epochs, tagged_texts

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Record, Split
from zephon_flow.operators import _column
from zephon_flow.operators.arrow import ReadArrow

OP = "ReadArrow('books')"


@pytest.fixture(autouse=True)
def fine_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small tables are cut as finely as big ones would be (no minimum split size)."""
    monkeypatch.setattr(_column, "MIN_SPLIT_ROWS", 1)


def write(path: Path, batches: Sequence[Mapping[str, Sequence[object]]], *, stream: bool = False) -> str:
    """One record batch per dict of columns, as an IPC file (or stream)."""
    rbs = [pa.record_batch(cols) for cols in batches]
    open_writer = ipc.new_stream if stream else ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, open_writer(sink, rbs[0].schema) as writer:
        for rb in rbs:
            writer.write_batch(rb)
    return str(path)


def read(source: ReadArrow, split: Split, position: int = START) -> list[tuple[int, Record]]:
    return list(source.read_split(split, position))


def texts(start: int, n: int) -> list[object]:
    return [f"doc {i}" for i in range(start, start + n)]


def three_batches(path: Path, *, stream: bool = False) -> str:
    return write(path, [{"text": texts(0, 3)}, {"text": texts(3, 2)}, {"text": texts(5, 4)}], stream=stream)


@pytest.mark.parametrize("stream", [False, True])
def test_row_ranges_over_batches_read_in_order(tmp_path: Path, stream: bool) -> None:
    path = three_batches(tmp_path / "a.arrow", stream=stream)
    source = ReadArrow(path)
    # 9 rows, 1 lane: about 2 rows a split, cut at batch starts and inside the big batches.
    assert [(s.start, s.stop) for s in source.splits()] == [(0, 1), (1, 3), (3, 5), (5, 7), (7, 9)]
    assert read(source, Split(path, 2, 6)) == [
        (3, Record("doc 2", path, "record batch 0 row 2", 2)),
        (4, Record("doc 3", path, "record batch 1 row 0", 3)),
        (5, Record("doc 4", path, "record batch 1 row 1", 4)),
        (6, Record("doc 5", path, "record batch 2 row 0", 5)),
    ]
    values = [r.payload for s in source.splits() for _, r in read(source, s)]
    assert values == texts(0, 9)


@pytest.mark.parametrize("lanes", [1, 4, 16])
def test_many_small_batches_are_grouped_and_balanced(tmp_path: Path, lanes: int) -> None:
    path = write(tmp_path / "a.arrow", [{"text": texts(i * 7, 7)} for i in range(100)])
    source = ReadArrow(path)
    splits = source.splits(lanes)
    target = -(-700 // (8 * lanes))
    assert max(s.cost for s in splits) <= 1.25 * target + 7
    assert len(splits) >= min(100, 8 * lanes) * 0.6
    assert [r.payload for s in splits for _, r in read(source, s)] == texts(0, 700)


@pytest.mark.parametrize("stream", [False, True])
def test_resume_at_every_position_reproduces_the_rest(tmp_path: Path, stream: bool) -> None:
    path = three_batches(tmp_path / "a.arrow", stream=stream)
    source = ReadArrow(path)
    for split in source.splits():
        items = read(source, split)
        for k, (position, _) in enumerate(items):
            assert read(source, split, position) == items[k + 1 :]


def test_resume_across_the_conversion_chunk(tmp_path: Path) -> None:
    path = write(tmp_path / "a.arrow", [{"text": texts(0, 9000)}])
    source = ReadArrow(path)
    split = Split(path, 0, 9000)
    items = read(source, split)
    assert [r.payload for _, r in items] == texts(0, 9000)
    for k in (0, 4095, 4096, 8999):
        assert read(source, split, items[k][0]) == items[k + 1 :]


def test_feather_v2_with_compression_is_read(tmp_path: Path) -> None:
    path = str(tmp_path / "a.feather")
    table = pa.table({"n": list(range(5)), "body": texts(0, 5)})
    feather.write_feather(table, path, compression="zstd", chunksize=2)
    source = ReadArrow(path, column="body")
    assert len(source.splits()) == 5  # 5 rows, 1 lane: one row a split
    docs = [t for s in source.splits() for _, r in read(source, s) for t in source.decode(r, OP)]
    assert docs == texts(0, 5)


def test_only_the_named_column_is_taken_and_large_strings_work(tmp_path: Path) -> None:
    batch = {"id": [1, 2], "content": pa.array(["x", "y"], type=pa.large_string())}
    path = write(tmp_path / "a.arrow", [batch])
    source = ReadArrow(path, column="content")
    assert [r.payload for s in source.splits() for _, r in read(source, s)] == ["x", "y"]


def test_nulls_and_empty_strings_give_no_document(tmp_path: Path) -> None:
    path = write(tmp_path / "a.arrow", [{"text": ["a", None, "", "d"]}])
    source = ReadArrow(path)
    records = [r for s in source.splits() for _, r in read(source, s)]
    assert [r.payload for r in records] == ["a", None, "", "d"]
    assert [t for r in records for t in source.decode(r, OP)] == ["a", "d"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_column_of_another_type_is_refused_when_the_files_are_listed(tmp_path: Path, stream: bool) -> None:
    path = write(tmp_path / "a.arrow", [{"text": [1, 2]}, {"text": [3, 4]}], stream=stream)
    message = (
        f"{OP}: the column 'text' in {path} has type int64; a column must hold text (string or "
        "large_string) or token ids (list, large_list or fixed_size_list of int8..int64 or "
        "uint8..uint64)"
    )
    with pytest.raises(DataError, match=re.escape(message) + "$"):
        ReadArrow(path, label="books").splits()
    strings = write(tmp_path / "b.arrow", [{"text": pa.array([["a"]])}])
    with pytest.raises(DataError, match=re.escape("type list<item: string>; a column must hold")):
        ReadArrow(strings, label="books").splits()


def test_binary_values_are_refused_in_decode() -> None:
    message = f"{OP}: the column 'text' in /d/a.arrow at record batch 0 row 2 holds a value of type bytes, not a string (a binary column: store the text as a string column)"
    with pytest.raises(DataError, match=re.escape(message)):
        ReadArrow("unused").decode(Record(b"raw", "/d/a.arrow", "record batch 0 row 2", 2), OP)


@pytest.mark.parametrize("stream", [False, True])
def test_missing_column_names_the_file_and_the_columns_it_has(tmp_path: Path, stream: bool) -> None:
    path = write(tmp_path / "a.arrow", [{"body": texts(0, 2), "n": [1, 2]}], stream=stream)
    source = ReadArrow(path, label="books")
    message = f"{OP}: {path} has no column 'text' (columns: 'body', 'n'); set column= to the one that holds the text"
    with pytest.raises(DataError, match=re.escape(message)):
        source.splits()
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, Split(path, 0, 1))


def test_duplicate_column_name_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "a.arrow")
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"])
    feather.write_feather(table, path)
    message = f"{OP}: {path} has more than one column named 'text' (columns: 'text', 'text')"
    with pytest.raises(DataError, match=re.escape(message)):
        ReadArrow(path, label="books").splits()


def test_zero_byte_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.arrow"
    path.write_bytes(b"")
    message = f"{OP}: {path} is empty (0 bytes), not an Arrow IPC file"
    with pytest.raises(DataError, match=re.escape(message)):
        ReadArrow(str(path), label="books").splits()


def test_feather_v1_is_refused_with_a_hint(tmp_path: Path) -> None:
    path = str(tmp_path / "a.feather")
    Path(path).write_bytes(b"FEA1" + bytes(60) + b"FEA1")  # a v1 file opens and ends with its magic
    message = f"{OP}: {path} is a Feather v1 file; rewrite it as Feather v2"
    with pytest.raises(DataError, match=re.escape(message)):
        ReadArrow(path, label="books").splits()


def test_a_file_that_is_not_arrow_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.arrow"
    path.write_bytes(b'{"text": "this is JSON"}\n')
    message = f"{OP}: {path} is not a readable Arrow IPC file or stream: "
    with pytest.raises(DataError, match=re.escape(message)):
        ReadArrow(str(path), label="books").splits()


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = three_batches(tmp_path / "a.arrow")
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) - 40])
    message = f"{OP}: {path} is not a readable Arrow IPC file or stream: "
    with pytest.raises(DataError, match=re.escape(message)):
        ReadArrow(path, label="books").splits()


def test_a_truncated_stream_names_the_batch(tmp_path: Path) -> None:
    path = three_batches(tmp_path / "a.arrows", stream=True)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) - 60])
    message = f"{OP}: cannot read record batch 2 of {path}: "
    with pytest.raises(DataError, match=re.escape(message)):
        ReadArrow(path, label="books").splits()


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_that_is_gone_is_refused(tmp_path: Path, stream: bool) -> None:
    path = three_batches(tmp_path / "a.arrow", stream=stream)
    message = f"{OP}: {path} holds 9 rows, not the 12 its splits were listed with; did the file change"
    with pytest.raises(DataError, match=re.escape(message)):
        read(ReadArrow(path, label="books"), Split(path, 11, 12))


def test_resume_beyond_the_batch_is_refused(tmp_path: Path) -> None:
    path = three_batches(tmp_path / "a.arrow")
    source = ReadArrow(path, label="books")
    message = f"{OP}: cannot resume rows [3, 5) of {path} at row 6; did the file change since the checkpoint?"
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, Split(path, 3, 5), 6)


def test_vanished_file_is_refused(tmp_path: Path) -> None:
    path = three_batches(tmp_path / "a.arrow")
    source = ReadArrow(path, label="books")
    split = source.splits()[0]
    Path(path).unlink()
    with pytest.raises(DataError, match=re.escape(f"{OP}: cannot read {path}: ")):
        read(source, split)


def test_params_and_option_checks() -> None:
    assert ReadArrow("d/*.arrow", column="content", epochs=3, on_error="skip").params() == {
        "pattern": "d/*.arrow",
        "epochs": 3,
        "on_error": "skip",
        "column": "content",
        "split_plan": 2,
    }
    with pytest.raises(SpecError, match=re.escape("ReadArrow: column must be a non-empty string, got ''")):
        ReadArrow("d/*.arrow", column="")
    with pytest.raises(SpecError, match=re.escape("ReadArrow: on_error must be one of")):
        ReadArrow("d/*.arrow", on_error="ignore")


def test_decode_works_on_a_pickled_copy(tmp_path: Path) -> None:
    path = three_batches(tmp_path / "a.arrow")
    source = ReadArrow(path)
    records = [r for s in source.splits() for _, r in read(source, s)]
    copy = pickle.loads(pickle.dumps(source))
    assert [t for r in records for t in copy.decode(r, OP)] == texts(0, 9)


def test_reads_files_in_a_beam_pipeline(tmp_path: Path) -> None:
    three_batches(tmp_path / "a.arrow")
    write(tmp_path / "b.arrow", [{"text": ["b1", None]}], stream=True)
    with beam.Pipeline() as p:
        docs = p | "books" >> ReadArrow(str(tmp_path / "*.arrow"))
        assert_that(docs, equal_to([*texts(0, 9), "b1"]))


def test_checkpoint_at_every_step_across_an_epoch(tmp_path: Path, corpus: Corpus) -> None:
    docs = list(corpus.web_texts[:10])
    write(tmp_path / "0.arrow", [{"text": docs[0:3]}, {"text": docs[3:5]}])
    write(tmp_path / "1.arrow", [{"text": docs[5:8]}, {"text": docs[8:10]}], stream=True)

    def build(p: beam.Pipeline) -> beam.PCollection:
        books = p | "books" >> ops.ReadArrow(str(tmp_path / "*.arrow"))
        toks = books | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        return toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))

    spec = zf.LoaderSpec(build, lanes=2, seed=5, global_batch_size=4)
    ref = assert_equal_output_after_checkpoint(spec, 14)
    assert min(source_epochs(spec, ref.final_state)["books"]) >= 1  # every lane is past epoch 0


def test_one_epoch_on_three_lanes_delivers_every_row_once(tmp_path: Path) -> None:
    docs = tagged_texts("web", 12, seed=4)
    write(tmp_path / "0.arrow", [{"text": docs[0:2]}, {"text": docs[2:4]}, {"text": docs[4:6]}])
    write(
        tmp_path / "1.arrows", [{"text": docs[6:8]}, {"text": docs[8:10]}, {"text": docs[10:12]}], stream=True
    )

    def build(p: beam.Pipeline) -> beam.PCollection:
        books = p | "books" >> ops.ReadArrow(str(tmp_path / "*.arrow*"), epochs=1)
        return books | "key" >> beam.ParDo(DocKey())

    batches = run_batches(zf.LoaderSpec(build, lanes=3, seed=2, global_batch_size=3), world_size=1)
    assert sorted(int(d) for b in batches for d in b["doc"]) == list(range(12))


def test_listing_skips_a_file_that_is_not_arrow_under_skip(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = three_batches(tmp_path / "a.arrow")
    bad = tmp_path / "b.arrow"
    bad.write_bytes(b"")
    source = ReadArrow(str(tmp_path / "*.arrow"), label="books", on_error="skip")
    assert {s.path for s in source.splits()} == {good}
    assert source.skipped_files == [str(bad)]
    assert f"leaving out {bad} (on_error='skip'): {OP}: {bad} is empty (0 bytes)" in caplog.text
