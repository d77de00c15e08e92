"""bench/speed.py's summary and the report's own-engine limit, on synthetic results (no timing)."""

from __future__ import annotations

from typing import Any

from bench import report, speed


def _run(name: str, round_: int, rate: float, ttfb: float | None = 1.0) -> dict[str, Any]:
    return {"name": name, "round": round_, "ok": True, "tokens_per_s": rate, "ttfb_s": ttfb}


def test_speed_summary_gives_medians_and_paired_ratios() -> None:
    raw = [
        _run("limit_tiktoken", 0, 100.0, None),
        _run("zephon_auto", 0, 90.0, 2.0),
        _run("torch_dataloader", 0, 30.0, 4.0),
        _run("limit_tiktoken", 1, 200.0, None),
        _run("zephon_auto", 1, 160.0, 3.0),
        _run("torch_dataloader", 1, 40.0, 5.0),
        _run("limit_tiktoken", 2, 50.0, None),
        _run("zephon_auto", 2, 50.0, 1.0),
        _run("torch_dataloader", 2, 25.0, 2.0),
        {"name": "zephon_auto", "round": 3, "ok": False, "error": "boom"},
    ]
    table = speed.summarise("text", raw)["table"]
    z = table["zephon_auto"]
    assert z["tokens_per_s"] == 90.0 and z["runs"] == 3 and z["failed"] == ["boom"]
    assert z["over_limit"] == 90.0 / 100.0  # of the medians
    assert z["over_limit_samples"] == [0.9, 0.8, 1.0] and z["over_limit_paired"] == 0.9
    assert z["over_torch_paired"] == 3.0  # rounds: 3.0, 4.0, 2.0
    assert z["ttfb_over_torch"] == 2.0 / 4.0
    assert table["limit_tiktoken"]["ttfb_s"] is None
    text = speed.markdown({"baseline": "b", "now": "n", "rounds": 3, "loadavg_start": [1], "loadavg_end": [2],
                           "workloads": {"text": speed.summarise("text", raw)}})  # fmt: skip
    assert "| zephon_auto | 90.0 | 0.90 | 0.90 | 3.00 | 3.00 | 2.00 | 0.50 |" in text
    assert "zephon_auto: 1 failed: `boom`" in text


def test_report_holds_the_tiktoken_contender_to_its_own_engine_limit() -> None:
    runs = []
    for r, (limit, own, auto) in enumerate([(10.0, 100.0, 80.0), (12.0, 120.0, 114.0), (11.0, 90.0, 81.0)]):
        for name, rate in (("limit", limit), ("limit_tiktoken", own), ("zephon_processes_auto", auto)):
            runs.append({"name": name, "round": r, "ok": True, "tokens_per_s": rate, "peak_rss_bytes": 1e8})
    table = report._throughput(runs, peers=set())["table"]
    auto = table["zephon_processes_auto"]
    assert auto["over_own_limit"] == 81.0 / 100.0
    assert auto["over_own_limit_paired_median"] == 0.9  # rounds: 0.8, 0.95, 0.9
    assert auto["flags"] == []  # 8x the HF limit is not flagged: its own limit is tiktoken's
    assert table["limit_tiktoken"]["flags"] == []


def test_speed_summary_gives_the_work_per_cpu_second_over_the_limits() -> None:
    # The limit: 100 tokens/s on 2 processes that spent 4 CPU-s for 400 tokens (100 per CPU-s).
    # zephon: 90 tokens/s with 0.25 + 1.75 cores busy: 45 per CPU-s, 0.45 of the limit's.
    limit = {**_run("limit_tiktoken", 0, 100.0, None), "tokens": 400, "cpu_seconds": 4.0}
    zephon = {**_run("zephon_auto", 0, 90.0), "main_cpu_cores": 0.25, "children_cpu_cores": 1.75}
    limit1 = {**_run("limit_tiktoken", 1, 100.0, None), "tokens": 400, "cpu_seconds": 5.0}
    zephon1 = {**_run("zephon_auto", 1, 90.0), "main_cpu_cores": 0.5, "children_cpu_cores": 1.5}
    unmeasured = _run("torch_dataloader", 1, 30.0, 4.0)  # no CPU figures: no ratio, no error
    table = speed.summarise("text", [limit, zephon, limit1, zephon1, unmeasured])["table"]
    z = table["zephon_auto"]
    assert z["cpu_over_limit_samples"] == [0.45, 45.0 / 80.0]
    assert table["torch_dataloader"]["cpu_over_limit_paired"] is None
    assert table["limit_tiktoken"]["cpu_over_limit_paired"] == 1.0
    assert (
        speed.per_cpu_second(
            {"tokens_per_s": 9.0, "main_cpu_cores": 0.0, "children_cpu_cores": 0.0}, "tokens_per_s"
        )
        is None
    )
    text = speed.markdown({"baseline": "b", "now": "n", "rounds": 2, "loadavg_start": [1], "loadavg_end": [2],
                           "workloads": {"text": speed.summarise("text", [limit, zephon, limit1, zephon1])}})  # fmt: skip
    assert f"| {(0.45 + 45.0 / 80.0) / 2:.2f} |" in text  # the median of the two rounds


def test_short_documents_are_the_real_ones_cut_at_spaces() -> None:
    from bench.short_docs import pieces

    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa" * 3
    cut = list(pieces(text, 10))
    assert "".join(cut) == text
    assert all(len(p) >= 10 for p in cut[:-1]) and len(cut) > 5
    assert all(p.startswith(" ") for p in cut[1:])  # each cut is at a space
    assert list(pieces("short", 10)) == ["short"] and list(pieces("", 10)) == []
