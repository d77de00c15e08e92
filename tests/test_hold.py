"""The one rule for held steps (engine/hold.py), as the server's and the owners' holds use it."""

from __future__ import annotations

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
