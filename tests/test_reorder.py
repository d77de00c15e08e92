"""Tests of the per-lane reorder buffer: in-order delivery, duplicates, gaps, threads."""

from __future__ import annotations

import random
import threading

import pytest

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock, ManualClock
from zephon_flow.core.errors import StageError
from zephon_flow.runners.reorder import ReorderBuffer


def submitted(n: int, first: int = 0, clock: Clock = SYSTEM_CLOCK) -> ReorderBuffer[str]:
    buf: ReorderBuffer[str] = ReorderBuffer("lane 3 results", first=first, clock=clock)
    assert [buf.expect() for _ in range(n)] == list(range(first, first + n))
    return buf


def test_out_of_order_puts_come_out_in_order() -> None:
    buf = submitted(5)
    for seq in (3, 1, 4, 0, 2):
        buf.put(seq, f"item {seq}")
    assert buf.in_flight() == 5
    assert [buf.take(timeout=1) for _ in range(5)] == [f"item {i}" for i in range(5)]
    assert buf.watermark == 5 and buf.in_flight() == 0


def test_the_watermark_moves_one_position_at_a_time() -> None:
    clock = ManualClock()
    buf = submitted(3, first=10, clock=clock)
    buf.put(12, "c")
    buf.put(10, "a")
    assert buf.take(timeout=1) == "a" and buf.watermark == 11
    with pytest.raises(
        StageError, match=r"lane 3 results: timed out after 30 s waiting for sequence number 11"
    ):
        buf.take(timeout=30)  # 12 is there, but 11 is not
    assert buf.watermark == 11 and clock.waited == 30  # on the manual clock: no real wait
    buf.put(11, "b")
    assert [buf.take(timeout=1), buf.take(timeout=1)] == ["b", "c"]


def test_a_duplicate_put_is_refused() -> None:
    buf = submitted(2)
    buf.put(1, "x")
    with pytest.raises(StageError, match=r"lane 3 results: duplicate result for sequence number 1"):
        buf.put(1, "y")
    buf.put(0, "w")
    assert buf.take(timeout=1) == "w"
    with pytest.raises(StageError, match=r"duplicate result for sequence number 0"):
        buf.put(0, "again")  # already taken
    assert buf.take(timeout=1) == "x"


def test_a_put_that_was_never_submitted_is_refused() -> None:
    buf = submitted(2)
    with pytest.raises(
        StageError, match=r"lane 3 results: result for sequence number 2 that was never submitted"
    ):
        buf.put(2, "z")


def test_taking_past_the_submitted_numbers_is_a_gap() -> None:
    buf = submitted(1)
    buf.put(0, "a")
    assert buf.take(timeout=1) == "a"
    with pytest.raises(StageError, match=r"lane 3 results: gap, sequence number 1 was never submitted"):
        buf.take(timeout=1)


def test_producer_threads_in_any_order_feed_an_ordered_consumer() -> None:
    n, producers = 400, 4
    buf = submitted(n)
    order = list(range(n))
    random.Random(0).shuffle(order)
    shares = [order[i::producers] for i in range(producers)]

    def produce(seqs: list[int]) -> None:
        for seq in seqs:
            buf.put(seq, f"item {seq}")

    threads = [threading.Thread(target=produce, args=(share,)) for share in shares]
    for t in threads:
        t.start()
    got = [buf.take(timeout=10) for _ in range(n)]
    for t in threads:
        t.join()
    assert got == [f"item {i}" for i in range(n)]
