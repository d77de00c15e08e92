"""An explicit per-lane reorder buffer: results arrive in any order and leave in sequence order."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import StageError

T = TypeVar("T")


class ReorderBuffer(Generic[T]):
    """Holds results keyed by sequence number until every earlier one has been taken.

    ``put`` may be called from any thread; ``take`` returns items strictly in order, one
    position at a time (the lane's ordered watermark). A duplicate or an already-taken
    sequence number raises, and so does taking a number that was never submitted (a gap).
    ``clock`` is what ``take``'s timeout is measured on (tests pass a ``ManualClock``).
    """

    def __init__(self, name: str, first: int = 0, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._name = name
        self._clock = clock
        self._next = first
        self._submitted = first
        self._items: dict[int, T] = {}
        self._cond = threading.Condition()

    @property
    def watermark(self) -> int:
        """Every sequence number below this has been delivered."""
        return self._next

    def expect(self) -> int:
        """Reserves and returns the next sequence number a producer will ``put``."""
        with self._cond:
            seq = self._submitted
            self._submitted += 1
            return seq

    def put(self, seq: int, item: T) -> None:
        with self._cond:
            if seq < self._next or seq in self._items:
                raise StageError(f"{self._name}: duplicate result for sequence number {seq}")
            if seq >= self._submitted:
                raise StageError(f"{self._name}: result for sequence number {seq} that was never submitted")
            self._items[seq] = item
            self._cond.notify_all()

    def take(self, timeout: float | None = None) -> T:
        """Waits for and returns the item at the watermark, advancing it by one."""
        with self._cond:
            if self._next >= self._submitted:
                raise StageError(f"{self._name}: gap, sequence number {self._next} was never submitted")
            deadline = None if timeout is None else self._clock.now() + timeout
            while self._next not in self._items:
                left = None if deadline is None else deadline - self._clock.now()
                if left is not None and left <= 0:
                    raise StageError(
                        f"{self._name}: timed out after {timeout:g} s waiting for sequence number {self._next}"
                    )
                if left is None:
                    self._cond.wait()
                else:
                    self._clock.wait(self._cond, left)
            item = self._items.pop(self._next)
            self._next += 1
            return item

    def in_flight(self) -> int:
        with self._cond:
            return self._submitted - self._next
