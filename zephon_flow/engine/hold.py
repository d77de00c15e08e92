"""Which produced steps are held for readers: production runs ``ahead`` past the slowest reader,
and steps more than ``keep`` behind it are let go.

One rule for every producer that serves readers by step: ``zephon serve``'s held global batches
(``service/held.py``) and a lane owner's windows (``cluster/owner.py``). ``StepHold`` only does
the arithmetic; its owner holds the lock, the waits and what is stored per step, and drops a
step's contents for each step ``release`` lets go.

A reader's *position* is the first step it may still ask for. Readers that have not asked yet
can be *expected* from a step: they keep that step held, and, while no reader has asked,
production counts ``ahead`` from the slowest of them.

A *floor* (a lane owner's: the slowest rank of the whole run, which may read other owners) is
kept held too, so that a checkpoint or a snapshot at that step can still be taken; production
runs at most ``floor_reach`` past it, so that a rank reading only fast owners cannot make them
hold an unbounded run of steps.
"""

from __future__ import annotations


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
