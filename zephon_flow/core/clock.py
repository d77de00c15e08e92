"""The clock every wait and timeout reads: the system's, or a manual one that tests move."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds, and waiting on a condition (held by the caller) for at most a while."""

    def now(self) -> float: ...

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        """Releases ``cond`` until notified or ``seconds`` pass, then holds it again."""
        ...

    def sleep(self, seconds: float) -> None: ...

    def on_move(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Has ``wake`` called each time the clock jumps (a manual clock's ``advance``), so a
        thread that must also wait on something else (a pipe, a queue) and looks at the clock
        between those waits looks again at once; returns the function that stops the calls."""
        ...


def _never() -> None:
    """What stops the calls a clock that never jumps never makes."""


class SystemClock:
    """``time.monotonic`` and real waits."""

    def now(self) -> float:
        return time.monotonic()

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        cond.wait(seconds)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def on_move(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Never calls ``wake``: its time passes by itself, and waiters bound their waits."""
        return _never


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only when told (``advance``) or when something waits on it: a wait
    of ``s`` seconds returns at once with the clock ``s`` later, so timeouts and retry backoffs
    happen without sleeping and the time they took is exact. ``waited`` is the total.

    Every move calls the ``on_move`` functions (in the thread that moves it). The backends'
    deadlines read it that way: a call is stuck for ``chunk_timeout`` once a test has advanced
    the clock that far, whatever real time passed. A clock shared with something that waits on
    it moves those deadlines too."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self._wakes: dict[int, Callable[[], None]] = {}
        self._next_wake = 0
        self.waited = 0.0

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        with self._lock:
            self._now += seconds
            self.waited += seconds
            wakes = list(self._wakes.values())
        for wake in wakes:
            wake()

    def on_move(self, wake: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            key, self._next_wake = self._next_wake, self._next_wake + 1
            self._wakes[key] = wake

        def stop() -> None:
            with self._lock:
                self._wakes.pop(key, None)

        return stop

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        self.advance(seconds)
        cond.wait(0)  # lets other threads take the lock, as a real wait would

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
