"""Smoke test of bench/arrow_validation.py: a --quick run reads the same records with and without
the check. Only counts and that the numbers are positive are checked, never timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_reads_every_record_under_every_contender(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import arrow_validation

    out = tmp_path / "arrow_validation.json"
    returned = arrow_validation.main(["--quick", "--out", str(out)])
    results = json.loads(out.read_text(encoding="utf-8"))
    assert results == json.loads(json.dumps(returned))
    for kind in ("text", "tokens"):
        assert set(results[kind]["records"].values()) == {2 * 300}, results[kind]
        assert all(v > 0 for v in results[kind]["read_records_per_s"].values())
        assert all(v > 0 for v in results[kind]["check_gb_per_s"].values())
    from zephon_flow.operators import arrow

    assert arrow.check_column is arrow_validation.CHECKS["checked"]  # the shipped check is restored
