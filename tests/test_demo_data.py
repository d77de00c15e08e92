"""Tests for the offline demo corpus and its tokenizer."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from zephon_flow.demo_data import (
    ROW_GROUP_SIZE,
    DemoData,
    build_demo_data,
    corpus_bytes,
    default_demo_root,
)

SMALL_FILES = 40
SMALL_VOCAB = 512
SNIPPET = 'def f(x: int) -> str:\n    """Doc."""\n\treturn f"{x!r} → ünïcode  "  # ok\n'


def _build_small(root: str | Path) -> DemoData:
    return build_demo_data(str(root), max_code_files=SMALL_FILES, vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoData:
    return _build_small(tmp_path_factory.mktemp("demo"))


def _read_jsonl(blob: bytes) -> list[dict[str, str]]:
    return [json.loads(line) for line in blob.decode("utf-8").split("\n") if line]


def _mtimes(data: DemoData) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in Path(data.root).iterdir()}


def test_files_live_in_root(demo: DemoData) -> None:
    root = Path(demo.root)
    for path in (demo.docs_jsonl, demo.docs_gz, demo.code_parquet, demo.tokenizer_json):
        assert Path(path).parent == root
        assert Path(path).stat().st_size > 0
    assert sorted(p.name for p in root.iterdir()) == [
        "code.parquet",
        "docs.jsonl",
        "docs.jsonl.gz",
        "manifest.json",
        "tokenizer.json",
    ]
    assert demo.eos_token == "<|endoftext|>"


def test_prose_jsonl_and_gz_hold_the_same_documents(demo: DemoData) -> None:
    plain = Path(demo.docs_jsonl).read_bytes()
    docs = _read_jsonl(plain)
    assert gzip.decompress(Path(demo.docs_gz).read_bytes()) == plain
    assert len(docs) > 100
    assert all(list(d) == ["text", "id"] for d in docs)
    ids = [d["id"] for d in docs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(len(d["text"]) >= 200 for d in docs)
    assert any(i.startswith("topic:") for i in ids)
    assert any(i.startswith("module:") for i in ids)
    # Every line is one document, also for readers that split on Unicode line breaks.
    assert len(plain.decode("utf-8").splitlines()) == len(docs)


def test_code_parquet_has_row_groups_of_64(demo: DemoData) -> None:
    meta = pq.ParquetFile(demo.code_parquet).metadata
    table = pq.read_table(demo.code_parquet)
    assert table.column_names == ["path", "content"]
    assert table.num_rows == SMALL_FILES
    assert meta.num_row_groups == -(-table.num_rows // ROW_GROUP_SIZE)
    if table.num_rows > ROW_GROUP_SIZE:
        assert meta.num_row_groups > 1
    paths = table["path"].to_pylist()
    assert paths == sorted(paths)
    assert all(p.endswith(".py") and "site-packages" not in p for p in paths)
    assert all(500 <= len(text) <= 200_000 for text in table["content"].to_pylist())


def test_code_parquet_splits_into_row_groups_past_64_rows(tmp_path: Path) -> None:
    data = build_demo_data(str(tmp_path), max_code_files=150, vocab_size=300)
    meta = pq.ParquetFile(data.code_parquet).metadata
    assert meta.num_rows == 150
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [64, 64, 22]


def test_tokenizer_round_trips_code_and_knows_eos(demo: DemoData) -> None:
    tok = Tokenizer.from_file(demo.tokenizer_json)
    assert tok.get_vocab_size() == SMALL_VOCAB
    eos_id = tok.token_to_id(demo.eos_token)
    assert eos_id is not None
    assert tok.decode(tok.encode(SNIPPET).ids) == SNIPPET
    source = pq.read_table(demo.code_parquet)["content"][0].as_py()
    assert tok.decode(tok.encode(source).ids) == source
    ids = tok.encode(f"a{demo.eos_token}b").ids
    assert ids.count(eos_id) == 1


def test_corpus_bytes_counts_prose_and_code(demo: DemoData) -> None:
    prose = sum(len(d["text"].encode()) for d in _read_jsonl(Path(demo.docs_jsonl).read_bytes()))
    code = sum(len(t.encode()) for t in pq.read_table(demo.code_parquet)["content"].to_pylist())
    assert corpus_bytes(demo) == prose + code
    stats = json.loads((Path(demo.root) / "manifest.json").read_text())["stats"]
    assert stats["prose_bytes"] + stats["code_bytes"] == prose + code


def test_second_call_uses_cache(demo: DemoData) -> None:
    before = _mtimes(demo)
    start = time.perf_counter()
    again = _build_small(demo.root)
    elapsed = time.perf_counter() - start
    assert again == demo
    assert _mtimes(demo) == before
    assert elapsed < 0.5  # the fast path is well under 50 ms; slack for loaded CI machines


def test_changed_parameters_or_damaged_files_rebuild(demo: DemoData, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(demo.root, root)
    with open(root / "docs.jsonl", "ab") as f:
        f.write(b"garbage")
    rebuilt = _build_small(root)
    assert Path(rebuilt.docs_jsonl).read_bytes() == Path(demo.docs_jsonl).read_bytes()

    old = _mtimes(rebuilt)
    other = build_demo_data(str(root), max_code_files=SMALL_FILES, vocab_size=400)
    assert Tokenizer.from_file(other.tokenizer_json).get_vocab_size() == 400
    assert _mtimes(other)["manifest.json"] != old["manifest.json"]
    assert json.loads((root / "manifest.json").read_text())["params"]["vocab_size"] == 400


def test_builds_in_two_processes_are_byte_identical(demo: DemoData, tmp_path: Path) -> None:
    # A fresh interpreter with another hash seed: nothing is shared with the fixture's build.
    other = tmp_path / "other"
    code = (
        "from zephon_flow.demo_data import build_demo_data; "
        f"build_demo_data({str(other)!r}, max_code_files={SMALL_FILES}, vocab_size={SMALL_VOCAB})"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    names = ["docs.jsonl", "docs.jsonl.gz", "code.parquet", "tokenizer.json", "manifest.json"]
    for name in names:
        assert (other / name).read_bytes() == (Path(demo.root) / name).read_bytes(), name


def test_bad_parameters_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size must be at least 257"):
        build_demo_data(str(tmp_path), vocab_size=100)
    with pytest.raises(ValueError, match="max_code_files must be at least 1, got 0"):
        build_demo_data(str(tmp_path), max_code_files=0)
    assert not os.listdir(tmp_path)


def test_default_root_honours_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEPHON_DEMO_DIR", "/somewhere/demo")
    assert default_demo_root() == "/somewhere/demo"
    monkeypatch.delenv("ZEPHON_DEMO_DIR")
    monkeypatch.setenv("HOME", "/home/someone")
    assert default_demo_root() == "/home/someone/.cache/zephon-flow/demo"
