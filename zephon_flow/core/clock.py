"""The clock every wait and timeout reads: the system's, or a manual one that tests move."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds, and waiting on a condition (held by the caller) for at most a while."""

    def now(self) -> float: ...

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        """Releases ``cond`` until notified or ``seconds`` pass, then holds it again."""
        ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """``time.monotonic`` and real waits."""

    def now(self) -> float:
        return time.monotonic()

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        cond.wait(seconds)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only when told (``advance``) or when something waits on it: a wait
    of ``s`` seconds returns at once with the clock ``s`` later, so timeouts and retry backoffs
    happen without sleeping and the time they took is exact. ``waited`` is the total."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()
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

    def wait(self, cond: threading.Condition, seconds: float) -> None:
        self.advance(seconds)
        cond.wait(0)  # lets other threads take the lock, as a real wait would

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
