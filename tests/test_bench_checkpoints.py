"""Smoke test of bench/checkpoints.py: a tiny run writes every row (recipe too), and every restore resumes.

Timings are never checked; sizes only where the formats guarantee an order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zephon_flow.demo_data import DemoData

ROOT = Path(__file__).resolve().parent.parent


def test_a_tiny_run_reports_every_format_and_resumes(
    demo: DemoData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import checkpoints

    out = tmp_path / "checkpoints.json"
    argv = ["--lanes", "2", "--buffer", "16", "--seq-len", "64", "--batch", "4", "--backend", "inline"]
    argv += ["--later", "1,3"]
    argv += ["--workers", "1", "--data", demo.root, "--code-files", "40", "--vocab", "512", "--out", str(out)]
    assert checkpoints.main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["format"]: r for r in result["rows"]}
    assert list(rows) == [
        "format 2 (before)",
        "compact",
        "incremental, 1 step(s) after the base",
        "incremental, 3 step(s) after the base",
        "recipe",
        "recipe, incremental, 3 step(s) after the recipe base",
    ]
    assert all(r["resume_digests_match"] for r in rows.values())
    assert rows["compact"]["bytes"] < rows["format 2 (before)"]["bytes"] / 4
    assert rows["incremental, 1 step(s) after the base"]["bytes"] < rows["compact"]["bytes"]
    assert rows["recipe"]["bytes"] < rows["compact"]["bytes"]  # the header dominates at this size
    assert all(r["resume_s"] > 0 for r in rows.values())
    rebuild = result["recipe_rebuild"]
    assert 0 < rebuild["distinct_documents"] <= rebuild["pieces"]
    assert rebuild["document_tokens_reread"] > 0 and rebuild["tokens_in_flight"] > 0
    assert rebuild["state_dict_later_steps"] == 1 and rebuild["state_dict_later_s"] > 0
    assert "| checkpoint | bytes | vs format 2 |" in capsys.readouterr().out
