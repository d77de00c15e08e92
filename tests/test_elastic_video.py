"""Elastic determinism of the video pipeline: clips planned from the index, decoded by seeking, packed.

Every run is compared, digest by digest, with one uninterrupted single-rank inline run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from elastic import BATCH, Segment, any_topology_test, reference_fixture, resume_test, world_sizes_test
from helpers import Corpus
from video_helpers import video_spec, write_videos

import zephon_flow as zf
from zephon_flow.engine.simulate import global_digests

LANES, STEPS = 4, 4


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory, corpus: Corpus) -> zf.LoaderSpec:
    videos = write_videos(tmp_path_factory.mktemp("video"), 6)
    return video_spec(videos, corpus.tokenizer_json, lanes=LANES, global_batch_size=BATCH)


reference = reference_fixture(STEPS)
test_any_topology_and_resume_points_give_the_reference_batches = any_topology_test(
    STEPS, examples=3, resumes=2
)
test_world_sizes_give_the_reference_batches = world_sizes_test(STEPS, [3, 12])
test_processes_backend_resumes_a_threads_run = resume_test(
    STEPS, 2, [Segment(6, "threads", 2, 2, 3, 2), Segment(4, "processes", 2, 2, 4, 3)]
)


def test_two_seeds_give_different_batches(
    spec: zf.LoaderSpec,
    reference: list[tuple[int, str]],
    tmp_path_factory: pytest.TempPathFactory,
    corpus: Corpus,
) -> None:
    videos = write_videos(tmp_path_factory.mktemp("video_seed"), 6)
    other = video_spec(videos, corpus.tokenizer_json, lanes=LANES, global_batch_size=BATCH, seed=1)
    digests = global_digests(other, steps=STEPS)
    assert all(a != b for a, b in zip(digests, reference, strict=True))


def damaged_videos(root: Path) -> str:
    """Four videos, the second with bytes garbled in the middle of its frame data: listing
    (packet headers) accepts it, decoding two of its clips fails."""
    pattern = write_videos(root, 4)
    path = root / "v001.mp4"
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 200):
        data[i] = (data[i] * 7 + 13) % 256
    path.write_bytes(bytes(data))
    return pattern


def test_damaged_clips_are_skipped_alike_on_every_topology(tmp_path: Path, corpus: Corpus) -> None:
    pattern = damaged_videos(tmp_path)
    skipping = video_spec(
        pattern, corpus.tokenizer_json, lanes=LANES, global_batch_size=BATCH, on_error="skip"
    )
    first = global_digests(skipping, steps=3)
    assert global_digests(skipping, steps=3, world_size=3, backend="threads", workers=2) == first
    assert global_digests(skipping, steps=3, world_size=2, backend="processes", workers=2) == first
    raising = video_spec(pattern, corpus.tokenizer_json, lanes=LANES, global_batch_size=BATCH)
    with pytest.raises(zf.ZephonError, match=r"DecodeVideo: cannot decode clip \d \(.*\) of .*v001.mp4"):
        global_digests(raising, steps=3)
