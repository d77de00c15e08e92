"""Tests of ReadJsonl: line-aligned byte splits, compressed files, resume and error messages."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
import zstandard
from apache_beam.testing.util import assert_that, equal_to
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_flow.core import files
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Record, Split
from zephon_flow.operators import jsonl as jsonl_module
from zephon_flow.operators.jsonl import ReadJsonl

OP = "ReadJsonl('web')"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seek indexes of this test's files go to its own cache directory."""
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "index-cache"))


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def jsonl(*texts: str) -> bytes:
    return b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts)


def read(source: ReadJsonl, split: Split, position: int = START) -> list[tuple[int, Record]]:
    return list(source.read_split(split, position))


def read_all(source: ReadJsonl) -> list[tuple[int, Record]]:
    return [item for split in source.splits() for item in read(source, split)]


def compress(data: bytes, suffix: str) -> bytes:
    return gzip.compress(data) if suffix == ".gz" else zstandard.ZstdCompressor().compress(data)


def assert_resumes(source: ReadJsonl, split: Split) -> None:
    """Resuming at every position a read yielded reproduces the rest of the split."""
    items = read(source, split)
    for k, (position, _) in enumerate(items):
        assert read(source, split, position) == items[k + 1 :]


# -- byte-range splits of plain files ------------------------------------------------------
line_bytes = st.one_of(
    st.binary(max_size=30).map(lambda b: b.replace(b"\n", b"")),
    st.sampled_from([b"", b" ", b"\t\r", b"{}"]),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(line_bytes, min_size=1, max_size=25),
    final_newline=st.booleans(),
    split_bytes=st.sampled_from([1, 2, 3, 7, 16, 64, 4096]),
)
def test_byte_splits_lose_and_repeat_no_line(
    tmp_path: Path, lines: list[bytes], final_newline: bool, split_bytes: int
) -> None:
    data = b"\n".join(lines) + (b"\n" if final_newline else b"")
    if not data:
        data = b"\n"
    path = write(tmp_path / "data.jsonl", data)
    source = ReadJsonl(path, split_bytes=split_bytes)

    starts, offset = [], 0
    for line in data.split(b"\n"):
        starts.append(offset)
        offset += len(line) + 1
    expected = [
        (min(start + len(line) + 1, len(data)), Record(line, path, f"byte {start}", start))
        for start, line in zip(starts, data.split(b"\n"), strict=True)
        if line.strip()
    ]
    assert read_all(source) == expected
    for split in source.splits():
        assert_resumes(source, split)


