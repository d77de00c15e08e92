"""The contract of a backend for stateless work, and the factory that names the choices."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from zephon_flow.errors import SpecError
from zephon_flow.runners.segment import Chunk, Failure, FrontSegment, RecordResult

ChunkResult = list[RecordResult] | Failure

BACKENDS = ("inline", "threads", "processes")

#: Seconds one chunk's stateless work may take before it counts as stuck (``chunk_timeout``).
DEFAULT_CHUNK_TIMEOUT = 300.0


class Backend(Protocol):
    """Runs ``FrontSegment.run_chunk`` somewhere; results may complete in any order.

    ``lane`` only names the chunk in errors. ``close`` returns within seconds, whatever the
    stateless work is doing, and settles (or cancels) every future it handed out.
    """

    def submit(self, chunk: Chunk, *, lane: int = -1) -> Future[ChunkResult]: ...

    def close(self) -> None: ...


def make_backend(
    name: str, *, workers: int, segment: FrontSegment, chunk_timeout: float = DEFAULT_CHUNK_TIMEOUT
) -> Backend:
    if not isinstance(workers, int) or workers < 1:
        raise SpecError(f"workers must be a positive integer, got {workers!r}")
    if isinstance(chunk_timeout, bool) or not isinstance(chunk_timeout, int | float) or not chunk_timeout > 0:
        raise SpecError(
            f"chunk_timeout must be a positive number of seconds, got {chunk_timeout!r} "
            f"(the default is {DEFAULT_CHUNK_TIMEOUT:g})"
        )
    timeout = float(chunk_timeout)
    if name == "inline":
        from zephon_flow.runners.backends.inline import InlineBackend

        return InlineBackend(segment, chunk_timeout=timeout)
    if name == "threads":
        from zephon_flow.runners.backends.threads import ThreadBackend

        return ThreadBackend(segment, workers, chunk_timeout=timeout)
    if name == "processes":
        from zephon_flow.runners.backends.processes import ProcessBackend

        return ProcessBackend(segment, workers, chunk_timeout=timeout)
    raise SpecError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
