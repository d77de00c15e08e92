"""Tests of TokenizeField: Tokenize's ids on one field of dict samples (captions), and its errors."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from helpers import Corpus

from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError


def run(fn: ops.TokenizeField, sample: Any) -> dict[str, Any]:
    (out,) = fn.process(sample)
    assert isinstance(out, dict)
    return out


def test_gives_tokenizes_ids_for_str_and_utf8_bytes(corpus: Corpus) -> None:
    text = "the quick brown fox — ünïcode"
    (want,) = ops.Tokenize(corpus.tokenizer_json).process(text)
    fn = ops.TokenizeField(corpus.tokenizer_json)
    for value in (text, text.encode("utf-8")):
        out = run(fn, {"__key__": "k", "txt": value, "image": 1})
        assert sorted(out) == ["__key__", "image", "text_ids"]
        assert out["text_ids"].dtype == np.int32
        np.testing.assert_array_equal(out["text_ids"], want)


def test_options_are_tokenizes_and_the_field_names(corpus: Corpus) -> None:
    (want,) = ops.Tokenize(corpus.tokenizer_json, append_eos=False).process("alpha beta")
    fn = ops.TokenizeField(
        corpus.tokenizer_json, field="caption", output="ids", append_eos=False, keep_input=True
    )
    out = run(fn, {"caption": "alpha beta"})
    assert sorted(out) == ["caption", "ids"]
    np.testing.assert_array_equal(out["ids"], want)
    params = fn.params()
    assert params["tokenizer_sha256"] == ops.Tokenize(corpus.tokenizer_json).params()["tokenizer_sha256"]
    assert (params["field"], params["output"], params["append_eos"]) == ("caption", "ids", False)


def test_survives_pickling_for_worker_processes(corpus: Corpus) -> None:
    fn = ops.TokenizeField(corpus.tokenizer_json)
    copy = pickle.loads(pickle.dumps(fn))
    copy.setup()
    np.testing.assert_array_equal(
        run(copy, {"txt": "gamma"})["text_ids"], run(fn, {"txt": "gamma"})["text_ids"]
    )


def test_invalid_utf8_is_a_data_error_naming_the_sample(corpus: Corpus) -> None:
    with pytest.raises(DataError) as info:
        run(ops.TokenizeField(corpus.tokenizer_json), {"__key__": "000003", "txt": b"ok \xff\xfe"})
    assert str(info.value) == (
        "TokenizeField: field 'txt' of sample '000003' is not valid UTF-8 (byte 3: invalid start byte)"
    )


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ("text", "TokenizeField: expected a dict sample with a 'txt' field, got str"),
        (
            {"__key__": "k"},
            r"TokenizeField: sample 'k' has no field 'txt' \(it has \['__key__'\]\); set TokenizeField",
        ),
        ({"txt": 5}, "TokenizeField: field 'txt' of the sample holds int, not text"),
    ],
)
def test_malformed_samples_are_data_errors(corpus: Corpus, sample: Any, message: str) -> None:
    with pytest.raises(DataError, match=message):
        run(ops.TokenizeField(corpus.tokenizer_json), sample)


def test_invalid_options_are_refused_up_front(corpus: Corpus) -> None:
    with pytest.raises(SpecError, match="TokenizeField: output must be a non-empty string, got ''"):
        ops.TokenizeField(corpus.tokenizer_json, output="")
    with pytest.raises(SpecError, match="Tokenize: engine must be one of"):
        ops.TokenizeField(corpus.tokenizer_json, engine="fast")