def test_splits_cover_the_file_in_split_bytes_ranges(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", b"x" * 25)
    assert ReadJsonl(path, split_bytes=10).splits() == [
        Split(path, 0, 10),
        Split(path, 10, 20),
        Split(path, 20, 25),
    ]


def test_a_split_starting_on_a_line_start_owns_that_line(tmp_path: Path) -> None:
    data = jsonl("a", "b", "c")
    first = len(jsonl("a"))
    path = write(tmp_path / "a.jsonl", data)
    source = ReadJsonl(path, split_bytes=first)
    owned = [[r.payload for _, r in read(source, s)] for s in source.splits()]
    assert owned[0] == [b'{"text": "a"}']
    assert owned[1] == [b'{"text": "b"}']
    assert owned[2] == [b'{"text": "c"}']
    assert all(not o for o in owned[3:])


def test_a_line_crossing_the_split_end_belongs_to_the_split_it_starts_in(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", b"aaaaaaaaaa\nb\n")
    source = ReadJsonl(path, split_bytes=4)
    assert [[r.payload for _, r in read(source, s)] for s in source.splits()] == [
        [b"aaaaaaaaaa"],
        [],
        [b"b"],
        [],
    ]


def test_resuming_past_the_split_end_reads_nothing(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", jsonl("a", "b"))
    split = ReadJsonl(path).splits()[0]
    assert read(ReadJsonl(path), split, split.stop) == []


def test_a_position_before_the_split_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", jsonl("a", "b", "c"))
    source = ReadJsonl(path, split_bytes=10, label="web")
    with pytest.raises(
        DataError, match=re.escape(f"{OP}: position 3 lies before the split [10, 20) of {path}")
    ):
        read(source, source.splits()[1], 3)


# -- compressed files ------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_small_compressed_file_is_one_split_positioned_by_decompressed_bytes(
    tmp_path: Path, suffix: str
) -> None:
    data = jsonl("a", "b") + b"  \n" + jsonl("", "d")
    path = write(tmp_path / f"a.jsonl{suffix}", compress(data, suffix))
    source = ReadJsonl(path)
    assert source.splits() == [Split(path, 0, 0, len(data))]
    items = read_all(source)
    ends = [i + 1 for i, c in enumerate(data) if c == ord("\n")]
    starts = [0, *ends[:-1]]
    kept = [0, 1, 3, 4]  # the whitespace line (2) gives no record
    assert [(pos, r.where) for pos, r in items] == [(ends[k], f"decompressed byte {starts[k]}") for k in kept]
    assert [t for _, r in items for t in source.decode(r, OP)] == ["a", "b", "d"]
    assert_resumes(source, source.splits()[0])
    # Resuming at the whitespace line's start skips it like a fresh read does.
    assert read(source, source.splits()[0], starts[2]) == items[2:]


def test_zstd_file_of_several_frames_is_split_at_frames(tmp_path: Path) -> None:
    frames = [zstandard.ZstdCompressor().compress(jsonl(t)) for t in ("a", "b", "c")]
    path = write(tmp_path / "a.jsonl.zst", b"".join(frames))
    source = ReadJsonl(path, split_bytes=1)
    n = len(jsonl("a"))
    assert source.splits() == [Split(path, 0, n), Split(path, n, 2 * n), Split(path, 2 * n, 3 * n)]
    assert [t for _, r in read_all(source) for t in source.decode(r, OP)] == ["a", "b", "c"]
    for split in source.splits():
        assert_resumes(source, split)


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_resuming_beyond_a_compressed_file_is_refused(tmp_path: Path, suffix: str) -> None:
    data = jsonl("a", "b")
    path = write(tmp_path / f"a.jsonl{suffix}", compress(data, suffix))
    source = ReadJsonl(path, label="web")
    message = (
        f"{OP}: cannot resume {path} at decompressed byte 500: it holds only {len(data)} bytes; "
        "did the file change since the checkpoint?"
    )
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, source.splits()[0], 500)


@pytest.mark.parametrize(
    ("name", "data", "reason"),
    [
        ("a.jsonl.gz", b"plain text\n", "Not a gzipped file"),
        ("b.jsonl.gz", gzip.compress(jsonl(*"abcdefgh"))[:-12], "Compressed file ended before"),
        ("c.jsonl.zst", b"plain text\n", "zstd decompressor error: Unknown frame descriptor"),
        (
            "d.jsonl.zst",
            zstandard.ZstdCompressor().compress(jsonl(*"abcdefgh"))[:-12],
            "the file ends inside a frame (truncated?)",
        ),
    ],
    # gzip's bytes hold the time it ran: ids by name, the same in every xdist worker
    ids=["a.jsonl.gz", "b.jsonl.gz", "c.jsonl.zst", "d.jsonl.zst"],
)
def test_damaged_compressed_file(tmp_path: Path, name: str, data: bytes, reason: str) -> None:
    path = write(tmp_path / name, data)
    source = ReadJsonl(path, label="web")
    with pytest.raises(DataError, match=re.escape(f"{OP}: cannot read {path}: {reason}")):
        read_all(source)


# -- files that cannot be read ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst"])
def test_zero_byte_file_is_refused(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / name, b"")
    with pytest.raises(DataError, match=re.escape(f"{OP}: {path} is empty (0 bytes)")):
        ReadJsonl(str(tmp_path / "*"), label="web").splits()


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz"])
def test_unreadable_file_names_the_os_error(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / name, compress(jsonl("a"), ".gz") if name.endswith(".gz") else jsonl("a"))
    source = ReadJsonl(path, label="web")
    split = source.splits()[0]
    os.remove(path)
    message = f"{OP}: cannot read {path}: No such file or directory"
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, split)


