"""Tokenize's batched path (``process_batch``): the same ids as ``process``, errors naming the document."""

from __future__ import annotations

import apache_beam as beam
import numpy as np
import pytest
from helpers import Corpus

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError
from zephon_flow.engine.simulate import global_digests
from zephon_flow.runners.dofns import StatelessInvoker

TEXTS = ["", "alpha beta", "  the quick brown fox  ", "déjà vu ✓ 数据", "omega\n\npsi\tchi", "x" * 300]


def _per_element(tok: ops.Tokenize, texts: list[str]) -> list[list[np.ndarray]]:
    return [list(tok.process(t)) for t in texts]


@pytest.mark.parametrize("engine", ["hf", "auto"])
@pytest.mark.parametrize("append_eos", [True, False])
def test_process_batch_gives_process_s_ids(corpus: Corpus, engine: str, append_eos: bool) -> None:
    tok = ops.Tokenize(corpus.tokenizer_json, engine=engine, append_eos=append_eos)
    tok.setup()
    tok._unchecked = 0  # past the engines' cross-checked first documents: the fast path
    want = _per_element(tok, TEXTS)
    got = tok.process_batch(TEXTS)
    assert [[a.tolist() for a in outs] for outs in got] == [[a.tolist() for a in outs] for outs in want]
    assert all(outs[0].dtype == np.int32 for outs in got)


def test_the_first_documents_go_through_the_cross_check(corpus: Corpus) -> None:
    tok = ops.Tokenize(corpus.tokenizer_json, engine="auto")
    got = tok.process_batch(TEXTS)
    assert tok.active_engine == "hf" or tok._unchecked == 16 - len(TEXTS)  # each one was checked
    assert [o[0].tolist() for o in got] == [o[0].tolist() for o in _per_element(tok, TEXTS)]


def test_a_non_text_document_in_a_batch_is_refused(corpus: Corpus) -> None:
    with pytest.raises(DataError, match=r"^Tokenize: expected a str document, got bytes$"):
        ops.Tokenize(corpus.tokenizer_json).process_batch(["fine", b"bytes"])


def test_a_lone_surrogate_in_a_batch_names_the_document(corpus: Corpus) -> None:
    tok = ops.Tokenize(corpus.tokenizer_json, engine="hf")
    tok.setup()
    with pytest.raises(DataError, match=r"lone surrogate \(U\+D800 at character 3\)"):
        tok.process_batch(["fine", "abc\ud800def"])


def test_the_invoker_calls_it_once_per_batch(corpus: Corpus) -> None:
    invoker = StatelessInvoker("tok", ops.Tokenize(corpus.tokenizer_json))
    assert invoker.batched
    assert len(invoker.call_batch(TEXTS)) == len(TEXTS)
    with pytest.raises(DataError, match="got int"):
        invoker.call_batch([1])


class _PerElementTokenize(ops.Tokenize):
    """Tokenize with its batched path hidden: the runner calls ``process`` per document."""

    process_batch = beam.DoFn.process_batch


def _spec(corpus: Corpus, tokenize: type[ops.Tokenize]) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, split_bytes=500)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.7, 0.3])
        toks = docs | "tok" >> beam.ParDo(tokenize(corpus.tokenizer_json, engine="hf"))
        return toks | "pack" >> beam.ParDo(ops.Pack(seq_len=16))

    return zf.LoaderSpec(build, lanes=4, seed=0, global_batch_size=8)


def test_batched_and_per_element_tokenize_give_the_same_batches(corpus: Corpus) -> None:
    assert StatelessInvoker("t", _PerElementTokenize(corpus.tokenizer_json)).batched is False
    want = global_digests(_spec(corpus, _PerElementTokenize), steps=6)
    assert global_digests(_spec(corpus, ops.Tokenize), steps=6, chunk_records=5) == want
