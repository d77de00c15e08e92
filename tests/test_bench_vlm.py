"""Smoke test of the vision-language workload of ``bench.run``: Pillow-made tars, one round, few steps.

Checks that the files are written and that the numbers are sane (positive, consistent with the
work: images and caption tokens counted, batch shapes equal across contenders), never timings.
"""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
CAPTIONS = ("a red ball", "two cats on a mat", "the sea at night", "a tall green tree", "an old blue car")


def _image(i: int) -> tuple[str, bytes]:
    """Small images of the kinds in the real data: RGBA and palette PNGs, RGB and grey JPEGs."""
    rng = np.random.default_rng(i)
    h, w = 40 + 13 * (i % 5), 60 + 7 * (i % 3)
    pixels = rng.integers(0, 256, size=(h, w, 4), dtype=np.uint8)
    kind = i % 4
    buf = io.BytesIO()
    if kind == 0:
        Image.fromarray(pixels, "RGBA").save(buf, "PNG")
    elif kind == 1:
        im = Image.fromarray(pixels[:, :, :3], "RGB").convert("P")
        im.save(buf, "PNG", transparency=0)
    elif kind == 2:
        Image.fromarray(pixels[:, :, :3], "RGB").save(buf, "JPEG", quality=85)
    else:
        Image.fromarray(pixels[:, :, 0], "L").save(buf, "JPEG", quality=85)
    return ("png" if kind < 2 else "jpg"), buf.getvalue()


def _tars(folder: Path, samples: int, per_tar: int) -> str:
    folder.mkdir()
    for first in range(0, samples, per_tar):
        with tarfile.open(folder / f"images-{first // per_tar:05d}.tar", "w") as tar:
            for i in range(first, min(samples, first + per_tar)):
                ext, data = _image(i)
                caption = f"{CAPTIONS[i % len(CAPTIONS)]} number {i}".encode()
                for name, member in ((f"s{i:05d}.{ext}", data), (f"s{i:05d}.txt", caption)):
                    info = tarfile.TarInfo(name)
                    info.size = len(member)
                    tar.addfile(info, io.BytesIO(member))
    return str(folder / "images-*.tar")


def _small_gpt2(path: Path, merges: int = 500) -> str:
    """GPT-2's first ``merges`` merges: the bench's kind of tokenizer, quick to load."""
    from bench import gpt2

    doc = gpt2.gpt2_document()
    doc["model"]["vocab"] = {t: i for t, i in doc["model"]["vocab"].items() if i < 256 + merges}
    doc["model"]["merges"] = doc["model"]["merges"][:merges]
    doc["added_tokens"][0]["id"] = 256 + merges
    doc["model"]["vocab"][gpt2.EOS] = 256 + merges
    path.write_text(json.dumps(doc), encoding="utf-8")
    return str(path)


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zephon: str) -> tuple[dict[str, Any], Path]:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import run
    from bench.vlm import VlmWorkload

    workload = VlmWorkload(
        tars=_tars(tmp_path / "tars", samples=30, per_tar=20),
        tokenizer=_small_gpt2(tmp_path / "gpt2-small.json"),
        size=32,
        seq_len=64,
        tokens_per_image=16,
        max_images=3,
        image_token_id=9999,
        global_batch=4,
        lanes=2,
        samples_per_split=5,
    )
    path = tmp_path / "vlm.json"
    path.write_text(workload.to_json(), encoding="utf-8")
    out = tmp_path / "results"
    args = ["--workloads", "vlm", "--vlm-workload", str(path), "--vlm-contenders"]
    args += [f"limit,{zephon},torch_dataloader", "--vlm-steps", "4", "--vlm-warmup", "2", "--rounds", "1"]
    assert run.main([*args, "--out", str(out)]) == 0
    return json.loads((out / "bench.json").read_text(encoding="utf-8")), out


