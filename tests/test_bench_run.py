"""Smoke test of ``bench.run``: a tiny generated input, a few steps, the main venv's contenders.

Checks that the results JSON, the report and the plots are written and that the numbers are
sane (positive, consistent with each other), never how fast anything is.
"""

from __future__ import annotations

import json
import math
import statistics
import sysconfig
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _write_source(folder: Path, texts: list[str], per_shard: int) -> str:
    folder.mkdir(parents=True)
    for i in range(0, len(texts), per_shard):
        with open(folder / f"shard-{i // per_shard:05d}.jsonl", "w", encoding="utf-8") as f:
            for text in texts[i : i + per_shard]:
                f.write(json.dumps({"text": text}) + "\n")
    return str(folder / "shard-*.jsonl")


def _small_gpt2(path: Path, merges: int = 2000) -> str:
    """GPT-2's first ``merges`` merges (ids 256 + merge number): the same kind of tokenizer as
    the benchmark's, quick to load in every contender process."""
    from bench import gpt2

    doc = gpt2.gpt2_document()
    doc["model"]["vocab"] = {t: i for t, i in doc["model"]["vocab"].items() if i < 256 + merges}
    doc["model"]["merges"] = doc["model"]["merges"][:merges]
    doc["added_tokens"][0]["id"] = 256 + merges
    doc["model"]["vocab"][gpt2.EOS] = 256 + merges
    path.write_text(json.dumps(doc), encoding="utf-8")
    return str(path)


