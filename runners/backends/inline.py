"""The inline backend: stateless work runs on the caller's thread, at submission."""

from __future__ import annotations

from concurrent.futures import Future

from zephon_flow.runners.backends.base import ChunkResult
from zephon_flow.runners.segment import Chunk, FrontSegment


class InlineBackend:
    def __init__(self, segment: FrontSegment) -> None:
        self._segment = segment

    def submit(self, chunk: Chunk) -> Future[ChunkResult]:
        future: Future[ChunkResult] = Future()
        future.set_result(self._segment.run_chunk(chunk))
        return future

    def close(self) -> None:
        pass
