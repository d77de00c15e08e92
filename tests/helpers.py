"""Shared test utilities: tiny corpora, a tiny tokenizer, small stateless DoFns and example specs.

Nothing here depends on pytest fixtures, so tests and hypothesis strategies can call it freely.
The DoFns live at module level so that the processes backend can pickle them by reference.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import zephon_flow as zf
from zephon_flow import operators as ops

EOS = "<|endoftext|>"
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
    "upsilon",
    "phi",
    "chi",
    "psi",
    "omega",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "def",
    "return",
]

# Source tags used by ``DocKey``: a document's text starts with "<tag> <index> ...".
WEB, CODE = 0, 1
_TAGS = {"web": WEB, "code": CODE}


# -- files -----------------------------------------------------------------------------------
def write_jsonl(path: Path, texts: Sequence[str], *, field: str = "text") -> str:
    """One JSON object per line, ``{field: text}``; returns the path as a string."""
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({field: text}) + "\n")
    return str(path)


def write_parquet(
    path: Path, texts: Sequence[str], *, column: str = "content", row_group_size: int = 8
) -> str:
    pq.write_table(pa.table({column: list(texts)}), path, row_group_size=row_group_size)
    return str(path)


def random_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def tagged_texts(tag: str, n: int, *, seed: int, min_words: int = 3, max_words: int = 30) -> list[str]:
    """``n`` documents ``"<tag> <i> words..."`` of random length, reproducible from ``seed``."""
    rng = random.Random(f"{tag}/{seed}")
    return [f"{tag} {i} {random_text(rng, rng.randint(min_words, max_words))}" for i in range(n)]


def train_tokenizer(path: Path, *, vocab_size: int = 300, specials: Sequence[str] = (EOS,)) -> str:
    """A byte-level BPE tokenizer trained in milliseconds on the test vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(7)
    tok.train_from_iterator([random_text(rng, 20) for _ in range(200)], trainer)
    tok.save(str(path))
    return str(path)


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A tiny two-source corpus and its tokenizer (built once per session by conftest)."""

    root: Path
    web_jsonl: str
    code_parquet: str
    tokenizer_json: str
    web_texts: tuple[str, ...]
    code_texts: tuple[str, ...]


def make_corpus(root: Path, *, n_web: int = 60, n_code: int = 40) -> Corpus:
    root.mkdir(parents=True, exist_ok=True)
    web = tagged_texts("web", n_web, seed=1)
    code = tagged_texts("code", n_code, seed=2)
    return Corpus(
        root=root,
        web_jsonl=write_jsonl(root / "web.jsonl", web),
        code_parquet=write_parquet(root / "code.parquet", code),
        tokenizer_json=train_tokenizer(root / "tokenizer.json"),
        web_texts=tuple(web),
        code_texts=tuple(code),
    )


# -- stateless DoFns -------------------------------------------------------------------------
class ParseIds(beam.DoFn):  # type: ignore[misc]
    """``"1 2 3 | 4 5"`` -> the documents ``[1, 2, 3]`` and ``[4, 5]`` (int32 token ids).

    Lets tests hand-make documents, and gives records with several outputs (the cursor's skip).
    """

    def process(self, text: str) -> Iterator[np.ndarray]:
        for part in text.split("|"):
            if part.strip():
                yield np.asarray([int(t) for t in part.split()], dtype=np.int32)


class DocKey(beam.DoFn):  # type: ignore[misc]
    """``"web 17 ..."`` -> ``{"src": 0, "doc": 17}``: a fixed-shape sample naming its document."""

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        tag, index = text.split()[:2]
        yield {"src": np.int64(_TAGS.get(tag, -1)), "doc": np.int64(int(index))}


# -- specs -----------------------------------------------------------------------------------
def example_spec(
    corpus: Corpus,
    *,
    lanes: int = 4,
    seed: int = 0,
    global_batch_size: int = 12,
    seq_len: int = 16,
    buffer: int = 4,
    weights: Sequence[float] = (0.7, 0.3),
    split_bytes: int = 500,
) -> zf.LoaderSpec:
    """The DESIGN.md example: two sources, mix, tokenize, pack, shuffle."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text", split_bytes=split_bytes)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
        docs = (web, code) | "mix" >> ops.Mix(weights=list(weights))
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=seq_len))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=buffer))

    return zf.LoaderSpec(build, lanes=lanes, seed=seed, global_batch_size=global_batch_size)


def chain_spec(
    jsonl: str,
    *steps: tuple[str, beam.DoFn],
    lanes: int = 1,
    seed: int = 0,
    global_batch_size: int = 1,
    split_bytes: int = 1 << 20,
    epochs: int | None = None,
) -> zf.LoaderSpec:
    """One JSONL source followed by ``(label, DoFn)`` steps, applied with ``beam.ParDo``."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        pcoll = p | "src" >> ops.ReadJsonl(jsonl, split_bytes=split_bytes, epochs=epochs)
        for label, fn in steps:
            pcoll = pcoll | label >> beam.ParDo(fn)
        return pcoll

    return zf.LoaderSpec(build, lanes=lanes, seed=seed, global_batch_size=global_batch_size)


# -- running ---------------------------------------------------------------------------------
def run_batches(
    spec: zf.LoaderSpec, steps: int | None = None, **loader_kwargs: Any
) -> list[dict[str, np.ndarray]]:
    """Up to ``steps`` batches of one loader (all of them when ``steps`` is None)."""
    out: list[dict[str, np.ndarray]] = []
    with zf.Loader(spec, **loader_kwargs) as loader:
        for step, batch in loader:
            assert step == len(out)
            out.append(batch)
            if steps is not None and len(out) == steps:
                break
    return out


def source_epochs(spec: zf.LoaderSpec, state: dict[str, Any]) -> dict[str, list[int]]:
    """Per source label, the pass each lane's cursor is in (from a merged loader state)."""
    lane_states = {ls["lane"]: ls for ls in state["lane_states"]}
    return {
        sp.label: [lane_states[lane]["cursor"]["sources"][index][0] for lane in sorted(lane_states)]
        for index, sp in enumerate(spec.compile().sources)
    }
