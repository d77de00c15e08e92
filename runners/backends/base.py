"""The contract of a backend for stateless work: what it runs, what it returns, the choices."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from zephon_flow.runners.segment import Chunk, Failure, RecordResult

ChunkResult = list[RecordResult] | Failure

BACKENDS = ("inline", "threads", "processes", "ray")

#: Seconds one chunk's stateless work may take before it counts as stuck (``chunk_timeout``).
DEFAULT_CHUNK_TIMEOUT = 300.0


class Backend(Protocol):
    """Runs ``FrontSegment.run_chunk`` somewhere; results may complete in any order.

    ``lane`` only names the chunk in errors. ``close`` returns within seconds, whatever the
    stateless work is doing, and settles (or cancels) every future it handed out.
    """

    def submit(self, chunk: Chunk, *, lane: int = -1) -> Future[ChunkResult]: ...

    def close(self) -> None: ...
