"""The inline backend: stateless work runs on the caller's thread, at submission."""

from __future__ import annotations

from concurrent.futures import Future

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.runners.backends.base import ChunkResult
from zephon_flow.runners.backends.threads import Deadlines
from zephon_flow.runners.segment import Chunk, FrontSegment


class InlineBackend:
    """Runs each chunk inside ``submit``, on the lane's own thread.

    What it cannot do: a call that hangs hangs that thread, and nothing can stop it from inside
    the process. What it does: after ``chunk_timeout`` seconds it logs a warning naming the
    DoFn and the record the call is stuck on, and ``close`` returns at once (the stuck thread
    is a daemon and is left behind). Use ``backend="processes"`` to have a stuck call killed,
    its worker replaced and the loader fail with ``ChunkTimeoutError``. ``chunk_timeout`` is
    measured on ``clock``.
    """

    def __init__(
        self, segment: FrontSegment, *, chunk_timeout: float = 300.0, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._deadlines = Deadlines(segment, chunk_timeout, "inline", clock)

    def submit(self, chunk: Chunk, *, lane: int = -1) -> Future[ChunkResult]:
        future: Future[ChunkResult] = Future()
        future.set_result(self._deadlines.run(self._deadlines.call(chunk, lane, None)))
        return future

    def hurry(self, future: Future[ChunkResult]) -> None:
        """Every chunk ran in ``submit``: nothing waits."""

    def close(self) -> None:
        self._deadlines.close()
