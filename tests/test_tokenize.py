"""Tests of Tokenize: the HF tokenizer's ids plus EOS, pickling, and refusals of bad files."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from helpers import Corpus, chain_spec, run_batches, train_tokenizer
from tokenizers import Tokenizer

from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.demo_data import DemoData


def hf_ids(path: str, text: str) -> list[int]:
    return list(Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids)


def test_ids_are_the_tokenizers_plus_eos(corpus: Corpus) -> None:
    tok = ops.Tokenize(corpus.tokenizer_json)
    eos = Tokenizer.from_file(corpus.tokenizer_json).token_to_id("<|endoftext|>")
    assert tok.eos_id == eos
    for text in [*corpus.web_texts[:5], "", "ünïcödé ✓ and\nnewlines\t"]:
        (ids,) = list(tok.process(text))
        assert ids.dtype == np.int32
        assert ids.tolist() == [*hf_ids(corpus.tokenizer_json, text), eos]


def test_without_eos_the_ids_are_the_tokenizers_alone(corpus: Corpus) -> None:
    tok = ops.Tokenize(corpus.tokenizer_json, append_eos=False)
    text = corpus.web_texts[0]
    assert next(iter(tok.process(text))).tolist() == hf_ids(corpus.tokenizer_json, text)
    assert tok.params()["eos_id"] is None


def test_eos_token_names_the_token_to_append(tmp_path: Path) -> None:
    path = train_tokenizer(tmp_path / "tok.json", specials=["<pad>", "</doc>"])
    tok = ops.Tokenize(path, eos_token="</doc>")
    assert tok.eos_id == Tokenizer.from_file(path).token_to_id("</doc>")
    assert next(iter(tok.process("alpha"))).tolist()[-1] == tok.eos_id


def test_a_pickled_copy_reloads_its_tokenizer_and_agrees(corpus: Corpus) -> None:
    tok = ops.Tokenize(corpus.tokenizer_json)
    list(tok.process("warm up"))
    copy = pickle.loads(pickle.dumps(tok))
    assert copy._tokenizer is None  # each process loads its own
    text = corpus.web_texts[3]
    assert next(iter(copy.process(text))).tolist() == next(iter(tok.process(text))).tolist()


def test_the_tokenizer_files_digest_is_a_parameter(corpus: Corpus, tmp_path: Path) -> None:
    other = train_tokenizer(tmp_path / "other.json", vocab_size=290)
    a, b = ops.Tokenize(corpus.tokenizer_json).params(), ops.Tokenize(other).params()
    assert a["tokenizer_sha256"] != b["tokenizer_sha256"]
    assert len(a["tokenizer_sha256"]) == 64


def test_real_documents_through_a_loader_are_tokenized_in_order(demo: DemoData) -> None:
    with open(demo.docs_jsonl, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    spec = chain_spec(demo.docs_jsonl, ("tok", ops.Tokenize(demo.tokenizer_json)))
    got = [b["data"][0].tolist() for b in run_batches(spec, 12)]  # one document per batch
    eos = Tokenizer.from_file(demo.tokenizer_json).token_to_id(demo.eos_token)
    assert got == [[*hf_ids(demo.tokenizer_json, text), eos] for text in texts[:12]]


# -- refusals -------------------------------------------------------------------------------
def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(SpecError, match=rf"Tokenize: cannot read tokenizer file {path}: No such file"):
        ops.Tokenize(path)


def test_a_hub_id_is_refused_saying_nothing_is_downloaded_and_how_to_point_at_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    with pytest.raises(SpecError) as err:
        ops.Tokenize("openai-community/gpt2")
    assert str(err.value) == (
        "Tokenize: 'openai-community/gpt2' is not a file or folder here, and Tokenize does not "
        "download hub ids. Fetch the tokenizer once, e.g. AutoTokenizer.from_pretrained("
        "'openai-community/gpt2').save_pretrained(DIR), and pass DIR (or its tokenizer.json), or "
        "pass the local hub cache folder ~/.cache/huggingface/hub/models--openai-community--gpt2"
    )
    with pytest.raises(
        SpecError, match=r"^Tokenize: 'gpt2' is not a file or folder here, and Tokenize does not"
    ):
        ops.Tokenize("gpt2")


def test_a_tokenizer_object_is_refused_by_name_saying_how_to_save_it() -> None:
    from tokenizers import Tokenizer, models

    with pytest.raises(SpecError) as err:
        ops.Tokenize(Tokenizer(models.BPE()))  # type: ignore[arg-type]
    assert str(err.value) == (
        "Tokenize: pass the path of a tokenizer.json (or of a folder holding one), not a "
        "tokenizers.Tokenizer object: tokenizer.save(path), then pass the path (the file's sha256 "
        "is part of the pipeline's fingerprint)"
    )


def test_a_file_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "vocab.txt"
    path.write_text("hello world\n")
    with pytest.raises(SpecError, match=rf"Tokenize: tokenizer file {path} is not valid JSON"):
        ops.Tokenize(path)


def test_json_that_is_not_a_tokenizer_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama"}')
    with pytest.raises(
        SpecError, match=rf"Tokenize: {path} is not a tokenizer file that HF tokenizers can load"
    ):
        ops.Tokenize(path)


def test_a_tokenizer_without_eos_token_is_refused_with_the_way_out(tmp_path: Path) -> None:
    path = train_tokenizer(tmp_path / "tok.json", specials=[])
    with pytest.raises(
        SpecError, match=r"Tokenize: no EOS token '<\|endoftext\|>' or .* in .*tok\.json; pass eos_token="
    ):
        ops.Tokenize(path)
    with pytest.raises(SpecError, match=r"no EOS token '</s>' in .*; pass eos_token=.*append_eos=False"):
        ops.Tokenize(path, eos_token="</s>")
    assert ops.Tokenize(path, append_eos=False).eos_id is None


def test_a_non_text_document_is_refused(corpus: Corpus) -> None:
    with pytest.raises(DataError, match=r"Tokenize: expected a str document, got bytes"):
        list(ops.Tokenize(corpus.tokenizer_json).process(b"bytes"))


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            "truncation",
            r'sets "truncation", which would cut documents; save the tokenizer with tokenizer\.no_truncation\(\)',
        ),
        (
            "padding",
            r'sets "padding", which would add pad tokens; save the tokenizer with tokenizer\.no_padding\(\)',
        ),
        ("dropout", r'sets BPE "dropout" \(0\.1\), which makes token ids random'),
    ],
)
def test_settings_that_change_ids_or_lengths_are_refused(tmp_path: Path, setting: str, message: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(
        models.BPE(
            vocab={"a": 0, "b": 1, "<|endoftext|>": 2},
            merges=[],
            dropout=0.1 if setting == "dropout" else None,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if setting == "truncation":
        tok.enable_truncation(max_length=8)
    if setting == "padding":
        tok.enable_padding(length=8)
    path = tmp_path / "tok.json"
    tok.save(str(path))
    for engine in ("hf", "auto", "tiktoken"):
        with pytest.raises(SpecError, match=message):
            ops.Tokenize(str(path), engine=engine)
