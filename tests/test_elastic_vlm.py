"""Elastic determinism of the vision-language pipeline: decode, resize, caption tokens, multimodal packing.

Every run is compared, digest by digest, with one uninterrupted single-rank inline run.
"""

from __future__ import annotations

import pytest
from helpers import Corpus
from hypothesis import given, settings
from hypothesis import strategies as st
from test_elastic_property import Segment, run_in_segments, segments
from vlm_helpers import vlm_spec, write_captioned_images

import zephon_flow as zf
from zephon_flow.simulate import global_digests

LANES, BATCH, STEPS = 4, 12, 6
WORLD_SIZES = [w for w in range(1, BATCH + 1) if BATCH % w == 0]


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory, corpus: Corpus) -> zf.LoaderSpec:
    images = write_captioned_images(tmp_path_factory.mktemp("vlm"), 30, seed=11)
    return vlm_spec(images, corpus.tokenizer_json, lanes=LANES, global_batch_size=BATCH)


@pytest.fixture(scope="module")
def reference(spec: zf.LoaderSpec) -> list[tuple[int, str]]:
    ref = global_digests(spec, steps=STEPS)
    assert len(ref) == STEPS and len({d for _, d in ref}) == STEPS
    return ref


@settings(max_examples=4, deadline=None)
@given(
    cuts=st.lists(st.integers(1, STEPS - 1), max_size=2, unique=True).map(sorted),
    plan=st.lists(segments, min_size=3, max_size=3),
)
def test_any_topology_and_resume_points_give_the_reference_batches(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]], cuts: list[int], plan: list[Segment]
) -> None:
    assert run_in_segments(spec, STEPS, cuts, plan) == reference


@pytest.mark.parametrize("world_size", [2, 3, 12])
def test_world_sizes_give_the_reference_batches(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]], world_size: int
) -> None:
    assert global_digests(spec, steps=STEPS, world_size=world_size, backend="threads", workers=2) == reference


def test_processes_backend_resumes_a_threads_run(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    plan = [Segment(6, "threads", 2, 2, 3, 2), Segment(4, "processes", 2, 2, 4, 3)]
    assert run_in_segments(spec, STEPS, [2], plan) == reference


def test_two_seeds_give_different_batches(
    spec: zf.LoaderSpec,
    reference: list[tuple[int, str]],
    tmp_path_factory: pytest.TempPathFactory,
    corpus: Corpus,
) -> None:
    images = write_captioned_images(tmp_path_factory.mktemp("vlm_seed"), 30, seed=11)
    other = vlm_spec(images, corpus.tokenizer_json, lanes=LANES, global_batch_size=BATCH, seed=1)
    digests = global_digests(other, steps=STEPS)
    assert all(a != b for a, b in zip(digests, reference, strict=True))
