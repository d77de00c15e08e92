"""Smoke test of ``bench.run``: a tiny generated input, a few steps, the main venv's contenders.

Checks that the results JSON, the report and the plots are written and that the numbers are
sane (positive, consistent with each other), never how fast anything is.
"""

from __future__ import annotations

import json
import math
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


@pytest.mark.timeout(300)
def test_tiny_run_writes_results_report_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
            "limit,zephon_processes_hf,torch_dataloader",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--resume-steps",
            "1,4",
            "--elastic-step",
            "2",
            "--elastic-count",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    res = json.loads((out / "bench.json").read_text(encoding="utf-8"))
    table = res["throughput"]["table"]
    assert set(table) == {"limit", "zephon_processes_hf", "torch_dataloader"}
    for name, row in table.items():
        assert row["failed"] == [], (name, row["failed"])
        assert _positive(row["tokens_per_s"]) and _positive(row["peak_rss_mb"]), name
        assert 0.0 <= row["padding_fraction"] < 1.0
    assert table["limit"]["over_limit"] == pytest.approx(1.0)
    assert res["throughput"]["best_peer"] == "torch_dataloader"
    for name in ("zephon_processes_hf", "torch_dataloader"):
        assert _positive(table[name]["end_to_end_tokens_per_s"]), name
    for run_ in res["raw"]["throughput"]:
        if run_["name"] != "limit":
            assert run_["tokens"] <= 3 * 8 * 128 and run_["first_batch_shape"] == [8, 128]

    resume = res["resume"]["zephon_processes_hf"]
    assert [p["step"] for p in resume["points"]] == [1, 4]
    assert resume["all_match"] is True
    assert all(_positive(p["checkpoint_bytes"]) and _positive(p["ttfb_s"]) for p in resume["points"])

    cases = res["elastic"]["zephon_processes_hf"]["cases"]
    assert [(c["world_size"], c["workers"]) for c in cases] == [(1, 2), (1, 1), (2, 2)]
    assert all(c["outcome"] == "match" for c in cases), cases
    assert res["unavailable"] == {}

    report = (out / "report.md").read_text(encoding="utf-8")
    assert "| zephon_processes_hf |" in report and "## Elasticity" in report
    for png in ("throughput.png", "resume_ttfb.png", "checkpoint_bytes.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
