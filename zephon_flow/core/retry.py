"""The one retry policy of every client-side loop: how many tries, and the pause before each.

``Client`` (the server's stream and its unary calls), the fan-in from served lane owners and
``OwnedLoader`` all pause through a ``Backoff`` on their injected clock, so a test drives their
retries with a ``ManualClock`` instead of sleeping, and the policy's checks live here once.
"""

from __future__ import annotations

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

    def pause(self, attempt: int, clock: Clock) -> None:
        """Waits ``delay(attempt)`` on ``clock``."""
        clock.sleep(self.delay(attempt))
