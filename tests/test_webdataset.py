"""Tests of ReadWebDataset: members grouped by key, splits as runs of samples, resume, damage."""

from __future__ import annotations

import gzip
import io
import pickle
import re
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to
from checkpointing import assert_equal_output_after_checkpoint
from helpers import Corpus, DocKey, run_batches, source_epochs, tagged_texts

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Record, Split
from zephon_flow.operators import webdataset
from zephon_flow.operators.webdataset import ReadWebDataset, TarSample, member_key

OP = "ReadWebDataset('pics')"


def write_tar(path: Path, members: Sequence[tuple[str, bytes | None]]) -> str:
    """A tar of ``(name, data)`` members in order; ``None`` data makes a directory."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def sample_members(
    n: int, *, prefix: str = "", exts: Sequence[str] = ("jpg", "txt")
) -> list[tuple[str, bytes]]:
    members = []
    for i in range(n):
        for ext in exts:
            data = f"caption {i}".encode() if ext == "txt" else bytes([i % 256]) * (100 + i)
            members.append((f"{prefix}{i:06d}.{ext}", data))
    return members


def read(source: ReadWebDataset, split: Split, position: int = START) -> list[tuple[int, Record]]:
    return list(source.read_split(split, position))


def read_all(source: ReadWebDataset) -> list[tuple[int, Record]]:
    return [item for split in source.splits() for item in read(source, split)]


def elements(source: ReadWebDataset) -> list[dict[str, Any]]:
    return [e for _, r in read_all(source) for e in source.decode(r, OP)]


def header_offsets(path: str) -> dict[str, int]:
    with tarfile.open(path) as tar:
        return {m.name: m.offset for m in tar.getmembers()}


# -- names and grouping ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("000017.jpg", ("000017", "jpg")),
        ("a/b/000017.seg.PNG", ("a/b/000017", "seg.PNG")),  # the case as written, as webdataset keeps it
        ("a.b/c.txt", ("a.b/c", "txt")),
        ("README", None),
        ("dir/.hidden", None),
        ("x.", None),
    ],
)
def test_member_key_follows_the_webdataset_convention(name: str, expected: tuple[str, str] | None) -> None:
    assert member_key(name) == expected


def test_samples_are_runs_of_members_sharing_a_key(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(10, exts=("jpg", "json", "txt")))
    source = ReadWebDataset(path, samples_per_split=3)
    assert source.splits() == [Split(path, 0, 3), Split(path, 3, 6), Split(path, 6, 9), Split(path, 9, 10)]
    items = read(source, source.splits()[1])
    assert [(pos, r.where, r.offset) for pos, r in items] == [
        (4, "sample 3 (key '000003')", 3),
        (5, "sample 4 (key '000004')", 4),
        (6, "sample 5 (key '000005')", 5),
    ]
    assert items[0][1].payload == TarSample(
        "000003",
        (
            ("000003.jpg", "jpg", bytes([3]) * 103),
            ("000003.json", "json", None),
            ("000003.txt", "txt", b"caption 3"),
        ),
    )
    assert items[0][1].payload.nbytes == 103 + len(b"caption 3")  # the unread json weighs nothing
    got = elements(source)
    assert [e["__key__"] for e in got] == [f"{i:06d}" for i in range(10)]
    assert got[7] == {"__key__": "000007", "jpg": bytes([7]) * 107, "txt": "caption 7"}


def test_split_offsets_point_at_each_splits_first_header(tmp_path: Path) -> None:
    long = "x" * 120 + "/"  # long names need a pax header before the member's own header
    path = write_tar(tmp_path / "s.tar", sample_members(7, prefix=long))
    source = ReadWebDataset(path, samples_per_split=2)
    source.splits()
    headers = header_offsets(path)
    assert source._offsets == {path: {i: headers[f"{long}{i:06d}.jpg"] for i in (0, 2, 4, 6)}}
    assert [e["__key__"] for e in elements(source)] == [f"{long}{i:06d}" for i in range(7)]


def test_a_shards_sample_offsets_are_listed_once_and_relisted_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tar(tmp_path / "s.tar", sample_members(9))
    walks: list[str] = []
    walk = ReadWebDataset._walk

    def counted(self: ReadWebDataset, shard: str) -> list[int]:
        walks.append(shard)
        return walk(self, shard)

    monkeypatch.setattr(ReadWebDataset, "_walk", counted)
    first = ReadWebDataset(path, samples_per_split=2)
    want = [e["__key__"] for e in elements(first)]
    assert walks == [path] and want == [f"{i:06d}" for i in range(9)]
    second = ReadWebDataset(path, samples_per_split=3)  # another process, another plan
    assert [e["__key__"] for e in elements(second)] == want and walks == [path]
    # a damaged entry is listed again and rewritten
    (entry,) = (tmp_path / "cache").glob("tar-samples-*.json")
    entry.write_text("[1, 2", encoding="utf-8")
    assert [e["__key__"] for e in elements(ReadWebDataset(path, samples_per_split=2))] == want
    assert walks == [path, path] and entry.read_text(encoding="utf-8").startswith("[0, ")
    # the shard rewritten with other samples: another key, listed afresh
    write_tar(tmp_path / "s.tar", sample_members(5, prefix="b"))
    assert [e["__key__"] for e in elements(ReadWebDataset(path))] == [f"b{i:06d}" for i in range(5)]
    assert walks == [path, path, path]


@pytest.mark.parametrize("lanes", [1, 2, 8])
def test_automatic_runs_are_sized_from_samples_and_lanes(
    tmp_path: Path, lanes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(webdataset, "MIN_SPLIT_SAMPLES", 1)
    write_tar(tmp_path / "a.tar", sample_members(90))
    write_tar(tmp_path / "b.tar", sample_members(7, prefix="b"))
    source = ReadWebDataset(str(tmp_path / "*.tar"))
    splits = source.splits(lanes)
    per = -(-97 // (8 * lanes))
    assert max(s.cost for s in splits) <= 1.25 * per and len(splits) >= min(97, 8 * lanes) * 0.7
    keys = [e["__key__"] for s in splits for _, r in read(source, s) for e in source.decode(r, OP)]
    assert keys == [f"{i:06d}" for i in range(90)] + [f"b{i:06d}" for i in range(7)]


def test_listing_skips_an_empty_shard_under_skip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = write_tar(tmp_path / "a.tar", sample_members(3))
    empty = tmp_path / "b.tar"
    empty.write_bytes(b"")
    source = ReadWebDataset(str(tmp_path / "*.tar"), label="pics", on_error="skip")
    assert {s.path for s in source.splits()} == {good}
    assert source.skipped_files == [str(empty)]
    assert f"leaving out {empty} (on_error='skip'): {OP}: {empty} is empty (0 bytes)" in caplog.text


def test_resume_at_every_position_of_every_split(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(11))
    source = ReadWebDataset(path, samples_per_split=4)
    for split in source.splits():
        items = read(source, split)
        assert read(source, split, split.start) == items
        for k, (position, _) in enumerate(items):
            assert read(source, split, position) == items[k + 1 :]


def test_a_position_outside_the_split_is_refused(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(6))
    source = ReadWebDataset(path, samples_per_split=3, label="pics")
    message = f"{OP}: cannot resume samples [3, 6) of {path} at sample 7; did the shard change"
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, source.splits()[1], 7)


def test_directories_links_and_names_without_extension_are_ignored(tmp_path: Path) -> None:
    members: list[tuple[str, bytes | None]] = [
        ("d", None),
        ("README", b"hi"),
        *sample_members(2, prefix="d/"),
    ]
    path = write_tar(tmp_path / "s.tar", members)
    with tarfile.open(path, "a") as tar:
        link = tarfile.TarInfo("d/000009.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, "d/000000.jpg"
        tar.addfile(link)
    assert [e["__key__"] for e in elements(ReadWebDataset(path))] == ["d/000000", "d/000001"]


def test_a_key_that_comes_back_later_is_a_new_sample(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", [("a.jpg", b"1"), ("a.txt", b"x"), ("b.txt", b"y"), ("a.jpg", b"2")])
    samples = [r.payload for _, r in read_all(ReadWebDataset(path))]
    assert [(s.key, [m[0] for m in s.members]) for s in samples] == [
        ("a", ["a.jpg", "a.txt"]),
        ("b", ["b.txt"]),
        ("a", ["a.jpg"]),
    ]


def test_alternative_extensions_take_the_first_listed_that_is_present(tmp_path: Path) -> None:
    members = [("a.png", b"p"), ("a.txt", b"x"), ("b.jpg", b"j"), ("b.png", b"q"), ("b.txt", b"y")]
    path = write_tar(tmp_path / "s.tar", members)
    got = elements(ReadWebDataset(path, fields=("JPG;png", "txt")))
    assert got == [{"__key__": "a", "png": b"p", "txt": "x"}, {"__key__": "b", "jpg": b"j", "txt": "y"}]


def test_fields_match_any_case_and_the_element_keeps_the_extension_as_written(tmp_path: Path) -> None:
    from PIL import Image

    from zephon_flow.operators.image_decode import DecodeImage

    jpeg = io.BytesIO()
    Image.new("RGB", (4, 2), (200, 10, 10)).save(jpeg, format="JPEG")
    members = [("a.JPG", jpeg.getvalue()), ("a.TXT", b"x"), ("b.jpg", jpeg.getvalue()), ("b.txt", b"y")]
    path = write_tar(tmp_path / "s.tar", members)
    got = elements(ReadWebDataset(path, fields=("jpg", "txt")))
    assert got == [
        {"__key__": "a", "JPG": jpeg.getvalue(), "TXT": "x"},  # TXT still decoded: a text field
        {"__key__": "b", "jpg": jpeg.getvalue(), "txt": "y"},
    ]
    decoded = [next(iter(DecodeImage().process(e))) for e in got]  # its default fields find "JPG"
    assert [sorted(d) for d in decoded] == [["TXT", "__key__", "image"], ["__key__", "image", "txt"]]
    assert decoded[0]["image"].tobytes() == decoded[1]["image"].tobytes()
    assert decoded[0]["image"].shape == (2, 4, 3)
    with pytest.raises(DataError) as err:
        next(iter(DecodeImage().process({"__key__": "c", "Jpg": b"", "JPG": b""})))
    assert (
        str(err.value)
        == "DecodeImage: sample 'c' has fields ['JPG', 'Jpg'], which differ only in case; which is 'jpg'?"
    )


def test_two_members_that_differ_only_in_case_are_refused_by_name(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", [("a.jpg", b"1"), ("a.JPG", b"2"), ("a.txt", b"x")])
    with pytest.raises(DataError) as err:
        elements(ReadWebDataset(path))
    assert str(err.value) == (
        f"{OP}: {path} at sample 0 (key 'a') has 2 'jpg' members ('a.jpg', 'a.JPG'); a field matches "
        "extensions whatever their case"
    )


def test_several_shards_and_a_shard_without_samples(tmp_path: Path) -> None:
    a = write_tar(tmp_path / "a.tar", sample_members(3))
    write_tar(tmp_path / "b.tar", [("only-a-dir", None)])
    c = write_tar(tmp_path / "c.tar", sample_members(2, prefix="c"))
    source = ReadWebDataset(str(tmp_path / "*.tar"), samples_per_split=2)
    assert source.splits() == [Split(a, 0, 2), Split(a, 2, 3), Split(c, 0, 2)]


def test_a_tar_without_end_of_archive_blocks_is_read_whole(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(3))
    headers = header_offsets(path)
    end = headers["000002.txt"] + 1024  # header and one block of data
    Path(path).write_bytes(Path(path).read_bytes()[:end])
    assert [e["txt"] for e in elements(ReadWebDataset(path))] == ["caption 0", "caption 1", "caption 2"]


# -- damage ------------------------------------------------------------------------------------
def cut(path: str, at: int) -> None:
    Path(path).write_bytes(Path(path).read_bytes()[:at])


def test_data_cut_short_is_raised_when_reached_naming_the_member(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(8))
    headers = header_offsets(path)
    cut(path, headers["000004.jpg"] + 512 + 50)
    source = ReadWebDataset(path, samples_per_split=3, label="pics")
    # Listing finds the damage; the split that ends at it holds the samples before it.
    assert source.splits() == [Split(path, 0, 3), Split(path, 3, 5)]
    assert len(read(source, source.splits()[0])) == 3
    records = source.read_split(source.splits()[1], START)
    assert next(records)[1].where == "sample 3 (key '000003')"
    message = (
        f"{OP}: {path} is truncated: member '000004.jpg' (sample 4) has 104 bytes from byte "
        f"{headers['000004.jpg'] + 512}, but the file ends at byte {headers['000004.jpg'] + 562}"
    )
    with pytest.raises(DataError, match=re.escape(message)) as raised:
        next(records)
    assert type(raised.value) is DataError  # the public class, not an internal subclass


def test_a_header_cut_short_names_the_member_before_it(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(4))
    headers = header_offsets(path)
    cut(path, headers["000003.jpg"] + 100)
    source = ReadWebDataset(path, samples_per_split=3, label="pics")
    assert source.splits() == [Split(path, 0, 3)]
    message = (
        f"{OP}: {path} is truncated after member '000002.txt': "
        f"the file ends inside the header at byte {headers['000003.jpg']}"
    )
    # Sample 2 may have had more members after the cut: it is not delivered either.
    records = source.read_split(source.splits()[0], START)
    assert [next(records)[1].offset for _ in range(2)] == [0, 1]
    with pytest.raises(DataError, match=re.escape(message)):
        next(records)


def test_a_damaged_header_is_not_taken_for_the_end(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(5))
    headers = header_offsets(path)
    data = bytearray(Path(path).read_bytes())
    at = headers["000003.txt"]
    data[at : at + 8] = b"garbage!"  # breaks the header checksum
    Path(path).write_bytes(bytes(data))
    source = ReadWebDataset(path, samples_per_split=2, label="pics")
    assert source.splits() == [Split(path, 0, 2), Split(path, 2, 4)]
    message = f"{OP}: {path} is damaged after member '000003.jpg': bad tar header at byte {at}"
    with pytest.raises(DataError, match=re.escape(message)) as raised:
        read(source, source.splits()[1])
    assert type(raised.value) is DataError


def test_a_truncated_pax_header_is_named(tmp_path: Path) -> None:
    long = "y" * 150
    path = write_tar(tmp_path / "s.tar", [*sample_members(1), (f"{long}.jpg", b"j"), (f"{long}.txt", b"t")])
    headers = header_offsets(path)
    cut(path, headers[f"{long}.jpg"] + 512 + 100)  # inside the pax header's records
    source = ReadWebDataset(path, label="pics")
    message = (
        f"{OP}: {path} is truncated after member '000000.txt': "
        f"the file ends inside the member whose header is at byte {headers[f'{long}.jpg']}"
    )
    with pytest.raises(DataError, match=re.escape(message)):
        read_all(source)


def test_zero_byte_shard_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.tar"
    path.write_bytes(b"")
    message = f"{OP}: {path} is empty (0 bytes), not a tar shard"
    with pytest.raises(DataError, match=re.escape(message)):
        ReadWebDataset(str(path), label="pics").splits()


def test_a_compressed_shard_is_refused_with_a_hint(tmp_path: Path) -> None:
    plain = Path(write_tar(tmp_path / "s.tar", sample_members(2)))
    path = tmp_path / "s.tar.gz"
    path.write_bytes(gzip.compress(plain.read_bytes()))
    message = f"{OP}: {path} is not an uncompressed tar file (it looks gzip-compressed; decompress the shard)"
    with pytest.raises(DataError, match=re.escape(message)):
        ReadWebDataset(str(path), label="pics").splits()


def test_a_file_that_is_not_a_tar_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.tar"
    path.write_bytes(b"hello world, this is not a tar archive" * 20)
    with pytest.raises(DataError, match=re.escape(f"{OP}: {path} is not an uncompressed tar file: ")):
        ReadWebDataset(str(path), label="pics").splits()


def test_vanished_shard_is_named(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(2))
    source = ReadWebDataset(path, label="pics")
    split = source.splits()[0]
    Path(path).unlink()
    with pytest.raises(DataError, match=re.escape(f"{OP}: cannot read {path}: No such file or directory")):
        read(source, split)


def test_a_shard_that_shrank_since_listing_is_refused(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(4))
    source = ReadWebDataset(path, samples_per_split=4, label="pics")
    split = source.splits()[0]
    write_tar(tmp_path / "s.tar", sample_members(2))
    message = f"{OP}: {path} ends before sample 3; did the shard change since the splits were listed?"
    with pytest.raises(DataError, match=re.escape(message)):
        read(source, split)


# -- bad samples (decode) ------------------------------------------------------------------------
def record(*members: tuple[str, str, bytes | None], key: str = "k/01") -> Record:
    return Record(TarSample(key, members), "/d/s.tar", f"sample 1 (key {key!r})", 1)


@pytest.mark.parametrize(
    ("members", "message"),
    [
        (
            (("k/01.jpg", "jpg", b"j"), ("k/01.json", "json", None)),
            "/d/s.tar at sample 1 (key 'k/01') has no 'txt' member (it has 'jpg', 'json'); "
            "every sample needs 'jpg;png', 'txt'",
        ),
        (
            (("k/01.txt", "txt", b"t"),),
            "/d/s.tar at sample 1 (key 'k/01') has no 'jpg' or 'png' member (it has 'txt')",
        ),
        (
            (("k/01.png", "png", b"p"), ("k/01.txt", "txt", b"a"), ("k/01.TXT", "txt", b"b")),
            "/d/s.tar at sample 1 (key 'k/01') has 2 'txt' members ('k/01.txt', 'k/01.TXT')",
        ),
        (
            (("k/01.jpg", "jpg", b"j"), ("k/01.txt", "txt", b"ok \xc3(")),
            "/d/s.tar at sample 1 (key 'k/01'): member 'k/01.txt' is not valid UTF-8 at byte 3: "
            "invalid continuation byte (0xc3)",
        ),
    ],
)
def test_bad_samples_name_the_shard_the_key_and_the_member(
    members: tuple[tuple[str, str, bytes | None], ...], message: str
) -> None:
    source = ReadWebDataset("unused", fields=["jpg;png", "txt"])
    with pytest.raises(DataError, match=re.escape(f"{OP}: {message}")):
        source.decode(record(*members), OP)


def test_a_sample_without_its_pair_in_a_real_shard(tmp_path: Path) -> None:
    members = [m for m in sample_members(3) if m[0] != "000001.txt"]
    path = write_tar(tmp_path / "s.tar", members)
    source = ReadWebDataset(path, label="pics")
    records = [r for _, r in read_all(source)]
    assert source.decode(records[0], OP)[0]["txt"] == "caption 0"
    message = f"{OP}: {path} at sample 1 (key '000001') has no 'txt' member (it has 'jpg')"
    with pytest.raises(DataError, match=re.escape(message)):
        source.decode(records[1], OP)


# -- construction and pipelines --------------------------------------------------------------
def test_params() -> None:
    source = ReadWebDataset(
        "d/*.tar", fields=["JPG;png", "json"], text_fields=["json"], samples_per_split=8, on_error="skip"
    )
    assert source.params() == {
        "pattern": "d/*.tar",
        "epochs": None,
        "on_error": "skip",
        "fields": ["jpg;png", "json"],
        "text_fields": ["json"],
        "samples_per_split": 8,
        "split_plan": 2,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fields": "jpg"}, "fields must be a non-empty sequence of extensions, got 'jpg'"),
        ({"fields": []}, "fields must be a non-empty sequence of extensions, got []"),
        ({"fields": ["jpg;"]}, "'' in fields ['jpg;'] is not an extension like 'jpg'"),
        ({"fields": [".jpg"]}, "'.jpg' in fields ['.jpg'] is not an extension like 'jpg'"),
        ({"fields": ["__key__"]}, "'__key__' in fields ['__key__'] is not an extension"),
        ({"fields": ["jpg", "png;JPG"]}, "the extension 'jpg' appears twice in fields ['jpg', 'png;JPG']"),
        ({"text_fields": "txt"}, "text_fields must be a sequence of extensions, got 'txt'"),
        ({"text_fields": ["json"]}, "text_fields names 'json', which is not among fields ('jpg', 'txt')"),
        ({"samples_per_split": 0}, "samples_per_split must be a positive integer or None, got 0"),
        ({"samples_per_split": True}, "samples_per_split must be a positive integer or None, got True"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(f"ReadWebDataset: {message}")):
        ReadWebDataset("d/*.tar", **kwargs)


def test_decode_works_on_a_pickled_copy(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(3))
    source = ReadWebDataset(path)
    records = [r for _, r in read_all(source)]
    copy = pickle.loads(pickle.dumps(source))
    assert [e["txt"] for r in records for e in copy.decode(r, OP)] == [f"caption {i}" for i in range(3)]


def test_reads_shards_in_a_beam_pipeline(tmp_path: Path) -> None:
    write_tar(tmp_path / "a.tar", sample_members(3))
    write_tar(tmp_path / "b.tar", sample_members(2, prefix="b"))
    with beam.Pipeline() as p:
        samples = p | "pics" >> ReadWebDataset(str(tmp_path / "*.tar"), samples_per_split=2)
        keys = samples | beam.Map(lambda e: (e["__key__"], e["txt"]))
        expected = [(f"{i:06d}", f"caption {i}") for i in range(3)] + [
            (f"b{i:06d}", f"caption {i}") for i in range(2)
        ]
        assert_that(keys, equal_to(expected))


class Caption(beam.DoFn):  # type: ignore[misc]
    """A sample's caption, for the tokenizer."""

    def process(self, sample: dict[str, Any]) -> Iterator[str]:
        yield sample["txt"]


