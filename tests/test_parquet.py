"""Tests of ReadParquet: one split per row group, resume inside a group, error messages."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.util import assert_that, equal_to

from zephon_flow.errors import DataError, SpecError
from zephon_flow.operators.parquet import ReadParquet
from zephon_flow.operators.splits import START, Record, Split

OP = "ReadParquet('code')"


def write(path: Path, rows_per_group: int, **columns: list[object]) -> str:
    pq.write_table(pa.table(columns), path, row_group_size=rows_per_group)
    return str(path)


def read(source: ReadParquet, split: Split, position: int = START) -> list[tuple[int, Record]]:
    return list(source.read_split(split, position))


def texts(n: int) -> list[object]:
    return [f"doc {i}" for i in range(n)]


def test_one_split_per_row_group(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 3, text=texts(7), n=list(range(7)))
    assert ReadParquet(path).splits() == [Split(path, 0, 1), Split(path, 1, 2), Split(path, 2, 3)]


def test_reads_each_row_group_in_order(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 3, text=texts(7), n=list(range(7)))
    source = ReadParquet(path)
    split = source.splits()[1]
    assert read(source, split) == [
        (1, Record("doc 3", path, "row group 1 row 0", 0)),
        (2, Record("doc 4", path, "row group 1 row 1", 1)),
        (3, Record("doc 5", path, "row group 1 row 2", 2)),
    ]
    values = [r.payload for s in source.splits() for _, r in read(source, s)]
    assert values == texts(7)


def test_resume_inside_a_row_group_reproduces_the_rest(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 4500, text=texts(9000))
    source = ReadParquet(path)
    for split in source.splits():
        items = read(source, split)
        for k in (0, 1, 4095, 4096, 4097, len(items) - 1):
            position = items[k][0]
            assert read(source, split, position) == items[k + 1 :]
        assert read(source, split, len(items)) == []


def test_resume_beyond_the_row_group_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 3, text=texts(4))
    source = ReadParquet(path, label="code")
    message = (
        f"{OP}: cannot resume row group 1 of {path} at row 2: it holds 1 rows; "
        "did the file change since the checkpoint?"
    )
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, source.splits()[1], 2)


def test_nulls_and_empty_strings_give_no_document(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 2, text=["a", None, "", "d"])
    source = ReadParquet(path)
    records = [r for s in source.splits() for _, r in read(source, s)]
    assert [r.payload for r in records] == ["a", None, "", "d"]
    assert [t for r in records for t in source.decode(r, OP)] == ["a", "d"]


def test_decode_refuses_a_value_that_is_not_a_string() -> None:
    source = ReadParquet("unused", column="body")
    message = f"{OP}: the column 'body' in /d/a.parquet at row group 2 row 5 holds a bytes, not a string"
    with pytest.raises(DataError, match=re.escape(message)):
        source.decode(Record(b"raw", "/d/a.parquet", "row group 2 row 5", 5), OP)


def test_non_string_column_fails_in_decode_with_the_row(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 2, text=[1, 2, 3])
    source = ReadParquet(path)
    record = read(source, source.splits()[1])[0][1]
    message = f"{OP}: the column 'text' in {path} at row group 1 row 0 holds a int, not a string"
    with pytest.raises(DataError, match=re.escape(message)):
        source.decode(record, OP)


def test_missing_column_names_the_file_and_the_available_columns(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 2, body=texts(3), n=[1, 2, 3])
    source = ReadParquet(path, label="code")
    message = (
        f"{OP}: {path} has no column 'text' (columns: 'body', 'n'); "
        "set column= to the one that holds the text"
    )
    with pytest.raises(DataError, match=re.escape(message)):
        source.splits()
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, Split(path, 0, 1))


def test_zero_byte_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    path.write_bytes(b"")
    message = f"{OP}: {path} is empty (0 bytes), not a Parquet file"
    with pytest.raises(DataError, match=re.escape(message)):
        ReadParquet(str(path), label="code").splits()


def test_non_parquet_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    path.write_bytes(b'{"text": "this is JSON"}\n')
    message = f"{OP}: {path} is not a readable Parquet file: Parquet magic bytes not found"
    with pytest.raises(DataError, match=re.escape(message)):
        ReadParquet(str(path), label="code").splits()


def test_vanished_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 2, text=texts(3))
    source = ReadParquet(path, label="code")
    split = source.splits()[0]
    Path(path).unlink()
    with pytest.raises(DataError, match=re.escape(f"{OP}: cannot read {path}: ")):
        read(source, split)


def test_a_row_group_that_is_gone_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 2, text=texts(3))
    source = ReadParquet(path, label="code")
    message = f"{OP}: {path} has no row group 5 (it has 2); did the file change"
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, Split(path, 5, 6))


def test_params_include_the_column() -> None:
    assert ReadParquet("d/*.parquet", column="content").params() == {
        "pattern": "d/*.parquet",
        "epochs": None,
        "on_error": "raise",
        "column": "content",
    }


def test_empty_column_name_is_refused() -> None:
    message = "ReadParquet: column must be a non-empty string, got ''"
    with pytest.raises(SpecError, match=re.escape(message)):
        ReadParquet("d/*.parquet", column="")


def test_decode_works_on_a_pickled_copy(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 2, text=texts(3))
    source = ReadParquet(path)
    records = [r for s in source.splits() for _, r in read(source, s)]
    copy = pickle.loads(pickle.dumps(source))
    assert [t for r in records for t in copy.decode(r, OP)] == texts(3)


def test_reads_files_in_a_beam_pipeline(tmp_path: Path) -> None:
    write(tmp_path / "a.parquet", 2, content=["a1", None, "a3"], n=[1, 2, 3])
    write(tmp_path / "b.parquet", 2, content=["b1"], n=[4])
    with beam.Pipeline() as p:
        docs = p | "code" >> ReadParquet(str(tmp_path / "*.parquet"), column="content")
        assert_that(docs, equal_to(["a1", "a3", "b1"]))
