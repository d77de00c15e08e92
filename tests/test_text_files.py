"""Tests of ReadTextFiles: one document per file, gzip, resume, and bad files named in errors."""

from __future__ import annotations

import gzip
import pickle
import re
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to
from checkpointing import assert_equal_output_after_checkpoint
from helpers import Corpus, DocKey, run_batches, source_epochs, tagged_texts

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Record, Split
from zephon_flow.operators.text_files import WHOLE_FILE, ReadTextFiles

OP = "ReadTextFiles('notes')"


def write(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def read(source: ReadTextFiles, split: Split, position: int = START) -> list[tuple[int, Record]]:
    return list(source.read_split(split, position))


def documents(source: ReadTextFiles) -> list[str]:
    return [t for s in source.splits() for _, r in read(source, s) for t in source.decode(r, OP)]


def test_one_split_per_file_in_sorted_order(tmp_path: Path) -> None:
    b = write(tmp_path / "b.txt", b"bee")
    a = write(tmp_path / "sub" / "a.txt", b"ay")
    c = write(tmp_path / "c.txt", b"sea")
    source = ReadTextFiles(str(tmp_path / "**" / "*.txt"))
    assert source.splits() == [Split(b, 0, 1), Split(c, 1, 2), Split(a, 2, 3)]
    assert read(source, source.splits()[0]) == [(1, Record(None, b, WHOLE_FILE, 0))]
    assert documents(source) == ["bee", "sea", "ay"]


def test_listing_and_reading_splits_open_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "a.txt", b"x")

    def no_open(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"opened {args[0]!r}")

    monkeypatch.setattr("builtins.open", no_open)
    source = ReadTextFiles(path)
    assert read(source, source.splits()[0]) == [(1, Record(None, path, WHOLE_FILE, 0))]
    with pytest.raises(AssertionError, match="opened"):
        source.decode(read(source, source.splits()[0])[0][1], OP)


def test_resume_after_the_run_reads_nothing_and_other_positions_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "a.txt", b"x")
    source = ReadTextFiles(path, label="notes")
    split = source.splits()[0]
    assert read(source, split, 1) == []
    message = (
        f"{OP}: cannot resume files [0, 1) from {path} at file 2; did the files change since the checkpoint?"
    )
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, split, 2)


@pytest.mark.parametrize("lanes", [1, 2, 8])
def test_many_files_are_dealt_in_runs_positioned_by_files_consumed(tmp_path: Path, lanes: int) -> None:
    paths = [write(tmp_path / f"{i:04d}.txt", f"doc {i}".encode()) for i in range(500)]
    source = ReadTextFiles(str(tmp_path / "*.txt"), label="notes")
    splits = source.splits(lanes)
    per = -(-500 // (8 * lanes))
    assert len(splits) >= 8 * lanes * 0.8 and max(s.cost for s in splits) <= 1.25 * per
    assert [s.path for s in splits] == [paths[s.start] for s in splits]
    items = [item for s in splits for item in read(source, s)]
    assert [r.path for _, r in items] == paths and [r.offset for _, r in items] == list(range(500))
    split = splits[1]
    run = read(source, split)
    for k, (position, _) in enumerate(run):
        assert read(source, split, position) == run[k + 1 :]


def test_a_changed_file_list_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "b.txt", b"b")
    source = ReadTextFiles(str(tmp_path / "*.txt"), label="notes")
    (split,) = source.splits()
    fresh = ReadTextFiles(str(tmp_path / "*.txt"), label="notes")
    write(tmp_path / "a.txt", b"a")
    message = f"{OP}: file 0 of {str(tmp_path / '*.txt')!r} is no longer {split.path}; did the files change"
    with pytest.raises(DataError, match=re.escape(message)):
        read(fresh, split)


def test_whole_file_text_is_kept_as_is(tmp_path: Path) -> None:
    text = "line one\r\nline two\n\n  indented \u00e9\n"
    write(tmp_path / "a.txt", text.encode("utf-8"))
    assert documents(ReadTextFiles(str(tmp_path / "*"))) == [text]


def test_gzip_files_are_decompressed(tmp_path: Path) -> None:
    write(tmp_path / "a.txt.gz", gzip.compress("zipped \u00fc".encode()))
    write(tmp_path / "b.txt.gz", gzip.compress(b""))  # a real file whose text is empty: no document
    write(tmp_path / "c.txt", b"plain")
    assert documents(ReadTextFiles(str(tmp_path / "*"))) == ["zipped \u00fc", "plain"]


def test_other_encodings(tmp_path: Path) -> None:
    write(tmp_path / "a.txt", "caf\u00e9".encode("latin-1"))
    assert documents(ReadTextFiles(str(tmp_path / "*"), encoding="latin-1")) == ["caf\u00e9"]


# -- bad files -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a.txt", "a.txt.gz"])
def test_zero_byte_file_is_bad_input_naming_it(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / name, b"")
    source = ReadTextFiles(path, label="notes")
    message = f"{OP}: {path} is empty (0 bytes); an empty file is treated as bad input"
    with pytest.raises(DataError, match=re.escape(message)):
        documents(source)


