"""The server's held global batches: back-pressure in steps and bytes, retention for reconnects,
topology changes, timeouts on a manual clock."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from zephon_flow.core.clock import ManualClock
from zephon_flow.service.held import HeldSteps, HeldStepsError


def _batch(step: int) -> dict[str, np.ndarray]:
    return {"step": np.asarray([step])}


def _state(step: int) -> dict[str, int]:
    return {"step": step}


pytestmark = pytest.mark.timeout(30)


def _fill(window: HeldSteps[dict[str, int]]) -> int:
    """Produces until production has to wait; returns how many steps were added."""
    added = 0
    while window.wait_for_room(stopped=lambda: True):
        produced = window.status().produced
        window.add(_batch(produced), _state(produced + 1))
        added += 1
    return added


def _never() -> bool:
    return False


def _read(
    window: HeldSteps[dict[str, int]], step: int, rank: int = 0, world_size: int = 1
) -> np.ndarray | None:
    """Rank ``rank``'s stream taking ``step`` without waiting: its batch's ``step`` field."""
    batch = window.take(rank, world_size, step, _never)
    return None if batch is None else batch["step"]


def test_production_stops_ahead_steps_past_the_slowest_rank() -> None:
    window = HeldSteps(first_step=0, first_state=_state(0), ahead=3, keep=1)
    assert _fill(window) == 3
    window.join(0, 2, 0)
    window.join(1, 2, 0)
    assert _fill(window) == 0
    # Rank 0 moving on is not enough: rank 1 (the slowest) holds production back.
    window.ack(0, 2, 2)
    assert _fill(window) == 0
    window.ack(1, 2, 1)
    assert _fill(window) == 1
    assert window.status().produced == 4


def test_a_rank_not_yet_connected_holds_production_back() -> None:
    window = HeldSteps(first_step=0, first_state=_state(0), ahead=2, keep=0)
    window.join(0, 2, 0)
    _fill(window)
    window.ack(0, 2, 2)
    assert _fill(window) == 0  # rank 1 of 2 has not asked for step 0 yet


def test_steps_up_to_keep_behind_the_slowest_rank_are_served_again() -> None:
    window = HeldSteps(first_step=0, first_state=_state(0), ahead=4, keep=2)
    window.join(0, 1, 0)
    _fill(window)
    window.ack(0, 1, 3)
    got = _read(window, 3)
    assert got is not None and int(got[0]) == 3
    got = _read(window, 1)  # a reconnect from an earlier step gets the same bytes
    assert got is not None and int(got[0]) == 1
    with pytest.raises(
        HeldStepsError, match=r"step 0 is no longer held: the server holds steps \[1, 4\)"
    ) as info:
        _read(window, 0)
    assert info.value.code == "OUT_OF_RANGE"
    with pytest.raises(HeldStepsError, match="step 0 is no longer held"):
        window.join(0, 1, 0)


def test_the_world_size_changes_only_when_no_rank_is_connected() -> None:
    window = HeldSteps(first_step=5, first_state=_state(5), ahead=4, keep=2)
    window.join(0, 2, 5)
    with pytest.raises(HeldStepsError, match=r"serving world_size=2 \(ranks \[0\] connected\)") as info:
        window.join(0, 4, 5)
    assert info.value.code == "FAILED_PRECONDITION"
    window.leave(0, 2)
    window.join(3, 4, 5)
    assert window.status().positions == {0: 5, 1: 5, 2: 5, 3: 5}


def test_a_start_step_too_far_ahead_is_refused() -> None:
    window = HeldSteps(first_step=0, first_state=_state(0), ahead=3, keep=1)
    with pytest.raises(
        HeldStepsError, match="step 4 is too far ahead: the server holds steps \\[0, 0\\)"
    ) as info:
        window.join(0, 1, 4)
    assert info.value.code == "OUT_OF_RANGE"
    window.join(0, 1, 3)  # within reach: produced and skipped over
    assert _fill(window) == 6
    window.join(0, 1, 3)
    assert window.status().low == 2


def test_state_for_each_held_step_and_refusals() -> None:
    window = HeldSteps(first_step=10, first_state=_state(10), ahead=2, keep=1)
    window.join(0, 1, 10)
    _fill(window)
    assert window.state_for(10, timeout=1) == {"step": 10}
    assert window.state_for(12, timeout=1) == {"step": 12}
    with pytest.raises(
        HeldStepsError, match="step 13 is not produced yet and cannot be before the slowest rank"
    ):
        window.state_for(13, timeout=1)
    window.ack(0, 1, 12)
    with pytest.raises(HeldStepsError, match="step 10 is no longer held"):
        window.state_for(10, timeout=1)


def test_end_of_data_and_pipeline_failure() -> None:
    window = HeldSteps(first_step=0, first_state=_state(0), ahead=4, keep=1)
    window.join(0, 1, 0)
    window.add(_batch(0), _state(1))
    window.finish()
    assert _read(window, 0) is not None
    assert _read(window, 1) is None
    with pytest.raises(HeldStepsError, match="step 5 is past the end of the data: the last step is 0"):
        window.join(0, 1, 5)
    failed = HeldSteps(first_step=0, first_state=_state(0))
    failed.finish(RuntimeError("disk on fire"))
    with pytest.raises(HeldStepsError, match="the pipeline failed at step 0: disk on fire") as info:
        failed.take(0, 1, 0, _never)
    assert info.value.code == "INTERNAL"


def test_a_stream_sends_at_most_ahead_steps_past_its_acknowledged_step() -> None:
    window = HeldSteps(first_step=0, first_state=_state(0), ahead=3, keep=0)
    window.join(0, 1, 0)
    _fill(window)
    assert [_read(window, s) is not None for s in range(3)] == [True] * 3
    # Step 3 would be the fourth in flight: the stream waits, here until its client is gone.
    assert window.take(0, 1, 3, _never) is None
    window.ack(0, 1, 1)
    window.add(_batch(3), _state(4))
    assert _read(window, 3) is not None
    status = window.status()
    assert (status.positions, status.sent, status.low) == ({0: 1}, {0: 3}, 1)
    # The state of the acknowledged step is held for a checkpoint, even with keep=0.
    assert window.state_for(1, timeout=1) == {"step": 1}


def test_acknowledgements_move_forward_only_and_are_checked() -> None:
    window = HeldSteps(first_step=0, first_state=_state(0), ahead=3, keep=1)
    window.join(0, 1, 0)
    _fill(window)
    window.ack(0, 1, 2)
    window.ack(0, 1, 1)  # late, from before: ignored
    assert window.status().positions == {0: 2}
    with pytest.raises(HeldStepsError, match=r"rank 0 acknowledged step 3, which was never served") as info:
        window.ack(0, 1, 4)
    assert info.value.code == "OUT_OF_RANGE"
    with pytest.raises(HeldStepsError, match="the server is serving world_size=1, not 2") as info:
        window.ack(1, 2, 1)
    assert info.value.code == "FAILED_PRECONDITION"
    window.join(0, 1, 1)  # a reconnect at an earlier step moves the rank back
    assert window.status().positions == {0: 1}


def test_take_records_sent_waits_for_acks_and_for_production() -> None:
    window = HeldSteps(first_step=0, first_state=_state(0), ahead=3, keep=0)
    window.join(0, 1, 0)
    assert window.take(0, 1, 0, _never) is None  # nothing produced yet and the client is gone
    _fill(window)
    taken = [window.take(0, 1, s, lambda: True) for s in range(3)]
    assert [int(b["step"][0]) for b in taken if b is not None] == [0, 1, 2]
    # Step 3 would be the fourth in flight: it waits, here until its client is gone.
    assert window.take(0, 1, 3, _never) is None
    assert window.status().sent == {0: 3}
    window.ack(0, 1, 1)
    window.add(_batch(3), _state(4))
    got = window.take(0, 1, 3, lambda: True)
    assert got is not None and int(got["step"][0]) == 3
    window.finish()
    window.ack(0, 1, 3)
    assert window.take(0, 1, 4, lambda: True) is None  # the data ended
    assert window.status().sent == {0: 4}


def test_take_refuses_a_released_step_and_reports_a_failed_pipeline() -> None:
    window = HeldSteps(first_step=0, first_state=_state(0), ahead=2, keep=0)
    window.join(0, 1, 0)
    _fill(window)
    window.ack(0, 1, 2)
    with pytest.raises(HeldStepsError, match=r"step 1 is no longer held: the server holds steps \[2, 2\)"):
        window.take(0, 1, 1, lambda: True)
    window.finish(RuntimeError("boom"))
    with pytest.raises(HeldStepsError, match="the pipeline failed at step 2: boom") as info:
        window.take(0, 1, 2, lambda: True)
    assert info.value.code == "INTERNAL"


def _rows(step: int, nbytes: int) -> dict[str, np.ndarray]:
    """A batch of ``nbytes`` bytes whose first element is ``step``."""
    batch = np.zeros(nbytes, dtype=np.uint8)
    batch[0] = step
    return {"step": batch}


def test_held_bytes_bound_production_and_release_kept_steps_first() -> None:
    # 100-byte batches, at most 350 bytes held: three in flight, not the four ``ahead`` allows.
    held = HeldSteps(first_step=0, first_state=_state(0), ahead=4, keep=4, max_bytes=350)
    held.join(0, 1, 0)
    added = 0
    while held.wait_for_room(stopped=lambda: True):
        held.add(_rows(added, 100), _state(added + 1))
        added += 1
    assert (added, held.status().held_bytes) == (3, 300)
    # The rank takes two: steps 0 and 1 would be kept (keep=4) but the bytes need room, so
    # they are released first and production goes on.
    held.ack(0, 1, 2)
    assert held.wait_for_room(stopped=lambda: True)
    held.add(_rows(3, 100), _state(4))
    status = held.status()
    assert (status.low, status.produced, status.held_bytes) == (1, 4, 300)
    with pytest.raises(HeldStepsError, match="step 0 is no longer held"):
        _read(held, 0)
    got = _read(held, 1)  # still within the bytes: kept for a reconnect
    assert got is not None and int(got[0]) == 1


def test_a_batch_larger_than_held_bytes_is_still_made_one_at_a_time() -> None:
    held = HeldSteps(first_step=0, first_state=_state(0), ahead=8, keep=2, max_bytes=10)
    held.join(0, 1, 0)
    assert _fill_rows(held, 100) == 1  # the step the rank needs next is always made
    held.ack(0, 1, 1)
    assert _fill_rows(held, 100) == 1
    assert held.status().held_bytes == 100  # the acknowledged step went, whatever ``keep`` says


def _fill_rows(held: HeldSteps[dict[str, int]], nbytes: int) -> int:
    added = 0
    while held.wait_for_room(stopped=lambda: True):
        produced = held.status().produced
        held.add(_rows(produced, nbytes), _state(produced + 1))
        added += 1
    return added


def test_waits_run_on_the_injected_clock() -> None:
    clock = ManualClock()
    held = HeldSteps(first_step=0, first_state=_state(0), ahead=2, keep=0, clock=clock)
    held.join(0, 1, 0)
    with pytest.raises(HeldStepsError, match=r"step 1 was not produced in 30 s") as info:
        held.state_for(1, timeout=30)
    assert info.value.code == "DEADLINE_EXCEEDED"
    assert clock.waited == pytest.approx(30)  # no real sleep: the test takes milliseconds
    # Waiting for room polls the producer's stop flag on the clock as well.
    _fill(held)
    polls: list[float] = []

    def stop_after_three() -> bool:
        polls.append(clock.now())
        return len(polls) > 3

    assert held.wait_for_room(stop_after_three) is False
    assert [round(b - a, 6) for a, b in itertools.pairwise(polls)] == [0.2, 0.2, 0.2]
