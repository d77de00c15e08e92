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

#: How often ``wait_until`` looks again at a predicate that nothing notifies it of (seconds).
WAIT_POLL = 0.2


def wait_until(
    clock: Clock,
    cond: threading.Condition,
    ready: Callable[[], bool],
    timeout: float | None,
    poll: float = WAIT_POLL,
) -> bool:
    """Waits on ``cond`` (held by the caller) until ``ready()`` or ``timeout`` seconds pass on
    ``clock`` (None: no bound); whether ``ready()`` held. ``ready`` is asked under ``cond``
    at each notification and at least every ``poll`` seconds, so it may also read what
    nothing notifies (a client that went away); it may raise, ending the wait. On a
    ``ManualClock`` the wait takes no real time: each pause moves the clock."""
    deadline = None if timeout is None else clock.now() + timeout
    while not ready():
        pause = poll
        if deadline is not None:
            left = deadline - clock.now()
            if left <= 0:
                return False
            pause = min(poll, left)
        clock.wait(cond, pause)
    return True


def wait_for_arrival(
    clock: Clock,
    cond: threading.Condition,
    ready: Callable[[], bool],
    timeout: float,
    poll: float = WAIT_POLL,
) -> bool:
    """As ``wait_until``, for what another thread or process brings (a message off the wire):
    the pauses are real, so a ``ManualClock`` does not move by them (it would run past the
    deadline while the message is on its way), and the deadline is read on ``clock`` between
    them, at once when a manual clock jumps (``on_move``): a test moves the clock past the
    deadline instead of sleeping through it."""

    def wake() -> None:
        with cond:
            cond.notify_all()

    deadline = clock.now() + timeout
    stop = clock.on_move(wake)
    try:
        while not ready():
            left = deadline - clock.now()
            if left <= 0:
                return False
            cond.wait(min(poll, left))
        return True
    finally:
        stop()


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
