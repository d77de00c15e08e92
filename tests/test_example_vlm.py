"""examples/train_tiny_vlm.py and examples/train_tiny_video.py train, checkpoint, and resume on the same batches and losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from example_helpers import load_example


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")
@pytest.mark.parametrize(
    ("stem", "data"),
    [("train_tiny_vlm", ["--images", "32"]), ("train_tiny_video", ["--videos", "8"])],
    ids=["images", "video"],
)
def test_a_resumed_run_sees_the_same_batches_and_losses(tmp_path: Path, stem: str, data: list[str]) -> None:
    if stem == "train_tiny_video":
        pytest.importorskip("av")
    example = load_example(stem)
    out = tmp_path / "run"
    args = ["--steps", "4", "--checkpoint-every", "2", *data, "--out", str(out)]
    first = example.main(args)
    assert [r["step"] for r in first] == [0, 1, 2, 3]
    assert (out / "step-000002").is_dir() and (out / "step-000004").is_dir()
    assert first[-1]["loss"] < first[0]["loss"]  # it learns something
    resumed = example.main([*args, "--resume", str(out / "step-000002")])
    assert [r["step"] for r in resumed] == [2, 3]
    assert [r["digest"] for r in resumed] == [r["digest"] for r in first[2:]]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in first[2:]], rel=1e-6)
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2, 3, 2, 3]
