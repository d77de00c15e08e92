"""Unit tests of one lane (``LaneRunner`` and its ``LaneFeed``) on the inline backend: windows and
the short last one of a finite input, snapshots (inside a record too) and their restore, skips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from lane_parts import Lines, Repeat, RunningCount, write_lines

import zephon_flow as zf
from zephon_flow.core.checkpoint.state import FeedCursor, LaneState, SourceCursor
from zephon_flow.core.errors import CorruptStateError
from zephon_flow.runners.backends.inline import InlineBackend
from zephon_flow.runners.lane import LaneFeed, LaneRunner
from zephon_flow.runners.plan import Plan

LANES = 2
WINDOW = 3
SEED = 11


def _plan(tmp_path: Path, values: list[object], **source: Any) -> Plan:
    path = write_lines(tmp_path / "values.txt", values)

    def build(p: beam.Pipeline) -> beam.PCollection:
        numbers = p | "numbers" >> Lines(path, per_split=3, **source)
        pairs = numbers | "rep" >> beam.ParDo(Repeat())
        return pairs | "count" >> beam.ParDo(RunningCount())

    spec = zf.LoaderSpec(build, lanes=LANES, seed=SEED, global_batch_size=LANES * WINDOW)
    return spec.compile()


def _lane(plan: Plan, lane: int, state: LaneState | None = None, step: int = 0, **kw: Any) -> LaneRunner:
    return LaneRunner(
        plan,
        InlineBackend(plan.front_segment()),
        lane=lane,
        lanes=LANES,
        seed=SEED,
        window=WINDOW,
        state=state,
        chunk_records=2,
        depth=2,
        step=step,
        **kw,
    )


def _windows(runner: LaneRunner) -> list[list[Any]]:
    """Windows until the first empty one (the lane's input has ended and nothing is pending)."""
    out = []
    while window := runner.next_window():
        out.append(window)
    return out


def test_a_finite_lane_fills_windows_in_order_then_a_short_one_then_empty(tmp_path: Path) -> None:
    plan = _plan(tmp_path, list(range(20)), epochs=1)
    assert plan.finite
    everything = []
    for lane in range(LANES):
        runner = _lane(plan, lane)
        windows = _windows(runner)
        assert all(len(w) == WINDOW for w in windows[:-1]) and 1 <= len(windows[-1]) <= WINDOW
        outputs = [v for w in windows for v in w]
        assert [count for count, _ in outputs] == list(range(len(outputs)))  # the lane's own state
        everything += [pair for _, pair in outputs]
        assert runner.next_window() == [] and runner.next_window() == []
        assert runner.snapshot().ended
    # every record's outputs, each once, across the lanes
    assert sorted(everything) == [(n, k) for n in range(20) for k in range(n % 3)]


def test_a_restored_snapshot_continues_as_the_uninterrupted_lane(tmp_path: Path) -> None:
    plan = _plan(tmp_path, list(range(20)), epochs=2)
    for lane in range(LANES):
        whole = _windows(_lane(plan, lane))
        inside_a_record = 0
        for k in range(len(whole) + 1):
            head = _lane(plan, lane)
            assert [head.next_window() for _ in range(k)] == whole[:k]
            snapshot = head.snapshot()
            inside_a_record += snapshot.cursor.skip > 0
            restored = LaneState.from_plain(snapshot.to_plain())  # as a checkpoint holds it
            assert _windows(_lane(plan, lane, restored, step=k)) == whole[k:], (lane, k)
        assert inside_a_record > 0  # some windows closed between two outputs of one record


def test_a_snapshot_holds_the_cursor_the_stages_and_the_pending_outputs(tmp_path: Path) -> None:
    plan = _plan(tmp_path, [2, 2, 2, 2], epochs=1)
    runner = _lane(plan, 0)
    assert runner.next_window() == [(0, (2, 0)), (1, (2, 1)), (2, (2, 0))]
    state = runner.snapshot()
    assert state.lane == 0 and not state.ended and state.pending == []
    # inside the second record (line 1), one of its two outputs taken
    assert state.cursor.mix_position == 1 and state.cursor.sources == [SourceCursor(0, 0, 1, 1)]
    assert state.cursor.skip == 1 and state.cursor.source == 0
    assert state.stages["count"].values == {"seen": 3}


def test_a_state_that_does_not_match_the_pipeline_is_refused_by_name(tmp_path: Path) -> None:
    plan = _plan(tmp_path, list(range(6)), epochs=1)
    state = _lane(plan, 1).snapshot()
    state.stages = {}
    with pytest.raises(CorruptStateError) as info:
        _lane(plan, 1, state)
    assert str(info.value) == (
        "state of lane 1 does not match the pipeline: missing stateful stage(s) ['count'] or wrong "
        "number of source cursors (1) or skip counts (1) for 1 source(s)"
    )


def test_skipped_records_are_reported_and_counted(tmp_path: Path) -> None:
    plan = _plan(tmp_path, [1, "bad", 2, 4, "bad", 5], epochs=1, on_error="skip")
    skips: list[tuple[int, str]] = []
    runner = _lane(plan, 0, on_skip=lambda i, m: skips.append((i, m)))
    other = _lane(plan, 1, on_skip=lambda i, m: skips.append((i, m)))
    for lane in (runner, other):
        _windows(lane)
    lines = {f"{tmp_path / 'values.txt'} line {n}" for n in (1, 4)}
    assert sorted(m.split(": ")[1] for _, m in skips) == sorted(lines)
    assert all(i == 0 and m.startswith("Lines('numbers'): ") for i, m in skips)
    assert runner.snapshot().cursor.skipped[0] + other.snapshot().cursor.skipped[0] == 2


def test_the_feed_gives_each_record_with_the_cursors_around_it(tmp_path: Path) -> None:
    plan = _plan(tmp_path, [1, 3, 2, 4], epochs=1)
    feed = LaneFeed(
        plan,
        InlineBackend(plan.front_segment()),
        lane=0,
        lanes=1,
        seed=SEED,
        cursor=FeedCursor(0, [SourceCursor.first()], skipped=[0]),
        mixture=None,
        chunk_records=2,
        depth=2,
        on_skip=lambda i, m: None,
    )
    first = feed.next_record(0)
    assert first is not None and first.outputs == [(1, 0)] and first.before is None
    second = feed.next_record(0)  # line 1 (3) has no outputs: consumed on the way
    assert second is not None and second.outputs == [(2, 0), (2, 1)] and second.start == 0
    assert second.before is not None and second.before.mix_position == 2
    assert second.after.mix_position == 3 and second.after.sources[0] == SourceCursor(0, 0, 3, 3)
    assert feed.cursor.mix_position == 3