def test_checkpoint_at_every_step_across_an_epoch(tmp_path: Path, corpus: Corpus) -> None:
    texts = corpus.web_texts[:10]
    for shard in range(2):
        members = [
            (f"{i:04d}.{ext}", b"img" if ext == "jpg" else texts[i].encode())
            for i in range(shard * 5, shard * 5 + 5)
            for ext in ("jpg", "txt")
        ]
        write_tar(tmp_path / f"{shard}.tar", members)

    def build(p: beam.Pipeline) -> beam.PCollection:
        pics = p | "pics" >> ops.ReadWebDataset(str(tmp_path / "*.tar"), samples_per_split=2)
        caps = pics | "caption" >> beam.ParDo(Caption())
        toks = caps | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        return toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))

    spec = zf.LoaderSpec(build, lanes=2, seed=5, global_batch_size=4)
    ref = assert_equal_output_after_checkpoint(spec, 14)
    assert min(source_epochs(spec, ref.final_state)["pics"]) >= 1


def test_one_epoch_on_three_lanes_delivers_every_sample_once(tmp_path: Path) -> None:
    captions = tagged_texts("web", 12, seed=4)
    for shard in range(2):
        members = [
            (f"{i:04d}.{ext}", captions[i].encode())
            for i in range(shard * 6, shard * 6 + 6)
            for ext in ("jpg", "txt")
        ]
        write_tar(tmp_path / f"{shard}.tar", members)

    def build(p: beam.Pipeline) -> beam.PCollection:
        pics = p | "pics" >> ops.ReadWebDataset(str(tmp_path / "*.tar"), samples_per_split=2, epochs=1)
        caps = pics | "caption" >> beam.ParDo(Caption())
        return caps | "key" >> beam.ParDo(DocKey())

    batches = run_batches(zf.LoaderSpec(build, lanes=3, seed=2, global_batch_size=3), world_size=1)
    assert sorted(int(d) for b in batches for d in b["doc"]) == list(range(12))


def test_a_split_of_another_plan_is_read_from_the_shard_headers(tmp_path: Path) -> None:
    path = write_tar(tmp_path / "s.tar", sample_members(30))
    fine = ReadWebDataset(path, samples_per_split=3).splits()
    other = ReadWebDataset(path, samples_per_split=7)
    other.splits()  # another plan listed: its starts are 0, 7, 14, ...
    keys = [e["__key__"] for s in fine for _, r in read(other, s) for e in other.decode(r, OP)]
    assert keys == [f"{i:06d}" for i in range(30)]