# -- decode ----------------------------------------------------------------------------------
def record(payload: bytes, where: str = "byte 7") -> Record:
    return Record(payload, "/d/a.jsonl", where, 7)


def test_decode_returns_the_field_and_skips_empty_documents() -> None:
    source = ReadJsonl("unused", field="body")
    assert source.decode(record(b'{"body": "hi \\u00e9", "n": 1}'), OP) == ["hi \u00e9"]
    assert source.decode(record(b'{"body": ""}'), OP) == []


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            b'{"text": "a" "b"}',
            "malformed JSON in /d/a.jsonl at byte 7: Expecting ',' delimiter (column 14)",
        ),
        (b'{"text": "a"} {}', "malformed JSON in /d/a.jsonl at byte 7: Extra data (column 15)"),
        (
            b'{"text": "\xff"}',
            "/d/a.jsonl at byte 7 is not valid UTF-8: invalid start byte (0xff, 10 bytes into the line)",
        ),
        (
            b'["text"]',
            "/d/a.jsonl at byte 7 holds a JSON array, not an object with the field 'text'",
        ),
        (
            b'{"body": "x", "id": 3}',
            "/d/a.jsonl at byte 7 has no field 'text' (it has 'body', 'id'); "
            "set field= to the field that holds the text",
        ),
        (b"{}", "/d/a.jsonl at byte 7 has no field 'text' (it has no fields)"),
        (
            b'{"text": 12}',
            "the field 'text' in /d/a.jsonl at byte 7 is a JSON number, not a string",
        ),
        (
            b'{"text": null}',
            "the field 'text' in /d/a.jsonl at byte 7 is a JSON null, not a string",
        ),
        (b"[" * 100_000, "malformed JSON in /d/a.jsonl at byte 7: nested too deeply"),
    ],
)
def test_decode_errors_name_the_file_the_place_and_the_operator(payload: bytes, message: str) -> None:
    with pytest.raises(DataError, match=re.escape(f"{OP}: {message}")):
        ReadJsonl("unused").decode(record(payload), OP)


def test_a_byte_order_mark_is_ignored_at_the_start_of_a_file_only(tmp_path: Path) -> None:
    bom = b"\xef\xbb\xbf"
    path = write(tmp_path / "a.jsonl", bom + b'{"text": "first"}\n{"text": "second"}\n')
    source = ReadJsonl(path)
    records = read_all(source)
    assert [source.decode(r, OP) for _, r in records] == [["first"], ["second"]]
    assert [r.offset for _, r in records] == [0, 21]
    later = Record(bom + b'{"text": "x"}', "/d/a.jsonl", "byte 7", 7)  # inside a file: not JSON
    with pytest.raises(
        DataError, match=re.escape(f"{OP}: malformed JSON in /d/a.jsonl at byte 7: Unexpected UTF-8 BOM")
    ):
        source.decode(later, OP)


@pytest.mark.parametrize(
    ("payload", "text"),
    [
        (b'{"text": "a", "score": NaN}', "a"),  # orjson refuses NaN and Infinity; json takes them
        (b'{"text": "a", "big": 1e400}', "a"),
        (b'{"text": "x\\ud800y"}', "x\ud800y"),  # a lone surrogate escape
        (b'{"text": "first", "text": "last"}', "last"),  # the last of repeated keys, as json
    ],
)
def test_decode_takes_what_the_standard_json_takes(payload: bytes, text: str) -> None:
    assert ReadJsonl("unused").decode(record(payload), OP) == [text]


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=8),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
            lambda inner: (
                st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
            ),
            max_leaves=8,
        ),
        max_size=4,
    ),
    st.text(),
    st.booleans(),
)
def test_decode_gives_the_text_json_gives(extra: dict[str, Any], text: str, ascii_only: bool) -> None:
    line = json.dumps({**extra, "text": text}, ensure_ascii=ascii_only).encode()
    assert ReadJsonl("unused").decode(record(line), OP) == ([json.loads(line)["text"]] if text else [])


