"""examples/video.py: its spec over videos it synthesises gives packed clips, and resumes on the same batches."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import zephon_flow as zf
from zephon_flow.engine.simulate import global_digests

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "video.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("video_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["video_example"] = module  # its caption_ids is pickled to worker processes
    spec.loader.exec_module(module)
    return module


def test_the_example_packs_captioned_clips_and_resumes(example: ModuleType, tmp_path: Path) -> None:
    pattern = example.make_videos(tmp_path, 3, frames=24, width=48, height=32)
    spec = example.spec(pattern)
    loader = zf.Loader(spec, rank=0, world_size=1)
    try:
        step, batch = next(iter(loader))
    finally:
        loader.close()
    assert step == 0
    assert batch["videos"].shape == (8, 3, 4, 32, 32, 3) and batch["videos"].dtype == np.uint8
    ids = batch["input_ids"][0]
    assert ids[:16].tolist() == [1] * 16 and ids[16] >= 2  # 4 frames x 4 placeholders, then the caption
    reference = global_digests(spec, steps=3)
    final: list[dict[str, Any]] = []
    first = global_digests(spec, steps=1, final_state=final)
    rest = global_digests(
        spec,
        steps=2,
        state=zf.encode_state(zf.LoaderState.from_plain(final[0])),
        world_size=2,
        backend="threads",
    )
    assert first + rest == reference
