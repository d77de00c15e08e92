"""``zephon demo``, short: the digests match across topologies and the resume, rates leave out start-up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zephon_flow.demo import run_demo


@pytest.mark.slow
def test_a_short_demo_matches_and_reports_steady_rates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """About 30 s: the demo corpus (10 MB, a 4096-token BPE) is built in a fresh folder."""
    monkeypatch.setenv("ZEPHON_DEMO_DIR", str(tmp_path))
    assert run_demo(steps=6, workers=2, backend="threads") == 0
    out = capsys.readouterr().out
    assert (
        "OK: all 6 global batch digests match across 4 ranks / 2 ranks / resume at step 3 on 8 ranks" in out
    )
    summaries = re.findall(
        r"(\d+) global batches, ([\d,]+) tokens/s after the first batch \(([\d.]+) s to the first\)", out
    )
    assert [int(n) for n, _, _ in summaries] == [6, 3, 3]
    assert all(int(rate.replace(",", "")) > 0 for _, rate, _ in summaries)
