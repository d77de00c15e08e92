"""The elastic-determinism contract as reusable tests: every topology and resume point agree.

A test module defines its pipeline as a module-scoped ``spec`` fixture, then takes the shared
tests from here by assignment, e.g.::

    reference = reference_fixture(STEPS)
    test_any_topology_and_resume_points_give_the_reference_batches = any_topology_test(STEPS)

Every run is compared, digest by digest, with one uninterrupted single-rank inline run
(``reference``), carried across resume points as checkpoint bytes of the merged state.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon_flow as zf
from zephon_flow.engine.simulate import global_digests

BATCH = 12
WORLD_SIZES = [w for w in range(1, BATCH + 1) if BATCH % w == 0]  # 1, 2, 3, 4, 6, 12 (> 4 lanes)
Digests = list[tuple[int, str]]


@dataclass(frozen=True)
class Segment:
    """One stretch of a run on one topology."""

    world_size: int
    backend: str
    workers: int
    prefetch: int
    chunk_records: int
    prefetch_chunks: int

    def options(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "backend": self.backend,
            "workers": self.workers,
            "prefetch": self.prefetch,
            "chunk_records": self.chunk_records,
            "prefetch_chunks": self.prefetch_chunks,
        }


segments = st.builds(
    Segment,
    world_size=st.sampled_from(WORLD_SIZES),
    backend=st.sampled_from(["inline", "threads"]),
    workers=st.integers(1, 3),
    prefetch=st.integers(1, 3),
    chunk_records=st.integers(1, 20),
    prefetch_chunks=st.integers(1, 4),
)


def run_in_segments(spec: zf.LoaderSpec, steps: int, cuts: list[int], plan: list[Segment]) -> Digests:
    """Runs ``steps`` batches, stopping after each of ``cuts`` batches and resuming on the next
    segment's topology from the merged state, carried as checkpoint bytes."""
    bounds = [0, *cuts, steps]
    digests: Digests = []
    state: bytes | None = None
    for (start, stop), seg in zip(itertools.pairwise(bounds), plan, strict=False):
        final: list[dict[str, Any]] = []
        got = global_digests(spec, steps=stop - start, state=state, final_state=final, **seg.options())
        assert [s for s, _ in got] == list(range(start, stop))
        digests += got
        state = zf.encode_state(zf.LoaderState.from_plain(final[0]))
    return digests


def reference_digests(
    spec: zf.LoaderSpec, steps: int, final_state: list[dict[str, Any]] | None = None
) -> Digests:
    """The uninterrupted single-rank inline run; its batches must all differ, or a test
    comparing them could not see a shifted or repeated batch."""
    ref = global_digests(spec, steps=steps, final_state=final_state)
    assert len(ref) == steps and len({d for _, d in ref}) == steps
    return ref


def reference_fixture(steps: int) -> Any:
    """A module-scoped ``reference`` fixture over the module's ``spec`` fixture."""

    @pytest.fixture(scope="module")
    def reference(spec: zf.LoaderSpec) -> Digests:
        return reference_digests(spec, steps)

    return reference


def any_topology_test(steps: int, *, examples: int = 8, resumes: int = 3) -> Callable[..., None]:
    """Hypothesis: up to ``resumes`` random resume points, each stretch on a random topology."""

    @settings(max_examples=examples, deadline=None)
    @given(
        cuts=st.lists(st.integers(1, steps - 1), max_size=resumes, unique=True).map(sorted),
        plan=st.lists(segments, min_size=resumes + 1, max_size=resumes + 1),
    )
    def test(spec: zf.LoaderSpec, reference: Digests, cuts: list[int], plan: list[Segment]) -> None:
        assert run_in_segments(spec, steps, cuts, plan) == reference

    return test


def world_sizes_test(steps: int, world_sizes: list[int]) -> Callable[..., None]:
    """Each of ``world_sizes`` on two threads gives the reference batches."""

    @pytest.mark.parametrize("world_size", world_sizes)
    def test(spec: zf.LoaderSpec, reference: Digests, world_size: int) -> None:
        got = global_digests(spec, steps=steps, world_size=world_size, backend="threads", workers=2)
        assert got == reference

    return test


def resume_test(steps: int, cut: int, plan: list[Segment], *, slow: bool = False) -> Callable[..., None]:
    """One fixed resume at ``cut`` across the two segments of ``plan`` (e.g. threads -> processes)."""

    def test(spec: zf.LoaderSpec, reference: Digests) -> None:
        assert run_in_segments(spec, steps, [cut], plan) == reference

    return pytest.mark.slow(test) if slow else test