def _tiny_workload(tmp_path: Path) -> Path:
    from bench.workload import TextWorkload

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [p.read_text(encoding="utf-8")[:6000] for p in sorted(stdlib.glob("[a-c]*.py"))[:40]]
    docs = [(p.read_text(encoding="utf-8")[:6000]) for p in sorted((stdlib / "email").glob("*.py"))]
    prose = [text.replace("def ", "the ") for text in code[::-1]]
    workload = TextWorkload(
        tokenizer=_small_gpt2(tmp_path / "gpt2-small.json"),
        sources={
            "code": _write_source(tmp_path / "code", code, 10),
            "docs": _write_source(tmp_path / "docs", docs, 10),
            "prose": _write_source(tmp_path / "prose", prose, 10),
        },
        weights={"code": 0.4, "docs": 0.3, "prose": 0.3},
        seq_len=128,
        global_batch=8,
        lanes=4,
        shuffle_per_lane=4,
    )
    path = tmp_path / "workload.json"
    path.write_text(workload.to_json(), encoding="utf-8")
    return path


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _run_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zephon: str, served: str) -> dict[str, Any]:
    """The orchestrator on the tiny input with the limit, ``zephon`` embedded and ``served`` over
    gRPC, and torch's DataLoader."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import run

    workload = _tiny_workload(tmp_path)
    out = tmp_path / "results"
    code = run.main(
        [
            "--workload",
            str(workload),
            "--no-peers",
            "--contenders",
            f"limit,{zephon},{served},torch_dataloader",
            "--steps",
            "4",
            "--warmup",
            "2",
            "--rounds",
            "1",
            "--resume-steps",
            "1,4",
            "--resume-consecutive",
            "3",
            "--resume-repeats",
            "2",
            "--elastic-step",
            "2",
            "--elastic-count",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    res: dict[str, Any] = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    res["report_md"] = (out / "report.md").read_text(encoding="utf-8")
    for png in ("throughput.png", "resume_ttfb.png", "checkpoint_bytes.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    return res


def _check(res: dict[str, Any], zephon: str, served: str) -> None:
    table = res["throughput"]["table"]
    assert set(table) == {"limit", zephon, served, "torch_dataloader"}
    for name, row in table.items():
        assert row["failed"] == [], (name, row["failed"])
        assert _positive(row["tokens_per_s"]) and _positive(row["peak_rss_mb"]), name
        assert 0.0 <= row["padding_fraction"] < 1.0
    assert table["limit"]["over_limit"] == pytest.approx(1.0)
    assert res["throughput"]["best_peer"] == "torch_dataloader"
    for name in (zephon, served, "torch_dataloader"):
        assert _positive(table[name]["end_to_end_tokens_per_s"]), name
        assert isinstance(table[name]["flags"], list), name
    for run_ in res["raw"]["throughput"]:
        if run_["name"] != "limit":
            assert run_["tokens"] <= 4 * 8 * 128 and run_["first_batch_shape"] == [8, 128]
            # one delivery instant per batch (first + warm-up + timed), in order
            assert len(run_["batch_times_s"]) == 1 + 2 + 4
            assert run_["batch_times_s"] == sorted(run_["batch_times_s"])
            assert _positive(run_["half_rate_ratio"])

    assert served not in res["resume"] and served not in res["elastic"]  # throughput only
    _check_resume(res, zephon)

    cases = res["elastic"][zephon]["cases"]
    assert [(c["world_size"], c["workers"]) for c in cases] == [(1, 2), (1, 1), (2, 2)]
    assert all(c["outcome"] == "match" for c in cases), cases
    assert res["unavailable"] == {}

    report = res["report_md"]
    assert f"| {zephon} |" in report and f"| {served} |" in report and "## Elasticity" in report
    assert "the uninterrupted run to step 6 took" in report


def _check_resume(res: dict[str, Any], zephon: str) -> None:
    """Checkpoints at 3 consecutive steps per point, the first 2 of them resumed; medians of those."""
    resume = res["resume"][zephon]
    assert resume["last_step"] == 6 and _positive(resume["uninterrupted_s"])
    assert resume["all_match"] is True and resume["timed_out"] is False
    points = resume["points"]
    assert [p["step"] for p in points] == [1, 4]
    assert [[x["step"] for x in p["samples"]] for p in points] == [[1, 2, 3], [4, 5, 6]]
    assert points[0]["reached_s"] <= points[1]["reached_s"] <= resume["uninterrupted_s"]
    for p in points:
        sizes = [x["checkpoint_bytes"] for x in p["samples"]]
        assert all(_positive(n) for n in sizes)
        assert p["checkpoint_bytes"] == statistics.median(sizes)
        resumed = [x for x in p["samples"] if "ttfb_s" in x]
        assert [x["step"] for x in resumed] == [p["step"], p["step"] + 1]
        assert all(x["matches_uninterrupted"] is True and _positive(x["ttfb_s"]) for x in resumed)
        assert p["ttfb_s"] == statistics.median(x["ttfb_s"] for x in resumed)
    goal = res["goals"]["zephon_checkpoint_bytes_last_over_first"]
    assert goal["steps"] == [1, 4] and goal["medians"] == [p["checkpoint_bytes"] for p in points]
    assert goal["value"] == pytest.approx(points[1]["checkpoint_bytes"] / points[0]["checkpoint_bytes"])
    assert goal["raw"] == [[x["checkpoint_bytes"] for x in p["samples"]] for p in points]
    assert len(res["goals"]["zephon_resume_ttfb_last_over_first"]["raw"][1]) == 2


@pytest.mark.timeout(300)
def test_tiny_run_writes_results_report_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _check(
        _run_tiny(tmp_path, monkeypatch, "zephon_inline_hf", "zephon_service_inline_hf"),
        "zephon_inline_hf",
        "zephon_service_inline_hf",
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_run_with_the_processes_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _check(
        _run_tiny(tmp_path, monkeypatch, "zephon_processes_hf", "zephon_service_hf"),
        "zephon_processes_hf",
        "zephon_service_hf",
    )


def _fake_run(name: str, rate: float, half_ratio: float, round_: int = 0) -> dict[str, Any]:
    return {
        "name": name,
        "round": round_,
        "ok": True,
        "tokens_per_s": rate,
        "end_to_end_tokens_per_s": rate / 2,
        "half_rate_ratio": half_ratio,
        "ttfb_s": 1.0,
        "peak_rss_bytes": 1e8,
        "padding_fraction": 0.0,
    }


def test_report_flags_rates_above_the_limit_and_unsteady_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import report

    runs = [
        _fake_run("limit", 100.0, 1.0),
        _fake_run("zephon_processes_hf", 90.0, 1.05),
        _fake_run("hf_datasets", 1500.0, 1.0),  # 15x the limit: impossible
        _fake_run("grain", 105.0, 3.0),  # within noise of the limit, but its buffer was draining
    ]
    raw: dict[str, list[dict[str, Any]]] = {"throughput": runs, "resume": [], "elastic": []}
    res = report.summarise(
        raw=raw,
        config={"workers": 2, "steps": 60, "warmup": 30, "rounds": 1},
        workload={
            "sources": {},
            "weights": {},
            "seq_len": 8,
            "shuffle_per_lane": 1,
            "lanes": 1,
            "global_batch": 1,
        },
        study={"global_batch": 1},
        data={},
        unavailable={},
        peers={"hf_datasets", "grain"},
    )
    table = res["throughput"]["table"]
    assert table["limit"]["flags"] == [] and table["zephon_processes_hf"]["flags"] == []
    assert table["hf_datasets"]["flags"] == [
        "tokens_per_s 15.00x the limit (> 1.10x): read-ahead or a bug",
        "end_to_end_tokens_per_s 7.50x the limit (> 1.10x): read-ahead or a bug",
    ]
    assert table["grain"]["flags"] == [
        "timed window not steady: its first half 3.00x faster than its second (buffer draining)"
    ]
    # zephon's ratio to the best peer is computed against a flagged rate, so the goal says so
    goal = res["goals"]["zephon_processes_hf_over_best_peer"]
    assert goal["value"] == pytest.approx(0.06) and goal["flags"] == table["hf_datasets"]["flags"]
    text = report.markdown(res)
    assert "**WARNING: these rates are not valid steady-state throughput:**" in text
    assert "- **hf_datasets: tokens_per_s 15.00x the limit" in text
    assert "INVALID" in text


def test_report_keeps_the_points_of_a_resume_study_cut_by_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import report

    def point(step: int, ttfb: float) -> dict[str, Any]:
        samples = [{"step": step + i, "checkpoint_bytes": 100 + i, "save_s": 0.1} for i in range(3)]
        samples[0].update(ttfb_s=ttfb, matches_uninterrupted=True)
        return {
            "step": step,
            "reached_s": float(step),
            "checkpoint_bytes": 101.0,
            "ttfb_s": ttfb,
            "matches_uninterrupted": True,
            "samples": samples,
        }

    # the last line a peer printed before it was killed: 2 of its 3 points
    cut = {
        "name": "torch_stateful",
        "ok": True,
        "partial": True,
        "timed_out": True,
        "timeout_s": 60.0,
        "uninterrupted_s": 50.0,
        "last_step": 1002,
        "points": [point(10, 2.0), point(100, 5.0)],
    }
    dead = {"name": "hf_datasets", "ok": False, "timed_out": True, "error": "timed out after 60 s; "}
    res = report.summarise(
        raw={"throughput": [], "resume": [cut, dead], "elastic": []},
        config={"workers": 2, "steps": 1, "warmup": 1, "rounds": 1},
        workload={
            "sources": {},
            "weights": {},
            "seq_len": 8,
            "shuffle_per_lane": 1,
            "lanes": 1,
            "global_batch": 1,
        },
        study={"global_batch": 8},
        data={},
        unavailable={},
        peers=set(),
    )
    r = res["resume"]["torch_stateful"]
    assert r["timed_out"] is True and r["ttfb_last_over_first"] == pytest.approx(2.5)
    assert res["resume"]["hf_datasets"]["timed_out"] is True
    assert "zephon_resume_ttfb_last_over_first" not in res["goals"]  # no zephon-flow study ran
    text = report.markdown(res)
    assert "| torch_stateful | 100 | 5.00 [5.00] | 101 [100, 101, 102] | True | 100.0 |" in text
    assert "the uninterrupted run to step 1,002 took 50 s; **the task hit its timeout (60 s)" in text
    assert "| hf_datasets | - | failed (timed out): timed out after 60 s;" in text