def _check(res: dict[str, Any], out: Path, zephon: str) -> None:
    assert set(res) == {"vlm"}  # --workloads vlm: no text results
    vlm = res["vlm"]
    assert vlm["checks"] == {
        "samples_checked": 8,
        "pixels_equal": True,
        "caption_ids_equal": True,
        "zephon_and_peer_batch_shapes_equal": True,
    }
    table = vlm["table"]
    assert set(table) == {"limit", zephon, "torch_dataloader"}
    for name, row in table.items():
        assert row["failed"] == [], (name, row["failed"])
        assert _positive(row["images_per_s"]) and _positive(row["caption_tokens_per_s"]), name
        assert _positive(row["peak_rss_mb"]), name
        assert isinstance(row["flags"], list), name
    assert table["limit"]["over_limit"] == pytest.approx(1.0)
    assert table["torch_dataloader"]["over_peer"] == pytest.approx(1.0)
    for name in (zephon, "torch_dataloader"):
        row = table[name]
        assert _positive(row["end_to_end_images_per_s"]) and _positive(row["ttfb_s"]), name
        # 3 images of 16 tokens and their captions in 64 tokens: some padding, never all
        assert 0.0 < row["padding_fraction"] < 0.5, name
        assert row["first_batch_shapes"]["images"] == [4, 3, 32, 32, 3], name
        assert row["first_batch_shapes"]["input_ids"] == [4, 64], name
    for r in vlm["raw"]:
        if r["name"] != "limit":
            # every timed batch holds 4 sequences of at most 3 images, at least 1 each
            assert 4 <= r["images"] <= 4 * 4 * 3, r["name"]
            # each caption is at least 4 tokens ("a red ball" + EOS) and the captions left room
            assert r["caption_tokens"] >= 4 * r["images"], r["name"]
        else:
            assert r["images"] >= 4 * 4 * 3 and r["caption_tokens"] >= 4 * r["images"]
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "## Vision-language workload" in report and "torch DataLoader" in report
    assert (out / "vlm_throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_vlm_bench_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res, out = _run(tmp_path, monkeypatch, "zephon_inline")
    _check(res, out, "zephon_inline")


@pytest.mark.slow
def test_vlm_bench_smoke_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res, out = _run(tmp_path, monkeypatch, "zephon_processes")
    _check(res, out, "zephon_processes")


def test_vlm_report_flags_impossible_rates() -> None:
    from bench import vlm_report

    def run_(name: str, images: float, halves: float | None = 1.0) -> dict[str, Any]:
        return {
            "name": name,
            "round": 0,
            "ok": True,
            "peak_rss_bytes": 1e8,
            "images_per_s": images,
            "caption_tokens_per_s": images * 7,
            "end_to_end_images_per_s": images / 2,
            "end_to_end_caption_tokens_per_s": images * 3.5,
            "half_rate_ratio": halves,
        }

    raw = [run_("limit", 100.0, None), run_("zephon_processes", 150.0), run_("torch_dataloader", 90.0, 1.6)]
    config: dict[str, Any] = {"steps": 1, "warmup": 1, "rounds": 1, "workers": 2, "cpu_count": 2}
    config |= {"loadavg_start": [0.0] * 3, "loadavg_end": [0.0] * 3}
    checks = {"samples_checked": 1, "pixels_equal": True, "caption_ids_equal": True}
    res = vlm_report.summarise(raw, workload=_workload_dict(), config=config, checks=checks)
    table = res["table"]
    assert table["limit"]["flags"] == []
    assert [f.split(" ")[0] for f in table["zephon_processes"]["flags"]] == [
        "images_per_s",
        "caption_tokens_per_s",
    ]
    assert table["torch_dataloader"]["flags"] == [
        "timed window not steady: its first half 1.60x faster than its second (buffer draining)"
    ]
    assert table["zephon_processes"]["over_peer"] == pytest.approx(150 / 90)
    text = "\n".join(vlm_report.markdown_lines(res))
    assert "**zephon_processes: images_per_s 1.50x the limit" in text
    assert text.count("**FLAGGED**") == 2


def _workload_dict() -> dict[str, Any]:
    from bench.vlm import VlmWorkload

    workload: dict[str, Any] = json.loads(VlmWorkload(tars="x/*.tar", tokenizer="t.json").to_json())
    return workload
