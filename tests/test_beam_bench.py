"""Smoke test of bench/beam_translation.py: a tiny run gives both contenders the same batches.

Only the shape of the results is checked, never timings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Corpus

ROOT = Path(__file__).resolve().parent.parent


def test_both_contenders_run_and_agree(corpus: Corpus, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import beam_translation as bench

    spec = bench.text_mix(
        corpus.web_jsonl, corpus.code_parquet, corpus.tokenizer_json, seq_len=16, lanes=2, batch=4
    )
    rows = bench.measure(spec, repeats=1, parallel=False, tokens_per_step=64)
    assert set(rows) == {"loader inline", "beam FnApiRunner"}
    assert all(row["same_batches"] and row["steps"] > 3 and row["steps_per_s"] > 0 for row in rows.values())
    assert rows["beam FnApiRunner"]["vs_loader"] > 0
    assert "| beam FnApiRunner |" in bench.report(rows)
