"""The contract of a backend for stateless work, and the factory that names the choices."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from zephon_flow.errors import SpecError
from zephon_flow.runners.segment import Chunk, Failure, FrontSegment, RecordResult

ChunkResult = list[RecordResult] | Failure

BACKENDS = ("inline", "threads", "processes")


class Backend(Protocol):
    """Runs ``FrontSegment.run_chunk`` somewhere; results may complete in any order."""

    def submit(self, chunk: Chunk) -> Future[ChunkResult]: ...

    def close(self) -> None: ...


def make_backend(name: str, *, workers: int, segment: FrontSegment) -> Backend:
    if not isinstance(workers, int) or workers < 1:
        raise SpecError(f"workers must be a positive integer, got {workers!r}")
    if name == "inline":
        from zephon_flow.runners.backends.inline import InlineBackend

        return InlineBackend(segment)
    if name == "threads":
        from zephon_flow.runners.backends.threads import ThreadBackend

        return ThreadBackend(segment, workers)
    if name == "processes":
        from zephon_flow.runners.backends.processes import ProcessBackend

        return ProcessBackend(segment, workers)
    raise SpecError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
