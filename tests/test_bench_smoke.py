"""Smoke test of bench/throughput.py: a --quick run on a tiny corpus writes the expected JSON.

Only the shape of the results and that the numbers are positive are checked, never timings.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

MEDIANS = (
    "limit_tokens_per_s",
    "limit_mb_per_s",
    "zephon_processes_tokens_per_s",
    "zephon_processes_ttfb_fresh_s",
    "zephon_inline_tokens_per_s",
    "zephon_inline_ttfb_fresh_s",
    "resume_processes_ttfb_early_s",
    "resume_processes_ttfb_late_s",
    "resume_inline_ttfb_early_s",
    "resume_inline_ttfb_late_s",
    "state_bytes_early",
    "state_bytes_late",
)
RATIOS = (
    "processes_over_limit",
    "processes_over_limit_paired_median",
    "inline_over_limit",
    "resume_processes_ttfb_late_over_early",
    "resume_inline_ttfb_late_over_early",
    "state_bytes_late_over_early",
)


def _positive(value: Any) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


@pytest.mark.timeout(300)
def test_quick_run_writes_expected_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # bench/ is a plain folder at the repository root; the limit's spawned workers import
    # bench.throughput by name, so the root must be on the path they inherit.
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import throughput
    from zephon_flow.demo_data import build_demo_data

    data_root = tmp_path / "demo"
    build_demo_data(str(data_root), max_code_files=20, vocab_size=512)
    out = tmp_path / "results" / "throughput.json"
    returned = throughput.main(
        [
            "--quick",
            "--data-root",
            str(data_root),
            "--max-code-files",
            "20",
            "--vocab-size",
            "512",
            "--out",
            str(out),
        ]
    )

    results = json.loads(out.read_text(encoding="utf-8"))
    assert results == json.loads(json.dumps(returned))
    for key in ("config", "machine", "medians", "ratios", "goals", "checks", "state", "raw"):
        assert key in results, key
    assert results["config"]["quick"] is True
    assert results["config"]["data_root"] == str(data_root)
    assert results["machine"]["cpu_count"] >= 1
    assert results["machine"]["python"] == sys.version.split()[0]
    assert set(results["machine"]["versions"]) >= {"zephon_flow", "tokenizers", "apache_beam"}

    for key in MEDIANS:
        assert _positive(results["medians"][key]), (key, results["medians"][key])
    for key in RATIOS:
        assert _positive(results["ratios"][key]), (key, results["ratios"][key])

    raw = results["raw"]
    repeats = results["config"]["repeats"]
    for name in ("limit", "zephon_processes", "zephon_inline", "resume"):
        assert len(raw[name]) == repeats, name
    for run in raw["zephon_processes"] + raw["zephon_inline"]:
        assert _positive(run["tokens_per_s"]) and _positive(run["ttfb_s"])
    for run in raw["limit"]:
        assert _positive(run["tokens"]) and _positive(run["tokens_per_s"])
    for run in raw["resume"]:
        for backend in ("processes", "inline"):
            for which in ("early", "late"):
                assert _positive(run[backend][which]["ttfb_s"])

    early, late = results["state"]["early"], results["state"]["late"]
    assert (early["step"], late["step"]) == (results["config"]["early_step"], results["config"]["late_step"])
    assert _positive(early["bytes"]) and _positive(late["bytes"])

    # Determinism is the library's promise; the benchmark reports whether it held.
    assert all(results["checks"].values()), results["checks"]
    assert "| measurement | value | notes |" in capsys.readouterr().out
