"""Tests of the file layer: local paths (plain and file://) and a Beam filesystem, read by every source."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import zstandard
from apache_beam.io.filesystem import FileMetadata, FileSystem

from zephon_flow.core import files
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Source
from zephon_flow.operators import (
    ReadArrow,
    ReadJsonl,
    ReadParquet,
    ReadTextFiles,
    ReadWebDataset,
    seek_index,
)

OP = "ReadJsonl('web')"

#: The bytes of every file of the in-memory filesystem, by full path.
MEMORY: dict[str, bytes] = {}


class MemoryFileSystem(FileSystem):  # type: ignore[misc]
    """A Beam filesystem under ``zfmem://`` keeping files in ``MEMORY``: what ``gs://`` or
    ``s3://`` look like to the file layer, offline."""

    @classmethod
    def scheme(cls) -> str:
        return "zfmem"

    def join(self, basepath: str, *paths: str) -> str:
        return "/".join([basepath.rstrip("/"), *paths])

    def split(self, path: str) -> tuple[str, str]:
        head, _, tail = path.rpartition("/")
        return head, tail

    def has_dirs(self) -> bool:
        return False

    def _list(self, dir_or_prefix: str) -> Iterator[FileMetadata]:
        for path, data in sorted(MEMORY.items()):
            if path.startswith(dir_or_prefix):
                yield FileMetadata(path, len(data), 1_700_000_000.0)

    def open(self, path: str, mime_type: str = "", compression_type: str = "") -> io.BytesIO:
        assert compression_type == "uncompressed", compression_type
        if path not in MEMORY:
            raise FileNotFoundError(path)
        return io.BytesIO(MEMORY[path])

    def exists(self, path: str) -> bool:
        return path in MEMORY

    def size(self, path: str) -> int:
        return len(MEMORY[path])

    def last_updated(self, path: str) -> float:
        return 1_700_000_000.0

    def metadata(self, path: str) -> FileMetadata:
        return FileMetadata(path, len(MEMORY[path]), 1_700_000_000.0)

    def mkdirs(self, path: str) -> None:
        raise NotImplementedError

    def create(self, path: str, mime_type: str = "", compression_type: str = "") -> Any:
        raise NotImplementedError

    def copy(self, source_file_names: Any, destination_file_names: Any) -> None:
        raise NotImplementedError

    def rename(self, source_file_names: Any, destination_file_names: Any) -> None:
        raise NotImplementedError

    def delete(self, paths: Any) -> None:
        raise NotImplementedError


@pytest.fixture(autouse=True)
def memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, bytes]]:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(seek_index, "GZIP_SPACING", 64 * 1024)
    MEMORY.clear()
    yield MEMORY
    MEMORY.clear()


def texts(n: int, seed: int = 0) -> list[str]:
    r = random.Random(seed)
    words = ["".join(r.choice("abcdefghij") for _ in range(r.randint(2, 8))) for _ in range(500)]
    return [f"{i} " + " ".join(r.choice(words) for _ in range(12)) for i in range(n)]


def jsonl(docs: list[str]) -> bytes:
    return b"".join(json.dumps({"text": t}).encode() + b"\n" for t in docs)


def documents(source: Source, lanes: int = 1) -> list[Any]:
    op = source.operator_name
    return [
        x for s in source.splits(lanes) for _, r in source.read_split(s, START) for x in source.decode(r, op)
    ]


