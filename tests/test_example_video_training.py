"""examples/train_tiny_video.py trains on examples/video.py's pipeline, checkpoints, and resumes on the same batches and losses."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("av")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_tiny_video.py"


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_tiny_video", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny_video"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")
def test_a_resumed_video_run_sees_the_same_batches_and_losses(tmp_path: Path) -> None:
    video = example()
    out = tmp_path / "run"
    args = ["--steps", "4", "--checkpoint-every", "2", "--videos", "8", "--out", str(out)]
    first = video.main(args)
    assert [r["step"] for r in first] == [0, 1, 2, 3]
    assert (out / "step-000002").is_dir() and (out / "step-000004").is_dir()
    assert len(list((out / "videos").glob("*.mp4"))) == 8
    assert first[-1]["loss"] < first[0]["loss"]  # it learns something
    resumed = video.main([*args, "--resume", str(out / "step-000002")])
    assert [r["step"] for r in resumed] == [2, 3]
    assert [r["digest"] for r in resumed] == [r["digest"] for r in first[2:]]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in first[2:]], rel=1e-6)
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2, 3, 2, 3]
