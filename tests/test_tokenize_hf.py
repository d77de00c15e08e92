"""Tokenize meets Hugging Face habits: folders, hub cache snapshots, ``add_special_tokens``."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
from helpers import EOS, random_text, train_tokenizer
from tokenizers import Tokenizer, processors

from zephon_flow import operators as ops
from zephon_flow.core.errors import SpecError

BOS = "<s>"
TEXTS = ["hello world", "  leading spaces and a\nnew line", random_text(random.Random(1), 30)]


def bos_tokenizer(folder: Path) -> tuple[Tokenizer, Path]:
    """A byte-level BPE whose post-processor adds BOS, as Llama's does, saved as HF saves it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = Path(train_tokenizer(folder / "tokenizer.json", specials=(BOS, EOS)))
    tok = Tokenizer.from_file(str(path))
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    tok.save(str(path))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "<|endoftext|>"}')
    (folder / "special_tokens_map.json").write_text('{"bos_token": "<s>"}')
    return tok, path


def hub_cache(root: Path, tokenizer_json: Path) -> Path:
    """``models--org--tiny`` as huggingface_hub lays it out: blobs, a snapshot of links, refs/main."""
    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    blob = repo / "blobs" / "0123abcd"
    blob.write_bytes(tokenizer_json.read_bytes())
    snapshot = repo / "snapshots" / "5f1e2d"
    snapshot.mkdir(parents=True)
    os.symlink(os.path.relpath(blob, snapshot), snapshot / "tokenizer.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("5f1e2d")
    return repo


def ids(op: ops.Tokenize, text: str) -> list[int]:
    (out,) = op.process(text)
    assert out.dtype == np.int32
    return [int(i) for i in out]


@pytest.mark.parametrize("engine", ["hf", "auto"])
def test_add_special_tokens_has_hf_meaning(tmp_path: Path, engine: str) -> None:
    tok, path = bos_tokenizer(tmp_path / "saved")
    eos = tok.token_to_id(EOS)
    default = ops.Tokenize(path, engine=engine)
    with_specials = ops.Tokenize(path, engine=engine, add_special_tokens=True)
    bare = ops.Tokenize(path, engine=engine, add_special_tokens=True, append_eos=False)
    for text in TEXTS:
        hf = tok.encode(text).ids  # HF's default: add_special_tokens=True
        assert hf[0] == tok.token_to_id(BOS)
        assert ids(default, text) == [*tok.encode(text, add_special_tokens=False).ids, eos]
        assert ids(with_specials, text) == [*hf, eos]
        assert ids(bare, text) == hf
    batch = with_specials.process_batch(TEXTS)
    assert [[int(i) for i in row[0]] for row in batch] == [[*tok.encode(t).ids, eos] for t in TEXTS]
    assert "add_special_tokens" not in default.params()  # so old pipelines keep their fingerprint
    assert with_specials.params()["prefix_ids"] == [tok.token_to_id(BOS)]


def test_tiktokens_array_path_adds_the_same_tokens_as_the_checked_path(tmp_path: Path) -> None:
    """Past the first documents, tiktoken hands out its ids as an array (no Python list): the
    prefix, suffix and EOS go around it exactly as around HF's ids, in a fresh writable array."""
    tok, path = bos_tokenizer(tmp_path / "saved")
    eos = tok.token_to_id(EOS)
    for specials, eos_too in ((False, True), (True, True), (True, False), (False, False)):
        op = ops.Tokenize(path, engine="tiktoken", add_special_tokens=specials, append_eos=eos_too)
        op.setup()
        op._unchecked = 0  # as after the first documents' cross-check
        for text in [*TEXTS, ""]:
            want = [*tok.encode(text, add_special_tokens=specials).ids, *([eos] * eos_too)]
            (out,) = op.process(text)
            assert out.dtype == np.int32 and out.flags.writeable and out.flags.owndata
            assert out.tolist() == want, (specials, eos_too, text)
        rows = op.process_batch(TEXTS)
        assert [row[0].tolist() for row in rows] == [
            [*tok.encode(t, add_special_tokens=specials).ids, *([eos] * eos_too)] for t in TEXTS
        ]


def test_a_save_pretrained_folder_and_a_hub_cache_are_the_same_tokenizer(tmp_path: Path) -> None:
    tok, path = bos_tokenizer(tmp_path / "saved")
    repo = hub_cache(tmp_path / "hub", path)
    by_file = ops.Tokenize(path)
    for where in (path.parent, repo, repo / "snapshots" / "5f1e2d"):
        op = ops.Tokenize(where)
        assert op.params() == by_file.params()
        assert ids(op, TEXTS[0]) == ids(by_file, TEXTS[0])
    field = ops.TokenizeField(repo, add_special_tokens=True)
    (out,) = field.process({"__key__": "k", "txt": b"hello world"})
    assert [int(i) for i in out["text_ids"]] == [*tok.encode("hello world").ids, tok.token_to_id(EOS)]


def test_folders_without_a_tokenizer_json_say_what_they_hold(tmp_path: Path) -> None:
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "tokenizer.model").write_bytes(b"\x00")
    (slow / "config.json").write_text("{}")
    with pytest.raises(SpecError) as err:
        ops.Tokenize(slow)
    assert str(err.value).startswith(
        f"Tokenize: no tokenizer.json in the folder {slow} (it holds config.json, tokenizer.model); "
        f"it holds a slow tokenizer's files"
    )
    repo = tmp_path / "models--org--two"
    for rev in ("aaa", "bbb"):
        (repo / "snapshots" / rev).mkdir(parents=True)
    with pytest.raises(SpecError, match=r"2 snapshots \(aaa, bbb\) and no refs/main"):
        ops.Tokenize(repo)


def test_a_post_processor_that_already_appends_eos_refuses_append_eos(tmp_path: Path) -> None:
    path = Path(train_tokenizer(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_file(str(path))
    eos = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, eos)])
    tok.save(str(path))
    with pytest.raises(SpecError, match=r"already ends each text with the EOS id .*; pass append_eos=False"):
        ops.Tokenize(path, add_special_tokens=True)
    op = ops.Tokenize(path, add_special_tokens=True, append_eos=False)
    assert ids(op, "hello") == tok.encode("hello").ids
