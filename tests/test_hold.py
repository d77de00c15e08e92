"""The one rule for held steps and the one store of them (engine/hold.py), as the server's and
the owners' holds use them."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from zephon_flow.core.clock import ManualClock
from zephon_flow.engine.hold import StepHold, StepStore


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


def _store(clock: ManualClock, **kw: int) -> StepStore[str, str]:
    return StepStore(first_step=5, first_state="at 5", ahead=2, keep=1, clock=clock, size=len, **kw)


def test_a_store_holds_contents_and_states_under_the_rule_and_waits_on_the_clock() -> None:
    clock = ManualClock()
    store = _store(clock)
    store.rule.expected = {0: 5}
    made = []
    while store.wait_for_room(stopped=lambda: True):  # production stops where it must wait
        made.append(store.add(f"step {store.produced}", f"at {store.produced + 1}"))
    assert made == [5, 6] and clock.waited == 0  # ahead=2 of the expected reader at 5
    assert (store.get(6), store.state(7), store.state(5), store.held_bytes) == ("step 6", "at 7", "at 5", 12)
    # A reader waits for a step that will not come within its timeout: on the clock, no sleep.
    assert not store.wait_for_step(7, timeout=30) and clock.waited == pytest.approx(30)
    assert store.wait_for_step(6, timeout=30) and clock.waited == pytest.approx(30)
    assert not store.wait_for_step(7, timeout=1e9, active=lambda: False)  # the reader's call ended
    store.rule.advance(0, 7)
    assert list(store.release()) == [5] and store.state(5) is None and store.held_bytes == 6
    with pytest.raises(KeyError):
        store.get(5)
    polls: list[float] = []

    def stop_at_the_third_look() -> bool:
        polls.append(clock.now())
        return len(polls) > 2

    store.rule.advance(0, 8)  # room by the rule; a user's own hold (blocked) keeps it waiting
    assert not store.wait_for_room(stop_at_the_third_look, blocked=lambda: True)
    assert [round(b - a, 6) for a, b in itertools.pairwise(polls)] == [0.2, 0.2]  # its poll


def test_a_store_that_finished_ends_every_wait_and_says_why() -> None:
    store = _store(ManualClock())
    failure = RuntimeError("a DoFn raised")
    store.finish(failure)
    assert not store.wait_for_step(5, timeout=None) and store.ended and store.error is failure


def test_a_byte_bound_lets_steps_behind_the_slowest_reader_go_first() -> None:
    """``max_bytes`` of 16 with steps of 6 bytes: production stops where one more step would
    pass it, makes room by letting go of the oldest steps the reader has passed (before
    ``keep`` would), and always makes the step the reader needs next."""
    store: StepStore[str, str] = StepStore(
        first_step=5, first_state="s", ahead=3, keep=1, max_bytes=16, size=len, clock=ManualClock()
    )
    store.rule.place(0, 5)

    def fill() -> list[int]:
        made = []
        while store.wait_for_room(stopped=lambda: True):
            made.append(store.add("abcdef", "s"))
        return made

    assert fill() == [5, 6] and store.advised_ahead() == 2  # ahead=3, but 3 steps are 18 bytes
    store.rule.advance(0, 6)
    assert fill() == [7] and store.low == 6  # step 5 went (keep=1 would have held it)
    store.rule.advance(0, 8)
    # Steps 6 and 7 go as 8 and 9 are made; the reader's own step 8 stays.
    assert fill() == [8, 9] and store.low == 8 and store.held_bytes == 12
    with pytest.raises(
        ValueError, match=r"max_bytes must be >= 1 \(or None\), with a size of contents, got 0"
    ):
        StepStore(first_step=0, first_state=None, ahead=1, keep=0, max_bytes=0, size=len)
