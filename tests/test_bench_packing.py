"""Smoke test of bench/packing.py: a --quick run on the small demo corpus writes the expected JSON.

Timings are never checked; what packing guarantees is: best_fit cuts no document that fits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zephon_flow.demo_data import DemoData

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_reports_padding_and_cuts(
    demo: DemoData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import packing

    out = tmp_path / "packing.json"
    argv = ["--quick", "--data-root", demo.root, "--max-code-files", "40", "--vocab-size", "512"]
    returned = packing.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text(encoding="utf-8")) == json.loads(json.dumps(returned))
    rows = returned["runs"]["512"]
    assert set(rows) == {"concat", "best_fit/buffer=0", "best_fit/buffer=16"}
    tokens = returned["config"]["tokens"]
    for name, q in rows.items():
        assert q["real_tokens"] == tokens, name
        assert q["seqs_per_s"] > 0 and q["seqs_per_s_over_concat"] > 0
        if name.startswith("best_fit"):
            assert q["avoidable_cuts"] == q["avoidable_cut_tokens"] == q["extra_pieces"] == 0, name
    assert rows["concat"]["avoidable_cuts"] > 0
    assert "| packer | sequences | padding (steady) |" in capsys.readouterr().out