def test_decode_works_on_a_pickled_copy(tmp_path: Path) -> None:
    path = write(tmp_path / "a.jsonl", jsonl("a", "b"))
    source = ReadJsonl(path)
    items = read_all(source)
    copy = pickle.loads(pickle.dumps(source))
    assert [t for _, r in items for t in copy.decode(r, OP)] == ["a", "b"]


# -- construction and pipelines --------------------------------------------------------------
def test_params_include_field_and_split_bytes() -> None:
    assert ReadJsonl("d/*.jsonl", field="body", split_bytes=100, epochs=2).params() == {
        "pattern": "d/*.jsonl",
        "epochs": 2,
        "on_error": "raise",
        "field": "body",
        "split_bytes": 100,
        "split_plan": 2,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"field": ""}, "ReadJsonl: field must be a non-empty string, got ''"),
        ({"split_bytes": 0}, "ReadJsonl: split_bytes must be a positive integer or None, got 0"),
        ({"split_bytes": True}, "ReadJsonl: split_bytes must be a positive integer or None, got True"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        ReadJsonl("d/*.jsonl", **kwargs)  # type: ignore[arg-type]


def test_reads_plain_and_compressed_files_in_a_beam_pipeline(tmp_path: Path) -> None:
    write(tmp_path / "a.jsonl", jsonl("a1", "a2", "", "a3"))
    write(tmp_path / "b.jsonl.gz", gzip.compress(jsonl("b1")))
    write(tmp_path / "c.jsonl.zst", compress(jsonl("c1", "c2"), ".zst"))
    with beam.Pipeline() as p:
        docs = p | "web" >> ReadJsonl(str(tmp_path / "*.jsonl*"), split_bytes=8)
        assert_that(docs, equal_to(["a1", "a2", "a3", "b1", "c1", "c2"]))


# -- the automatic plan, huge lines, listing under on_error="skip" ---------------------------
@pytest.mark.parametrize("lanes", [1, 4, 16])
def test_automatic_splits_are_fine_and_balanced(
    tmp_path: Path, lanes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jsonl_module, "MIN_SPLIT_BYTES", 1024)
    texts = [f"doc {i} " + "x" * (i % 97) for i in range(3000)]
    for k in range(3):
        write(tmp_path / f"{k}.jsonl", jsonl(*texts[k * 1000 : (k + 1) * 1000]))
    source = ReadJsonl(str(tmp_path / "*.jsonl"))
    splits = source.splits(lanes)
    assert len(splits) >= 8 * lanes
    weights = [s.cost for s in splits]
    assert max(weights) <= 1.25 * (sum(weights) / len(weights))
    got = [t for s in splits for _, r in read(source, s) for t in source.decode(r, OP)]
    assert got == texts


def test_a_huge_line_is_read_once_not_by_every_split_inside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    huge = "h" * 2_000_000
    path = write(tmp_path / "a.jsonl", jsonl("a", huge, "b"))
    read_bytes = [0]

    class Counting(io.FileIO):
        def readinto(self, buffer: Any) -> int:
            n = super().readinto(buffer) or 0
            read_bytes[0] += n
            return n

    def counting(p: str, operator: str, buffering: int = -1) -> io.BufferedReader:
        return io.BufferedReader(Counting(p), buffering if buffering > 0 else io.DEFAULT_BUFFER_SIZE)

    monkeypatch.setattr(files, "open_binary", counting)
    source = ReadJsonl(path, split_bytes=64 * 1024)
    assert len(source.splits()) > 30
    assert [t for _, r in read_all(source) for t in source.decode(r, OP)] == ["a", huge, "b"]
    # Each split inside the line scans at most its own bytes (plus a buffer) for a line start.
    assert read_bytes[0] < 3 * os.path.getsize(path)


def test_listing_skips_an_empty_file_under_skip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = write(tmp_path / "a.jsonl", jsonl("a"))
    empty = write(tmp_path / "b.jsonl", b"")
    source = ReadJsonl(str(tmp_path / "*.jsonl"), on_error="skip", label="web")
    assert [s.path for s in source.splits()] == [good]
    assert source.skipped_files == [empty]
    assert f"{OP}: leaving out {empty} (on_error='skip'): {OP}: {empty} is empty (0 bytes)" in caplog.text
