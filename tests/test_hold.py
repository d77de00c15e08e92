"""The one rule for held steps (engine/hold.py), as the server's and the owners' holds use it."""

from __future__ import annotations

from pathlib import Path

import pytest

from zephon_flow.engine.hold import StepHold


def test_production_counts_ahead_from_the_slowest_reader_and_keeps_behind_it() -> None:
    hold = StepHold(first_step=10, ahead=3, keep=1)
    hold.expected = {0: 10, 1: 12}
    made = []
    while hold.has_room():
        made.append(hold.add())
    assert made == [10, 11, 12]  # ahead of the slowest expected reader, 10
    assert list(hold.release()) == []  # reader 0 still may ask for 10
    assert hold.advance(0, 12) and not hold.advance(0, 11)  # forward only
    assert hold.slowest() == 12 and hold.retained() == 12  # reader 1 is still expected at 12
    assert list(hold.release()) == [10] and hold.low == 11  # keep=1 behind 12
    hold.place(0, 11)  # a reconnect moves a reader back; 11 is still held
    assert hold.slowest() == 11 and list(hold.release()) == []
    assert hold.let_go_oldest() == 11 and hold.low == 12


def test_nothing_is_let_go_before_a_reader_comes() -> None:
    hold = StepHold(first_step=0, ahead=4, keep=0)
    while hold.has_room():
        hold.add()
    assert hold.produced == 4 and list(hold.release()) == [] and hold.low == 0


@pytest.mark.parametrize(("ahead", "keep"), [(0, 1), (1, -1)])
def test_bad_bounds_are_refused(ahead: int, keep: int) -> None:
    with pytest.raises(
        ValueError, match=rf"ahead must be >= 1 and keep >= 0, got ahead={ahead}, keep={keep}"
    ):
        StepHold(first_step=0, ahead=ahead, keep=keep)


def test_a_floor_keeps_the_runs_slowest_step_and_bounds_production_past_it() -> None:
    """A lane owner's only reader runs ahead of the run's slowest rank (at the floor, 2): the
    floor's step stays held for a checkpoint, and production stops ``reach`` past it."""
    hold = StepHold(first_step=0, ahead=4, keep=1)
    assert hold.raise_floor(2, reach=10) and not hold.raise_floor(1, reach=10)  # forward only
    hold.place(0, 0)
    made = []
    while True:
        while hold.has_room():
            made.append(hold.add())
        if not hold.advance(0, hold.produced):  # the reader takes all that is made
            break
        hold.release()
    assert made == list(range(12))  # 2 + reach: its reader alone would let it go on
    assert hold.retained() == 2 and hold.low == 1  # keep=1 behind the floor, not the reader
    assert hold.raise_floor(8, reach=10) and hold.has_room()
    assert list(hold.release()) == list(range(1, 7))
    with pytest.raises(ValueError, match="a floor's reach must be at least ahead=4, got 3"):
        hold.raise_floor(9, reach=3)


def test_pruning_keeps_the_newest_checkpoints_and_drops_parts_no_manifest_names(tmp_path: Path) -> None:
    """Lane owners write a checkpoint's parts before its manifest: parts whose manifest was
    never written (the server stopped during the write) are dropped once a newer manifest
    exists; the newest write's parts, still without one, are left."""
    from zephon_flow.service.server import prune_checkpoints

    for step in (10, 20, 30):
        (tmp_path / f"step-{step}.zfstate").write_bytes(b"m")
        (tmp_path / f"step-{step}.zfstate.parts").mkdir()
    for step in (15, 40):  # written without their manifest
        (tmp_path / f"step-{step}.zfstate.parts").mkdir()
    (tmp_path / "notes.txt").write_text("left alone")
    prune_checkpoints(str(tmp_path), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt",
        "step-20.zfstate",
        "step-20.zfstate.parts",
        "step-30.zfstate",
        "step-30.zfstate.parts",
        "step-40.zfstate.parts",
    ]