def test_undecodable_bytes_name_the_file_and_the_byte_offset(tmp_path: Path) -> None:
    path = write(tmp_path / "a.txt", b"good start \xff bad")
    message = f"{OP}: {path} is not valid utf-8 at byte 11: invalid start byte (0xff)"
    with pytest.raises(DataError, match=re.escape(message)):
        documents(ReadTextFiles(path, label="notes"))


def test_undecodable_gzip_text_names_the_decompressed_offset(tmp_path: Path) -> None:
    path = write(tmp_path / "a.txt.gz", gzip.compress(b"abc\xe9"))
    message = f"{OP}: {path} is not valid utf-8 at decompressed byte 3: unexpected end of data (0xe9)"
    with pytest.raises(DataError, match=re.escape(message)):
        documents(ReadTextFiles(path, label="notes"))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"not gzip at all", "Not a gzipped file"),
        (gzip.compress(b"x" * 1000)[:-10], "Compressed file ended before the end-of-stream marker"),
    ],
    # gzip's bytes hold the time it ran: ids by name, the same in every xdist worker
    ids=["not gzip", "truncated gzip"],
)
def test_damaged_gzip_is_named(tmp_path: Path, data: bytes, reason: str) -> None:
    path = write(tmp_path / "a.txt.gz", data)
    with pytest.raises(DataError, match=re.escape(f"{OP}: cannot read {path}: {reason}")):
        documents(ReadTextFiles(path, label="notes"))


def test_vanished_file_is_named(tmp_path: Path) -> None:
    path = write(tmp_path / "a.txt", b"x")
    source = ReadTextFiles(path, label="notes")
    items = read(source, source.splits()[0])
    Path(path).unlink()
    message = f"{OP}: cannot read {path}: No such file or directory"
    with pytest.raises(DataError, match=re.escape(message)):
        source.decode(items[0][1], OP)


def test_a_glob_matching_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="matches no file"):
        ReadTextFiles(str(tmp_path / "*.txt"), label="notes").splits()


# -- construction and pipelines --------------------------------------------------------------
def test_params_and_option_checks() -> None:
    assert ReadTextFiles("d/*.txt", encoding="latin-1", epochs=1, on_error="skip").params() == {
        "pattern": "d/*.txt",
        "epochs": 1,
        "on_error": "skip",
        "encoding": "latin-1",
        "split_plan": 2,
    }
    message = "ReadTextFiles: encoding 'klingon' is not a text encoding Python knows"
    with pytest.raises(SpecError, match=re.escape(message)):
        ReadTextFiles("d/*.txt", encoding="klingon")
    with pytest.raises(SpecError, match=re.escape("ReadTextFiles: epochs must be a positive integer")):
        ReadTextFiles("d/*.txt", epochs=0)


def test_decode_works_on_a_pickled_copy(tmp_path: Path) -> None:
    write(tmp_path / "a.txt", b"one")
    source = ReadTextFiles(str(tmp_path / "*"))
    records = [r for s in source.splits() for _, r in read(source, s)]
    copy = pickle.loads(pickle.dumps(source))
    assert [t for r in records for t in copy.decode(r, OP)] == ["one"]


def test_reads_files_in_a_beam_pipeline(tmp_path: Path) -> None:
    write(tmp_path / "a.txt", b"first")
    write(tmp_path / "b.txt.gz", gzip.compress(b"second"))
    with beam.Pipeline() as p:
        docs = p | "notes" >> ReadTextFiles(str(tmp_path / "*"))
        assert_that(docs, equal_to(["first", "second"]))


def test_checkpoint_at_every_step_across_an_epoch(tmp_path: Path, corpus: Corpus) -> None:
    for i, text in enumerate(corpus.web_texts[:10]):
        if i % 3:
            write(tmp_path / f"{i:02d}.txt", text.encode())
        else:
            write(tmp_path / f"{i:02d}.txt.gz", gzip.compress(text.encode()))

    def build(p: beam.Pipeline) -> beam.PCollection:
        notes = p | "notes" >> ops.ReadTextFiles(str(tmp_path / "*"))
        toks = notes | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        return toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))

    spec = zf.LoaderSpec(build, lanes=2, seed=5, global_batch_size=4)
    ref = assert_equal_output_after_checkpoint(spec, 14, world_size=2, backend="threads", workers=2)
    assert min(source_epochs(spec, ref.final_state)["notes"]) >= 1


def test_one_epoch_on_three_lanes_delivers_every_file_once(tmp_path: Path) -> None:
    for i, text in enumerate(tagged_texts("web", 12, seed=4)):
        write(tmp_path / f"{i:02d}.txt", text.encode())

    def build(p: beam.Pipeline) -> beam.PCollection:
        notes = p | "notes" >> ops.ReadTextFiles(str(tmp_path / "*"), epochs=1)
        return notes | "key" >> beam.ParDo(DocKey())

    batches = run_batches(zf.LoaderSpec(build, lanes=3, seed=2, global_batch_size=3), world_size=1)
    assert sorted(int(d) for b in batches for d in b["doc"]) == list(range(12))
