"""Elastic determinism of the video pipeline: clips planned from the index, decoded by seeking, packed.

Every run is compared, digest by digest, with one uninterrupted single-rank inline run.
"""

from __future__ import annotations

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
