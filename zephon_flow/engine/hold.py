"""Which produced steps are held for readers: production runs ``ahead`` past the slowest reader,
and steps more than ``keep`` behind it are let go.

One rule and one store for every producer that serves readers by step: ``zephon serve``'s held
global batches (``service/held.py``) and a lane owner's windows (``cluster/owner.py``).
``StepHold`` only does the arithmetic. ``StepStore`` holds under it what was made: each step's
contents (a global batch; an owner's lanes' windows) and the state at each step (from which it
is the next one), the condition every producer and reader of them waits on (on a clock), the
waits for room and for a step, the byte bound, and the release of what no reader needs. What is
particular to a user (how a reader's position moves, streams, a mixture change) is its own,
kept under the store's condition.

A reader's *position* is the first step it may still ask for. Readers that have not asked yet
can be *expected* from a step: they keep that step held, and, while no reader has asked,
production counts ``ahead`` from the slowest of them.

A *floor* (a lane owner's: the slowest rank of the whole run, which may read other owners) is
kept held too, so that a checkpoint or a snapshot at that step can still be taken; production
runs at most ``floor_reach`` past it, so that a rank reading only fast owners cannot make them
hold an unbounded run of steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from zephon_flow.core.clock import SYSTEM_CLOCK, WAIT_POLL, Clock, wait_until

C = TypeVar("C")
S = TypeVar("S")


class StepHold:
    """Steps ``[low, produced)`` are held; ``ahead`` >= 1 and ``keep`` >= 0 (checked)."""

    def __init__(self, *, first_step: int, ahead: int, keep: int) -> None:
        if ahead < 1 or keep < 0:
            raise ValueError(f"ahead must be >= 1 and keep >= 0, got ahead={ahead}, keep={keep}")
        self.ahead, self.keep = ahead, keep
        self.low = self.produced = first_step
        self.positions: dict[int, int] = {}
        self.expected: dict[int, int] = {}
        self.floor: int | None = None
        self.floor_reach = 0

    def raise_floor(self, step: int, reach: int) -> bool:
        """Keeps steps from ``step`` on held, and production within ``reach`` steps past it
        (a floor only moves forward); whether it moved."""
        if reach < self.ahead:
            raise ValueError(f"a floor's reach must be at least ahead={self.ahead}, got {reach}")
        self.floor_reach = reach
        if self.floor is None or step > self.floor:
            self.floor = step
            return True
        return False

    def slowest(self) -> int:
        """Where production counts ``ahead`` from: the slowest reader's position (of those that
        have asked, else of those expected; ``low`` when there are none)."""
        if self.positions:
            return min(self.positions.values())
        return min(self.expected.values()) if self.expected else self.low

    def retained(self) -> int:
        """The first step any reader, asked or expected, may still ask for (``low`` when there
        are none: nothing is let go before a reader comes)."""
        floor = [] if self.floor is None else [self.floor]
        return min([*self.positions.values(), *self.expected.values(), *floor], default=self.low)

    def has_room(self) -> bool:
        """Whether production may make step ``produced`` now."""
        if self.floor is not None and self.produced >= self.floor + self.floor_reach:
            return False
        return self.produced < self.slowest() + self.ahead

    def add(self) -> int:
        """Counts one more produced step; returns its number."""
        self.produced += 1
        return self.produced - 1

    def place(self, reader: int, step: int) -> None:
        """Sets ``reader``'s position (a reconnect may move it back); it is no longer expected."""
        self.expected.pop(reader, None)
        self.positions[reader] = step

    def advance(self, reader: int, step: int) -> bool:
        """Moves ``reader`` forward to ``step`` (never back); whether it moved."""
        self.expected.pop(reader, None)
        if step > self.positions.get(reader, -1):
            self.positions[reader] = step
            return True
        return False

    def release(self) -> range:
        """Lets go of the steps more than ``keep`` behind the first retained one (never a step
        not produced); returns them, for the owner to drop their contents."""
        low = max(self.low, min(self.retained() - self.keep, self.produced))
        gone = range(self.low, low)
        self.low = low
        return gone

    def let_go_oldest(self) -> int:
        """Lets go of step ``low`` alone (a byte bound making room); returns it."""
        self.low += 1
        return self.low - 1


def _never() -> bool:
    return False