# -- the layer itself --------------------------------------------------------------------------
def test_local_paths_plain_and_file_uri_take_the_fast_path(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        (tmp_path / "d" / name).write_bytes(b"x" * len(name))
    plain = files.expand_glob(str(tmp_path / "d" / "*.jsonl"), operator=OP)
    uri = files.expand_glob(f"file://{tmp_path}/d/*.jsonl", operator=OP)
    assert plain == uri == [str(tmp_path / "d" / "a.jsonl"), str(tmp_path / "d" / "b.jsonl")]
    assert files.relative_name(plain[1], str(tmp_path / "d" / "*.jsonl")) == "b.jsonl"
    info = files.stat(f"file://{plain[0]}", operator=OP)
    assert info.size == 7 and info.mtime_ns == os.stat(plain[0]).st_mtime_ns
    with files.open_binary(plain[0], operator=OP) as fh:
        assert isinstance(fh, io.BufferedReader) and fh.read() == b"xxxxxxx"


def test_a_beam_filesystem_lists_sizes_and_opens(memory: dict[str, bytes]) -> None:
    memory["zfmem://bkt/d/b.jsonl"] = b"bb"
    memory["zfmem://bkt/d/a.jsonl"] = b"a"
    memory["zfmem://bkt/d/sub/c.jsonl"] = b"ccc"
    memory["zfmem://bkt/e/x.jsonl"] = b"x"
    found = files.expand_glob("zfmem://bkt/d/*.jsonl", operator=OP)
    assert found == ["zfmem://bkt/d/a.jsonl", "zfmem://bkt/d/b.jsonl"]
    assert files.relative_name("zfmem://bkt/d/sub/c.jsonl", "zfmem://bkt/d/**") == "sub/c.jsonl"
    assert files.size("zfmem://bkt/d/sub/c.jsonl", operator=OP) == 3
    assert files.read_bytes("zfmem://bkt/d/b.jsonl", 1, 5, operator=OP) == b"b"


def test_layer_errors_name_the_operator_and_the_path() -> None:
    with pytest.raises(SpecError, match=re.escape(f"{OP}: the glob 'zfmem://bkt/none/*' matches no file")):
        files.expand_glob("zfmem://bkt/none/*", operator=OP)
    message = f"{OP}: cannot list 'nosuch://bkt/*': "
    with pytest.raises(DataError, match=re.escape(message)) as info:
        files.expand_glob("nosuch://bkt/*", operator=OP)
    assert "is the Beam extra for its scheme installed (apache-beam[gcp], [aws], [hadoop])?" in str(
        info.value
    )
    with pytest.raises(DataError, match=re.escape(f"{OP}: cannot read zfmem://bkt/gone: ")):
        files.open_binary("zfmem://bkt/gone", operator=OP)


def test_list_each_skips_or_raises(caplog: pytest.LogCaptureFixture) -> None:
    def one(path: str) -> list[str]:
        if path == "bad":
            raise DataError(f"{OP}: bad is damaged")
        return [path]

    skipped: list[str] = []
    got = files.list_each(["a", "bad", "b"], one, on_error="skip", operator=OP, skipped=skipped)
    assert got == ["a", "b"] and skipped == ["bad"]
    assert f"{OP}: leaving out bad (on_error='skip'): {OP}: bad is damaged" in caplog.text
    with pytest.raises(DataError, match=re.escape(f"{OP}: bad is damaged")):
        files.list_each(["a", "bad"], one, on_error="raise", operator=OP, skipped=[])


# -- every source through a Beam filesystem -----------------------------------------------------
def test_jsonl_plain_gzip_and_zstd_frames_from_a_beam_filesystem(memory: dict[str, bytes]) -> None:
    docs = texts(6000)
    memory["zfmem://b/c/0.jsonl"] = jsonl(docs[:1000])
    memory["zfmem://b/c/1.jsonl.gz"] = gzip.compress(jsonl(docs[1000:5000]), compresslevel=1)
    cctx = zstandard.ZstdCompressor()
    part = jsonl(docs[5000:])
    memory["zfmem://b/c/2.jsonl.zst"] = b"".join(
        cctx.compress(part[i : i + 20_000]) for i in range(0, len(part), 20_000)
    )
    source = ReadJsonl("zfmem://b/c/*", split_bytes=40_000, label="web")
    splits = source.splits()
    assert {s.path for s in splits} == set(memory)
    assert all(sum(s.path == p for s in splits) >= 2 for p in memory), splits
    assert documents(source) == docs
    split = next(s for s in splits if s.path.endswith(".gz") and s.start > 0)
    items = list(source.read_split(split, START))
    assert list(source.read_split(split, items[3][0])) == items[4:]


def test_parquet_arrow_tar_and_text_files_from_a_beam_filesystem(memory: dict[str, bytes]) -> None:
    docs = texts(40)
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), sink, row_group_size=7)
    memory["zfmem://b/p/a.parquet"] = sink.getvalue()
    assert documents(ReadParquet("zfmem://b/p/*.parquet")) == docs

    sink = io.BytesIO()
    batch = pa.record_batch({"text": docs})
    with ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    memory["zfmem://b/a/a.arrow"] = sink.getvalue()
    assert documents(ReadArrow("zfmem://b/a/*.arrow")) == docs

    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w") as tar:
        for i, t in enumerate(docs[:5]):
            info = tarfile.TarInfo(f"{i:04d}.txt")
            info.size = len(t.encode())
            tar.addfile(info, io.BytesIO(t.encode()))
    memory["zfmem://b/w/s.tar"] = sink.getvalue()
    got = documents(ReadWebDataset("zfmem://b/w/*.tar", fields=["txt"]))
    assert [e["txt"] for e in got] == docs[:5]

    for i, t in enumerate(docs[:3]):
        memory[f"zfmem://b/t/{i}.txt"] = t.encode()
    assert documents(ReadTextFiles("zfmem://b/t/*.txt")) == docs[:3]
