"""The processes backend: stateless work in spawned worker processes, each with its own DoFns."""

from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import Future, ProcessPoolExecutor

from apache_beam.internal import pickler

from zephon_flow.runners.backends.base import ChunkResult
from zephon_flow.runners.segment import Chunk, FrontSegment

_SEGMENT: FrontSegment | None = None


def _install(payload: bytes, sys_path: list[str]) -> None:
    global _SEGMENT
    # The forkserver may predate the parent's current sys.path (a pipeline file loaded by
    # path, a test directory); DoFns pickled by reference must import the same way here.
    sys.path[:] = sys_path + [p for p in sys.path if p not in sys_path]
    _SEGMENT = pickler.loads(payload)


def _run(chunk: Chunk) -> ChunkResult:
    assert _SEGMENT is not None, "worker used before its segment was installed"
    return _SEGMENT.run_chunk(chunk)


def _context() -> multiprocessing.context.BaseContext:
    """A forkserver that has imported zephon-flow (and so Beam) once; workers fork from it
    cheaply instead of each paying Beam's import. The server process runs no threads, so
    forking from it is safe."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["zephon_flow.runners.backends.processes", "zephon_flow.operators"])
    return ctx


class ProcessBackend:
    """A pool of ``workers`` processes. DoFns are pickled once, with Beam's pickler, and set
    up in each worker (so each worker has its own tokenizer)."""

    def __init__(self, segment: FrontSegment, workers: int) -> None:
        payload = pickler.dumps(segment)
        self._pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=_context(),
            initializer=_install,
            initargs=(payload, list(sys.path)),
        )

    def submit(self, chunk: Chunk) -> Future[ChunkResult]:
        return self._pool.submit(_run, chunk)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
