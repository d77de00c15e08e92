"""Smoke test of bench/sources.py: a --quick run reads as many records as the plain readers.

Only record counts and that the numbers are positive are checked, never timings.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_reads_what_the_baselines_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import sources

    out = tmp_path / "sources.json"
    returned = sources.main(["--quick", "--out", str(out)])
    results = json.loads(out.read_text(encoding="utf-8"))
    assert results == json.loads(json.dumps(returned))
    records = results["records"]
    assert records == {
        "arrow_source": 200,
        "arrow_baseline": 200,
        "text_source": 50,
        "text_baseline": 50,
        "webdataset_source": 200,
        "webdataset_baseline": 200,
        "webdataset_index": 200,
    }
    for value in [*results["medians"].values(), *results["ratios"].values()]:
        assert isinstance(value, float) and math.isfinite(value) and value > 0
