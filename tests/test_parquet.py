"""Tests of ReadParquet: row-range splits (grouped and cut row groups), resume, error messages."""

from __future__ import annotations

import pickle
import re
from collections.abc import Sequence
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.util import assert_that, equal_to

from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Record, Split
from zephon_flow.operators import _column, parquet
from zephon_flow.operators.parquet import ReadParquet

OP = "ReadParquet('code')"


def write(path: Path, rows_per_group: int, **columns: Sequence[object]) -> str:
    pq.write_table(pa.table(columns), path, row_group_size=rows_per_group)
    return str(path)


def read(source: ReadParquet, split: Split, position: int = START) -> list[tuple[int, Record]]:
    return list(source.read_split(split, position))


def texts(n: int) -> list[str]:
    return [f"doc {i}" for i in range(n)]


@pytest.fixture(autouse=True)
def fine_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small tables are cut as finely as big ones would be (no minimum split size)."""
    monkeypatch.setattr(_column, "MIN_SPLIT_ROWS", 1)


def test_small_row_groups_are_grouped(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 5, text=texts(100))
    # 100 rows, 1 lane: about 100 / 8 = 13 rows a split, cut at the 5-row groups closest to it.
    splits = ReadParquet(path).splits()
    assert [(s.start, s.stop) for s in splits] == [(i, i + 15) for i in range(0, 90, 15)] + [(90, 100)]


def test_a_big_row_group_is_cut_into_row_ranges(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 100, text=texts(100))
    splits = ReadParquet(path).splits()
    assert [(s.start, s.stop) for s in splits] == [(i * 100 // 8, (i + 1) * 100 // 8) for i in range(8)]
    assert [s.cost for s in splits] == [s.stop - s.start for s in splits]


@pytest.mark.parametrize("lanes", [1, 3, 8, 32])
def test_splits_are_balanced_and_read_every_row_once(tmp_path: Path, lanes: int) -> None:
    write(tmp_path / "a.parquet", 700, text=texts(2000))
    write(tmp_path / "b.parquet", 9, text=[f"b{i}" for i in range(300)])
    write(tmp_path / "c.parquet", 5000, text=[f"c{i}" for i in range(50)])
    source = ReadParquet(str(tmp_path / "*.parquet"))
    splits = source.splits(lanes)
    target = -(-2350 // (8 * lanes))
    costs = [s.cost for s in splits]
    assert max(costs) <= 1.25 * target
    assert len(splits) <= 2350 / (0.5 * target) + 3  # fine, never absurdly small
    values = [r.payload for s in splits for _, r in read(source, s)]
    assert values == texts(2000) + [f"b{i}" for i in range(300)] + [f"c{i}" for i in range(50)]


def test_reads_a_range_with_its_row_group_and_file_row(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 3, text=texts(7), n=list(range(7)))
    source = ReadParquet(path)
    assert read(source, Split(path, 2, 5)) == [
        (3, Record("doc 2", path, "row group 0 row 2", 2)),
        (4, Record("doc 3", path, "row group 1 row 0", 3)),
        (5, Record("doc 4", path, "row group 1 row 1", 4)),
    ]
    values = [r.payload for s in source.splits() for _, r in read(source, s)]
    assert values == texts(7)


def test_resume_inside_a_range_reproduces_the_rest(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 4500, text=texts(9000))
    source = ReadParquet(path)
    for split in [*source.splits(), Split(path, 0, 9000)]:
        items = read(source, split)
        for k in sorted(
            {0, 1, 4095, 4096, 4097, 4500, len(items) // 2, len(items) - 1} & set(range(len(items)))
        ):
            position = items[k][0]
            assert read(source, split, position) == items[k + 1 :]
        assert read(source, split, split.stop) == []


def test_resume_beyond_the_range_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 3, text=texts(4))
    source = ReadParquet(path, label="code")
    message = f"{OP}: cannot resume rows [3, 4) of {path} at row 5; did the file change since the checkpoint?"
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, Split(path, 3, 4), 5)


def test_listing_skips_a_corrupt_footer_under_skip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = write(tmp_path / "a.parquet", 3, text=texts(4))
    bad = tmp_path / "b.parquet"
    bad.write_bytes(Path(good).read_bytes()[:-12] + b"\0" * 8 + b"PAR1")
    source = ReadParquet(str(tmp_path / "*.parquet"), label="code", on_error="skip")
    assert {s.path for s in source.splits()} == {good}
    assert source.skipped_files == [str(bad)]
    assert (
        f"{OP}: leaving out {bad} (on_error='skip'): {OP}: {bad} is not a readable Parquet file"
        in caplog.text
    )
    with pytest.raises(DataError, match=re.escape(f"{OP}: {bad} is not a readable Parquet file")):
        ReadParquet(str(tmp_path / "*.parquet"), label="code").splits()


def test_nulls_and_empty_strings_give_no_document(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 2, text=["a", None, "", "d"])
    source = ReadParquet(path)
    records = [r for s in source.splits() for _, r in read(source, s)]
    assert [r.payload for r in records] == ["a", None, "", "d"]
    assert [t for r in records for t in source.decode(r, OP)] == ["a", "d"]


def test_decode_refuses_a_value_that_is_not_a_string() -> None:
    source = ReadParquet("unused", column="body")
    message = f"{OP}: the column 'body' in /d/a.parquet at row group 2 row 5 holds a value of type bytes, not a string (a binary column: store the text as a string column)"
    with pytest.raises(DataError, match=re.escape(message)):
        source.decode(Record(b"raw", "/d/a.parquet", "row group 2 row 5", 5), OP)


def test_a_column_of_another_type_is_refused_when_the_files_are_listed(tmp_path: Path) -> None:
    path = write(tmp_path / "a.parquet", 2, text=[1, 2, 3])
    message = (
        f"{OP}: the column 'text' in {path} has type int64; a column must hold text (string or "
        "large_string) or token ids (list, large_list or fixed_size_list of int8..int64 or "
        "uint8..uint64)"
    )
    with pytest.raises(DataError, match=re.escape(message) + "$"):
        ReadParquet(path, label="code").splits()
    write(tmp_path / "b.parquet", 2, text=[b"x"])
    with pytest.raises(DataError, match=re.escape("(a binary column: store the text as a string column)")):
        ReadParquet(str(tmp_path / "b.parquet"), label="code").splits()


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
    message = f"{OP}: {path} holds 3 rows, not the 6 its splits were listed with; did the file change"
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, Split(path, 5, 6))


def test_params_include_the_column() -> None:
    assert ReadParquet("d/*.parquet", column="content").params() == {
        "pattern": "d/*.parquet",
        "epochs": None,
        "on_error": "raise",
        "column": "content",
        "split_plan": 2,
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


def test_the_ranges_cut_from_one_row_group_decode_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "a.parquet", 1000, text=texts(2000))
    source = ReadParquet(path)
    splits = source.splits(4)
    assert len(splits) == 32
    reads: list[int] = []
    real = parquet._RowGroups.column

    def counted(self: parquet._RowGroups, group: int) -> pa.ChunkedArray:
        reads.append(group)
        return real(self, group)

    monkeypatch.setattr(parquet._RowGroups, "column", counted)
    values = [r.payload for s in splits for _, r in read(source, s)]
    assert values == texts(2000) and reads == [0, 1]
    # A pickled copy (a worker) starts with an empty cache; a rewritten file is read anew.
    copy = pickle.loads(pickle.dumps(source))
    assert [r.payload for _, r in read(copy, splits[0])] == texts(splits[0].stop)
    write(tmp_path / "a.parquet", 1000, text=[t + "!" for t in texts(2000)])
    assert read(source, splits[0])[0][1].payload == "doc 0!"