class StepStore(Generic[C, S]):
    """What a producer made for its readers, under ``rule`` (a ``StepHold`` of ``ahead`` and
    ``keep`` from ``first_step``): for steps ``[low, produced)`` each step's contents (``C``),
    and for ``[low, produced]`` the state at each (``S``: the state from which the step is the
    next one; ``first_state`` at the start). With ``size`` (the bytes of a step's contents)
    it counts the bytes held (``held_bytes``), and ``max_bytes`` (None: no bound) bounds them:
    steps behind the slowest reader are let go early to make room, then production waits;
    the step the slowest reader needs next is always made.

    Thread-safe: every method takes ``cond`` (re-entrant), which users hold around their own
    bookkeeping and around several calls that must see one state. Every wait is on ``clock``
    (``core/clock.py``'s ``wait_until``: a ``ManualClock`` moves by it), looking again at what
    nothing notifies (``stopped``, ``active``) every ``poll`` seconds."""

    def __init__(
        self,
        *,
        first_step: int,
        first_state: S,
        ahead: int,
        keep: int,
        max_bytes: int | None = None,
        size: Callable[[C], int] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        poll: float = WAIT_POLL,
    ) -> None:
        self.rule = StepHold(first_step=first_step, ahead=ahead, keep=keep)
        if max_bytes is not None and (max_bytes < 1 or size is None):
            raise ValueError(f"max_bytes must be >= 1 (or None), with a size of contents, got {max_bytes}")
        self.max_bytes, self._size = max_bytes, size
        self.clock, self.poll = clock, poll
        self.cond = threading.Condition(threading.RLock())
        self._contents: dict[int, C] = {}
        self._states: dict[int, S] = {first_step: first_state}
        self._sizes: dict[int, int] = {}
        #: The bytes of the contents held (0 without ``size``).
        self.held_bytes = 0
        #: Production ended (no more steps will come), and why, if it failed.
        self.ended = False
        self.error: BaseException | None = None

    @property
    def low(self) -> int:
        return self.rule.low

    @property
    def produced(self) -> int:
        return self.rule.produced

    # -- the producer --------------------------------------------------------------------------
    def has_room(self) -> bool:
        """Whether step ``produced`` may be made now: the rule says so, and one more step of
        the last one's size fits in ``max_bytes`` (or the slowest reader needs it next)."""
        with self.cond:
            if not self.rule.has_room():
                return False
            if self.max_bytes is None or self.rule.produced <= self.rule.slowest() or not self._sizes:
                return True
            return self.held_bytes + self._sizes[max(self._sizes)] <= self.max_bytes

    def _make_room(self) -> None:
        """With ``max_bytes``, when one more step would not fit: lets go of the oldest steps
        behind the slowest reader (kept for readers that come back), before ``keep`` says."""
        if self.max_bytes is None or not self._sizes or not self.rule.has_room():
            return
        last, slowest = self._sizes[max(self._sizes)], self.rule.slowest()
        while self.rule.low < min(slowest, self.rule.produced) and self.held_bytes + last > self.max_bytes:
            self._drop(self.rule.let_go_oldest())

    def advised_ahead(self) -> int:
        """How many steps past its position a reader can count on being made: ``ahead``, or
        fewer when ``max_bytes`` holds fewer steps (at least 1)."""
        with self.cond:
            ahead = self.rule.ahead
            if self.max_bytes is None or not self._sizes:
                return ahead
            return max(1, min(ahead, self.max_bytes // max(max(self._sizes.values()), 1)))

    def wait_for_room(self, stopped: Callable[[], bool], blocked: Callable[[], bool] = _never) -> bool:
        """Waits until step ``produced`` may be made (``has_room``) and ``blocked()`` (a
        user's own hold, under ``cond``) is false; False once ``stopped()`` while it waits."""
        with self.cond:
            self._make_room()
            while not self.has_room() or blocked():
                if stopped():
                    return False
                self.clock.wait(self.cond, self.poll)
                self._make_room()
            return True

    def add(self, contents: C, state_after: S) -> int:
        """Holds ``contents`` as step ``produced`` and ``state_after`` as the state at the step
        after it; wakes every waiter; returns the step's number. (Nothing is let go here:
        ``release`` does that.)"""
        size = None if self._size is None else self._size(contents)
        with self.cond:
            step = self.rule.add()
            self._contents[step] = contents
            self._states[step + 1] = state_after
            if size is not None:
                self._sizes[step] = size
                self.held_bytes += size
            self.cond.notify_all()
            return step

    def finish(self, error: BaseException | None = None) -> None:
        """No more steps will come: the data ended (``error`` None) or production failed."""
        with self.cond:
            self.ended, self.error = True, error
            self.cond.notify_all()

    # -- the readers ---------------------------------------------------------------------------
    def wait_for(
        self, ready: Callable[[], bool], timeout: float | None, active: Callable[[], bool] | None = None
    ) -> bool:
        """Waits until ``ready()`` (asked under ``cond``; it may raise), for at most ``timeout``
        seconds on the clock (None: no bound) and while ``active()`` (a reader's call still
        open); whether ``ready()`` held."""
        with self.cond:
            if active is None:
                return wait_until(self.clock, self.cond, ready, timeout, self.poll)
            going = active
            waited = wait_until(self.clock, self.cond, lambda: ready() or not going(), timeout, self.poll)
            return waited and ready()

    def wait_for_step(
        self, step: int, timeout: float | None = None, active: Callable[[], bool] | None = None
    ) -> bool:
        """Waits until ``step`` is made, production ended (or failed), ``timeout`` seconds
        passed or ``active()`` turned false; whether it is made (then ``get(step)`` has it,
        unless it was let go before: a user checks ``low``)."""
        with self.cond:
            self.wait_for(lambda: step < self.rule.produced or self.ended, timeout, active)
            return step < self.rule.produced

    def get(self, step: int) -> C:
        """Step ``step``'s contents (a ``KeyError`` if it is not held)."""
        with self.cond:
            return self._contents[step]

    def state(self, step: int) -> S | None:
        """The state at ``step`` (from which it is the next step); None if not held."""
        with self.cond:
            return self._states.get(step)

    def release(self) -> range:
        """Lets go of the steps more than ``keep`` behind the first one a reader may still ask
        for (``StepHold.release``), their contents and states; wakes every waiter; returns the
        steps let go."""
        with self.cond:
            gone = self.rule.release()
            for step in gone:
                self._drop(step)
            self.cond.notify_all()
            return gone

    def _drop(self, step: int) -> None:
        self._contents.pop(step, None)
        self._states.pop(step, None)
        self.held_bytes -= self._sizes.pop(step, 0)
