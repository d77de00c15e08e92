"""Smoke test of bench/images.py: a --quick run writes the expected JSON (never checks timings)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_writes_positive_rates_and_ratios(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # bench/ is a plain folder at the repository root
    from bench import images

    out = tmp_path / "images.json"
    images.main(["--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["images"] == 4 and report["repeats"] == 1
    for tag in ("draft", "full"):
        for key in ("pillow_images_per_s", "zephon_images_per_s", "zephon_over_pillow"):
            value = report[tag][key]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (tag, key)
    assert report["draft_speedup_zephon"] > 0
    assert "draft speed-up" in capsys.readouterr().out
