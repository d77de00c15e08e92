"""The one retry policy of every loop that asks again: how many tries, and the pause before each.

``Client`` (the server's stream and its unary calls), the fan-in from served lane owners,
``OwnedLoader`` and the lane owners' coordinator all pause through a ``Backoff`` on their
injected clock, so a test drives their retries with a ``ManualClock`` instead of sleeping, and
the policy's checks live here once. A loop bounded by a number of tries counts them
(``last``, ``pause``); one bounded by a time asks ``until`` for its tries.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from zephon_flow.core.clock import Clock
from zephon_flow.core.errors import SpecError


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """``retries`` more tries after the first; before try ``attempt + 1`` a pause of
    ``initial * 2**attempt`` seconds, at most ``maximum``. ``owner`` names the entry point in
    the message of a refused value (``Client: retries must be ...``)."""

    retries: int = 8
    initial: float = 0.1
    maximum: float = 5.0
    owner: str = "Client"

    def __post_init__(self) -> None:
        retries_ok = (
            isinstance(self.retries, int) and not isinstance(self.retries, bool) and self.retries >= 0
        )
        numbers = all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in (self.initial, self.maximum)
        )
        if not retries_ok or not numbers or not 0 < self.initial <= self.maximum:
            raise SpecError(
                f"{self.owner}: retries must be >= 0 and 0 < backoff <= max_backoff, got "
                f"retries={self.retries!r}, backoff={self.initial!r}, max_backoff={self.maximum!r}"
            )

    def delay(self, attempt: int) -> float:
        """The pause after failed try ``attempt`` (0 for the first try)."""
        return float(min(self.maximum, self.initial * 2**attempt))

    def last(self, attempt: int) -> bool:
        """Whether try ``attempt`` was the last one allowed."""
        return attempt >= self.retries

    def gave_up(self, attempt: int) -> str:
        """For the message of a call given up after try ``attempt``: how many tries, over how
        many seconds of pauses, and the knobs that allow more (a server restarting under a
        supervisor, Ray's start included, can take longer than the default allows)."""
        waited = sum(self.delay(a) for a in range(attempt))
        return (
            f"after {attempt + 1} tries over {waited:.1f} s (a server that takes longer to come "
            f"back needs more: {self.owner}(retries=, max_backoff=); now retries={self.retries}, "
            f"max_backoff={self.maximum:g})"
        )

    def pause(self, attempt: int, clock: Clock) -> None:
        """Waits ``delay(attempt)`` on ``clock``."""
        clock.sleep(self.delay(attempt))

    def until(self, clock: Clock, timeout: float) -> Iterator[int]:
        """The tries of a loop bounded by ``timeout`` seconds on ``clock`` (not by ``retries``):
        yields each try's number, from 0 at once, with a pause of ``delay(attempt)`` before each
        later one (cut short at the deadline), and ends after the try made at the deadline (the
        caller then gives up)."""
        deadline = clock.now() + timeout
        attempt = 0
        while True:
            yield attempt
            left = deadline - clock.now()
            if left <= 0:
                return
            clock.sleep(min(self.delay(attempt), left))
            attempt += 1


#: How a loop waiting for something another process makes (an owner's step, a name Ray frees)
#: asks again: soon at first, then at most every half second.
POLL = Backoff(initial=0.05, maximum=0.5, owner="poll")
