"""Smoke test of ``bench.consumer_cost``: a tiny generated workload, a few steps per variant.

Only the shape and sanity of the results are checked (positive CPU per token, the threads each
backend has), never how fast anything is.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_bench_run import _tiny_workload

ROOT = Path(__file__).resolve().parent.parent


def test_every_variant_reports_its_consumer_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import consumer_cost
    from bench.workload import load_workload

    w = load_workload(str(_tiny_workload(tmp_path)))
    result = consumer_cost.run(w, rounds=1, steps=150, warmup=2, workers=2)
    table = result["table"]
    assert list(table) == list(consumer_cost.VARIANTS)
    for variant, row in table.items():
        cost = row["consumer_cpu_s_per_m_tokens"]
        assert math.isfinite(cost) and cost > 0, variant
        assert math.isclose(cost, sum(row["by_thread"].values()))  # one round: the median is it
        assert row["tokens_per_s"] > 0
    assert "zephon-lanes" in table["full/inline"]["by_thread"]
    assert table["full/inline"]["workers_cpu_s_per_m_tokens"] == 0  # no worker process
    # (the workers' share is not checked: a tiny workload's read-ahead may finish before the window)
    assert all(r["tokens"] > 0 for r in result["raw"])
    assert "| full/processes |" in consumer_cost.markdown(result)
