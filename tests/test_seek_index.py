"""Tests of seek indexes: gzip and zstd splits read every line once, resume exactly, are cached."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import random
import re
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_flow.core.errors import DataError
from zephon_flow.core.source import START, Split
from zephon_flow.operators import jsonl as jsonl_module
from zephon_flow.operators import seek_index
from zephon_flow.operators.jsonl import ReadJsonl

OP = "ReadJsonl('web')"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(d))
    monkeypatch.setattr(seek_index, "GZIP_SPACING", 64 * 1024)
    return d


def docs(n: int) -> list[str]:
    """Documents of seeded random words: compressible like text, not like a repeated phrase
    (whose deflate blocks span so much output that gzip has few seek points)."""
    r = random.Random(n)
    words = [
        "".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(2, 9))) for _ in range(2000)
    ]
    return [f"{i:06d} " + " ".join(r.choice(words) for _ in range(15)) for i in range(n)]


def jsonl(texts: list[str]) -> bytes:
    return b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts)


def zstd_frames(data: bytes, frame: int, content_size: bool = True) -> bytes:
    cctx = zstandard.ZstdCompressor(write_content_size=content_size)
    return b"".join(cctx.compress(data[i : i + frame]) for i in range(0, len(data), frame))


def texts_of(source: ReadJsonl, splits: list[Split]) -> list[str]:
    return [t for s in splits for _, r in source.read_split(s, START) for t in source.decode(r, OP)]


LAYOUTS = {
    "gzip": lambda d: gzip.compress(d, compresslevel=1),
    "zstd frames": lambda d: zstd_frames(d, 50_000),
    "zstd frames, no content size": lambda d: zstd_frames(d, 50_000, content_size=False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_line_once_in_order_and_exact_resume(tmp_path: Path, layout: str) -> None:
    texts = docs(6000)
    data = jsonl(texts)
    suffix = ".gz" if "gzip" in layout else ".zst"
    path = tmp_path / f"a.jsonl{suffix}"
    path.write_bytes(LAYOUTS[layout](data))
    source = ReadJsonl(str(path), split_bytes=60_000, label="web")
    splits = source.splits()
    assert len(splits) >= 5, splits
    assert splits[0].start == 0 and splits[-1].stop == len(data)
    assert all(a.stop == b.start for a, b in itertools.pairwise(splits))
    assert texts_of(source, splits) == texts
    # Resume mid-split at several points: the continuation is the same.
    split = splits[2]
    items = list(source.read_split(split, START))
    for k in (0, len(items) // 3, len(items) - 1):
        assert list(source.read_split(split, items[k][0])) == items[k + 1 :]


def test_single_frame_zstd_is_one_split_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = jsonl(docs(500))
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    source = ReadJsonl(str(path), split_bytes=1000, label="web")
    assert source.splits() == [Split(str(path), 0, 0, len(data))]
    assert (
        f"{path} is read whole (single-frame zstd: no seek points); lanes share it by stride" in caplog.text
    )
    assert texts_of(source, source.splits()) == docs(500)


def test_index_is_cached_and_rebuilt_when_the_file_changes(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl(docs(3000))))
    before = seek_index.BUILDS
    first = ReadJsonl(str(path), split_bytes=50_000).splits()
    assert before + 1 == seek_index.BUILDS
    # A new source (another run or process) reuses the cached index: no decompression pass.
    again = ReadJsonl(str(path), split_bytes=50_000).splits()
    assert again == first and before + 1 == seek_index.BUILDS
    assert any(name.endswith(".gzidx") for name in os.listdir(cache))
    assert not any(name.startswith(".tmp-") for name in os.listdir(cache))
    # Rewritten (new content, size and mtime): rebuilt.
    path.write_bytes(gzip.compress(jsonl(docs(4000))))
    source = ReadJsonl(str(path), split_bytes=50_000)
    assert texts_of(source, source.splits()) == docs(4000)
    assert before + 2 == seek_index.BUILDS


def test_truncated_gzip_names_the_decompressed_byte_and_line(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl(docs(2000)))[:-5000])
    source = ReadJsonl(str(path), label="web")
    (split,) = source.splits()  # cannot be indexed: read whole, the damage raised where reached
    got = []
    with pytest.raises(DataError) as info:
        for _, r in source.read_split(split, START):
            got.append(r)
    message = str(info.value)
    m = re.search(
        r"at decompressed byte (\d+) \(after line (\d+) of the split from decompressed byte 0\)", message
    )
    assert m, message
    assert int(m.group(2)) == len(got) and got[-1].offset < int(m.group(1))
    assert message.startswith(f"{OP}: cannot read {path}: Compressed file ended before")
    assert message.endswith("the file is truncated or damaged there")


def test_concatenated_gzip_members_are_read_whole(tmp_path: Path) -> None:
    data = jsonl(docs(3000))
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(b"".join(gzip.compress(data[i : i + 70_000]) for i in range(0, len(data), 70_000)))
    source = ReadJsonl(str(path), split_bytes=60_000)
    assert source.splits() == [Split(str(path), 0, 0, path.stat().st_size)]
    assert texts_of(source, source.splits()) == docs(3000)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(st.integers(0, 300), min_size=1, max_size=60),
    frame=st.integers(1, 2000),
    split_bytes=st.integers(1, 3000),
)
def test_zstd_frames_any_layout_every_line_once(
    tmp_path: Path, lines: list[int], frame: int, split_bytes: int
) -> None:
    texts = [f"{i}:" + "x" * n for i, n in enumerate(lines)]
    data = jsonl(texts)
    path = tmp_path / "h.jsonl.zst"
    path.write_bytes(zstd_frames(data, frame))
    source = ReadJsonl(str(path), split_bytes=split_bytes, label="web")
    splits = source.splits()
    assert texts_of(source, splits) == texts
    for split in splits:
        items = list(source.read_split(split, START))
        if items:
            k = len(items) // 2
            assert list(source.read_split(split, items[k][0])) == items[k + 1 :]


def test_a_small_unsplittable_file_is_not_worth_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(jsonl(docs(20))))
    source = ReadJsonl(str(path), label="web")  # the automatic plan: at least 256 KiB a split
    assert len(source.splits(4)) == 1
    assert "read whole" not in caplog.text


def test_an_unwritable_cache_is_an_error_not_another_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl(docs(3000))))
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(blocker / "index"))
    message = f"{OP}: cannot write the seek index of {path} under {blocker / 'index'}: "
    with pytest.raises(DataError, match=re.escape(message)) as info:
        ReadJsonl(str(path), split_bytes=50_000, label="web").splits()
    assert str(info.value).endswith("set ZEPHON_CACHE_DIR to a writable directory")


def test_the_plan_is_the_same_from_a_fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, data in [
        ("a.jsonl.gz", gzip.compress(jsonl(docs(3000)))),
        ("b.jsonl.zst", zstd_frames(jsonl(docs(900)), 9000)),
    ]:
        (tmp_path / name).write_bytes(data)
    plans = []
    for cache in ("one", "two"):
        monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / cache))
        source = ReadJsonl(str(tmp_path / "*.jsonl.*"))
        plans.append([source.splits(lanes) for lanes in (1, 4, 16)])
    assert plans[0] == plans[1]


def test_a_file_read_whole_is_said_once_per_process_and_only_when_it_matters(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = jsonl(docs(500))
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(data))
    said = f"{path} is read whole (single-frame zstd: no seek points)"
    # The automatic plan: a split is at least 256 KiB, so the file is one split anyway.
    assert len(ReadJsonl(str(path), label="web").splits(4)) == 1
    # The automatic plan of many lanes on a file below QUIET_WHOLE_BYTES: not worth a word.
    monkeypatch.setattr(jsonl_module, "MIN_SPLIT_BYTES", 1000)
    assert len(ReadJsonl(str(path), label="web").splits(8)) == 1
    assert said not in caplog.text
    # Above it: said once, however many loaders (and ranks) of this process plan it again.
    monkeypatch.setattr(jsonl_module, "QUIET_WHOLE_BYTES", len(data))
    for _ in range(3):
        assert len(ReadJsonl(str(path), label="web").splits(8)) == 1
    assert caplog.text.count(said) == 1
