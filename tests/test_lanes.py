"""Tests of lane, window and rank-slice arithmetic, and of the refusals of bad geometry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon_flow as zf
from zephon_flow.core.errors import SpecError
from zephon_flow.core.lanes import RankSlice, check_batch_geometry


def rs(rank: int, world_size: int, lanes: int, batch: int) -> RankSlice:
    return RankSlice(rank=rank, world_size=world_size, lanes=lanes, global_batch_size=batch)


def test_ranks_aligned_with_lanes() -> None:
    s = rs(1, 2, 4, 8)
    assert (s.per_lane, s.per_rank, s.start, s.stop) == (2, 4, 4, 8)
    assert s.lane_ids == range(2, 4)
    assert s.rows_of_lanes() == slice(0, 4)


def test_a_rank_straddling_lane_boundaries() -> None:
    # L=4, B=12: windows of 3 rows; W=3: ranks of 4 rows.
    s = rs(1, 3, 4, 12)
    assert (s.start, s.stop) == (4, 8)
    assert s.lane_ids == range(1, 3)  # rows 3..5 and 6..8
    assert s.rows_of_lanes() == slice(1, 5)


def test_more_ranks_than_lanes_share_lanes() -> None:
    # W=8 > L=4, B=8: two ranks per lane, one row each.
    slices = [rs(r, 8, 4, 8) for r in range(8)]
    assert [s.lane_ids for s in slices] == [range(r // 2, r // 2 + 1) for r in range(8)]
    assert [s.rows_of_lanes() for s in slices] == [slice(r % 2, r % 2 + 1) for r in range(8)]


def test_a_single_rank_runs_every_lane() -> None:
    s = rs(0, 1, 16, 256)
    assert s.lane_ids == range(16) and s.rows_of_lanes() == slice(0, 256)


@settings(max_examples=200, deadline=None)
@given(lanes=st.integers(1, 12), per_lane=st.integers(1, 6), data=st.data())
def test_rank_slices_tile_the_global_batch(lanes: int, per_lane: int, data: st.DataObject) -> None:
    batch = lanes * per_lane
    world = data.draw(st.sampled_from([w for w in range(1, batch + 1) if batch % w == 0]))
    rows = list(range(batch))  # global row i belongs to lane i // per_lane
    assembled = []
    for rank in range(world):
        s = rs(rank, world, lanes, batch)
        windows = [row for lane in s.lane_ids for row in rows[lane * per_lane : (lane + 1) * per_lane]]
        mine = windows[s.rows_of_lanes()]
        assert mine == rows[s.start : s.stop]
        # Exactly the lanes whose windows intersect the rank's rows.
        assert list(s.lane_ids) == [
            ln for ln in range(lanes) if ln * per_lane < s.stop and (ln + 1) * per_lane > s.start
        ]
        assembled += mine
    assert assembled == rows


# -- refusals -------------------------------------------------------------------------------
def test_batch_not_a_multiple_of_lanes_is_refused() -> None:
    with pytest.raises(
        SpecError, match=r"global_batch_size=10 is not a multiple of lanes=4: .*choose a batch size such as 8"
    ):
        check_batch_geometry(lanes=4, global_batch_size=10)
    with pytest.raises(SpecError, match=r"global_batch_size=10 is not a multiple of lanes=4"):
        zf.LoaderSpec(lambda p: p, lanes=4, global_batch_size=10)


def test_batch_not_divisible_by_world_size_is_refused() -> None:
    with pytest.raises(
        SpecError,
        match=r"global_batch_size=12 is not divisible by world_size=5: every rank must get the same number of rows",
    ):
        rs(0, 5, 4, 12)


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 2), (0, 0)])
def test_rank_out_of_range_is_refused(rank: int, world: int) -> None:
    message = (
        r"world_size must be a positive integer, got 0"
        if world == 0
        else rf"rank must be in \[0, {world}\), got {rank}"
    )
    with pytest.raises(SpecError, match=message):
        rs(rank, world, 4, 8)


@pytest.mark.parametrize(
    ("lanes", "batch", "message"),
    [
        (0, 8, r"lanes must be a positive integer, got 0"),
        (2.0, 8, r"lanes must be a positive integer, got 2.0"),
        (2, 0, r"global_batch_size must be a positive integer, got 0"),
    ],
)
def test_bad_lanes_or_batch_size_are_refused(lanes: object, batch: object, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        check_batch_geometry(lanes=lanes, global_batch_size=batch)  # type: ignore[arg-type]


def test_loader_refuses_a_topology_before_any_work() -> None:
    def build(p):  # type: ignore[no-untyped-def]
        raise AssertionError("the graph must not be built for a refused topology")

    spec = zf.LoaderSpec(build, lanes=4, global_batch_size=8)
    with pytest.raises(SpecError, match=r"rank must be in \[0, 2\), got 3"):
        zf.Loader(spec, rank=3, world_size=2)
    with pytest.raises(SpecError, match=r"not divisible by world_size=3"):
        zf.Loader(spec, rank=0, world_size=3)
