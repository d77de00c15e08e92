"""Smoke test of bench/stateless_overhead.py: tiny runs give every contender a positive number.

Only the shape of the results is checked, never timings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Corpus

ROOT = Path(__file__).resolve().parent.parent


def test_overhead_and_tokenize_report_every_contender(
    corpus: Corpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import stateless_overhead as bench

    rows = bench.overhead(200, 16, 1)
    assert set(rows) == {
        "plain loop",
        "DoFn.process per element",
        "beam.Map(fn)",
        "ops.Map(fn)",
        "ops.Map(fn, batched=True)",
    }
    assert rows["plain loop"]["ratio_to_plain_loop"] == 1.0
    assert all(r["ns_per_element"] > 0 for r in rows.values())
    tok = bench.tokenize(list(corpus.web_texts), corpus.tokenizer_json, 8, 1, "hf")
    assert set(tok) == {"hf engine alone (loop)", "Tokenize per element", "Tokenize batched"}
    assert all(r["mb_per_s"] > 0 for r in tok.values())
