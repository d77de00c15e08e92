"""The video pipeline on Beam's own runners (the project's Beam translation): the Loader's batches.

``ReadVideo -> DecodeVideo -> TokenizeField -> PackVideo`` over videos synthesised here, run
through ``zephon materialize``'s translation on ``FnApiRunner`` and ``DirectRunner``, each global
batch's digest compared with the embedded ``Loader``'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Corpus, run_batches
from video_helpers import make_video, video_spec, write_videos

import zephon_flow as zf
from zephon_flow.core.batches import batch_digest
from zephon_flow.core.errors import DataError
from zephon_flow.engine.materialize import materialize, read_materialized


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))


def loader_digests(spec: zf.LoaderSpec, steps: int | None = None) -> list[str]:
    return [batch_digest(b) for b in run_batches(spec, steps)]


def beam_digests(
    spec: zf.LoaderSpec, out: Path, steps: int, *, runner: str = "FnApiRunner", passes: int = 1
) -> list[str]:
    materialize(spec, steps=steps, out=str(out), runner=runner, passes=passes)
    return [batch_digest(b) for _, b in read_materialized(str(out))]


def test_a_finite_video_pipeline_on_fnapirunner_gives_the_loaders_batches(
    tmp_path: Path, corpus: Corpus
) -> None:
    pattern = write_videos(tmp_path / "videos", 5)
    make_video(tmp_path / "videos" / "v005.mp4", 48, seed=9, rotation=90)  # a phone video, on its side
    (tmp_path / "videos" / "v005.txt").write_text("turned upright")
    spec = video_spec(pattern, corpus.tokenizer_json, lanes=4, global_batch_size=4, epochs=1)
    expected = loader_digests(spec)
    assert len(expected) >= 3
    got = beam_digests(spec, tmp_path / "out", steps=100)  # a finite stream ends where the Loader's does
    assert got == expected


def test_random_windows_over_passes_on_directrunner_give_the_loaders_batches(
    tmp_path: Path, corpus: Corpus
) -> None:
    # Each pass draws other windows (the source learns the pass through the translation's reader).
    pattern = write_videos(tmp_path / "videos", 6)
    spec = video_spec(pattern, corpus.tokenizer_json, lanes=2, global_batch_size=2, window="random")
    expected = loader_digests(spec, 8)
    assert beam_digests(spec, tmp_path / "out", steps=8, runner="DirectRunner", passes=3) == expected


def damaged(root: Path) -> str:
    """Four videos, the second garbled in the middle of its frame data (listing accepts it)."""
    pattern = write_videos(root, 4)
    path = root / "v001.mp4"
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 200):
        data[i] = (data[i] * 7 + 13) % 256
    path.write_bytes(bytes(data))
    return pattern


def test_damaged_clips_on_beam_are_skipped_as_the_loader_skips_them_or_named(
    tmp_path: Path, corpus: Corpus
) -> None:
    pattern = damaged(tmp_path / "videos")
    skipping = video_spec(
        pattern, corpus.tokenizer_json, lanes=2, global_batch_size=2, epochs=1, on_error="skip"
    )
    expected = loader_digests(skipping)
    assert beam_digests(skipping, tmp_path / "out", steps=100) == expected
    raising = video_spec(pattern, corpus.tokenizer_json, lanes=2, global_batch_size=2, epochs=1)
    with pytest.raises(DataError, match=r"DecodeVideo: cannot decode clip \d \(.*\) of .*v001.mp4"):
        materialize(raising, steps=100, out=str(tmp_path / "raised"))
