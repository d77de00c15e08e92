"""The threads backend: stateless work on a thread pool (good for DoFns that release the GIL)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from zephon_flow.runners.backends.base import ChunkResult
from zephon_flow.runners.segment import Chunk, FrontSegment


class ThreadBackend:
    def __init__(self, segment: FrontSegment, workers: int) -> None:
        self._segment = segment
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zephon-stateless")

    def submit(self, chunk: Chunk) -> Future[ChunkResult]:
        return self._pool.submit(self._segment.run_chunk, chunk)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
