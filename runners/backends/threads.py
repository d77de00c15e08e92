"""The threads backend: stateless work on a thread pool (good for DoFns that release the GIL)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import ChunkTimeoutError
from zephon_flow.runners.backends.base import ChunkResult
from zephon_flow.runners.segment import Chunk, Failure, FrontSegment

_log = logging.getLogger("zephon_flow")

#: How long ``close`` lets idle threads leave (so the loader's teardown follows their last call).
CLOSE_GRACE = 1.0


class _Call:
    """One chunk being run on a thread: where it is (for the deadline's message) and since when."""

    def __init__(self, chunk: Chunk, lane: int, future: Future[ChunkResult] | None, started: float) -> None:
        self.chunk, self.lane, self.future = chunk, lane, future
        self.started = started
        self.where = (0, 0, 0)

    def report(self, stage: int, first: int, last: int) -> None:
        self.where = (stage, first, last)


class Deadlines:
    """Watches calls running on threads: one past ``timeout`` seconds has its future failed with
    ``ChunkTimeoutError`` naming the DoFn and the record. A thread cannot be killed, so the
    stuck call keeps its thread; the loader stops with the error instead of hanging. A call
    without a future (the inline backend, whose caller is the stuck thread) is only logged.

    Time is ``clock``'s: the watcher looks at it every quarter of the timeout (at most every
    second), and at once when it jumps (a test's ``ManualClock``)."""

    def __init__(
        self, segment: FrontSegment, timeout: float, backend: str, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._segment, self._timeout, self._backend = segment, timeout, backend
        self._clock = clock
        self._calls: set[_Call] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._look = threading.Event()  # the clock jumped, or the watcher must stop
        self._unwatch = clock.on_move(self._look.set)
        self._thread = threading.Thread(target=self._watch, name="zephon-deadlines", daemon=True)
        self._thread.start()

    def call(self, chunk: Chunk, lane: int, future: Future[ChunkResult] | None) -> _Call:
        """A call of ``chunk`` for ``lane``, its time counted from now."""
        return _Call(chunk, lane, future, self._clock.now())

    def run(self, call: _Call) -> ChunkResult:
        with self._lock:
            self._calls.add(call)
        try:
            return self._segment.run_chunk(call.chunk, call.report)
        finally:
            with self._lock:
                self._calls.discard(call)

    def _watch(self) -> None:
        while True:
            self._look.wait(min(1.0, self._timeout / 4))  # real time: how often the clock is read
            self._look.clear()
            if self._stop.is_set():
                return
            now = self._clock.now()
            with self._lock:
                late = [c for c in self._calls if now - c.started > self._timeout]
                self._calls.difference_update(late)
            for call in late:
                where = self._segment.describe(call.chunk, *call.where)
                if call.future is None:
                    _log.warning(
                        "a stateless call has run for more than chunk_timeout=%g s %s (lane %d, %s "
                        "backend): it is stuck or too slow, and this backend cannot interrupt it "
                        "(backend='processes' kills and replaces stuck workers)",
                        self._timeout,
                        where,
                        call.lane,
                        self._backend,
                    )
                    continue
                message = (
                    f"a stateless call ran for more than chunk_timeout={self._timeout:g} s {where} "
                    f"(lane {call.lane}, {self._backend} backend): it is stuck or too slow. A thread "
                    f"cannot be killed, so the call keeps its thread; use backend='processes' to have "
                    f"stuck workers killed and replaced. Fix the DoFn, or raise "
                    f"Loader(chunk_timeout=...) if such records legitimately take this long."
                )
                with contextlib.suppress(InvalidStateError):
                    call.future.set_result(Failure.of(ChunkTimeoutError(message)))

    def close(self) -> None:
        self._unwatch()
        self._stop.set()
        self._look.set()


class ThreadBackend:
    """``workers`` daemon threads sharing the DoFns. ``close`` does not wait for running calls (a
    stuck one would hold it forever): their threads finish, or not, in the background, and being
    daemon threads they never keep the process from exiting (a ``ThreadPoolExecutor`` joins its
    threads at exit, so one stuck call would hang the trainer's exit). ``chunk_timeout`` is
    measured on ``clock``."""

    def __init__(
        self,
        segment: FrontSegment,
        workers: int,
        *,
        chunk_timeout: float = 300.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._deadlines = Deadlines(segment, chunk_timeout, "threads", clock)
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"zephon-stateless_{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, chunk: Chunk, *, lane: int = -1) -> Future[ChunkResult]:
        # Our own future, never marked running: a closing stream can always cancel it.
        future: Future[ChunkResult] = Future()
        call = self._deadlines.call(chunk, lane, future)

        def work() -> None:
            if self._closed:  # queued when the backend closed: settle it, do not run it
                future.cancel()
            if future.cancelled():
                return
            try:
                result = self._deadlines.run(call)
            except BaseException as exc:  # a failure of the machinery itself: settle, never strand
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(exc)
                return
            with contextlib.suppress(InvalidStateError):
                future.set_result(result)

        self._jobs.put(work)
        return future

    def hurry(self, future: Future[ChunkResult]) -> None:
        """Chunks wait in a plain FIFO queue here: the order stays as submitted."""

    def close(self) -> None:
        """Stops the threads: idle ones leave at once; one still running a call is waited for
        at most ``CLOSE_GRACE`` seconds in all, then left behind (a stuck call keeps it)."""
        self._closed = True
        self._deadlines.close()
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + CLOSE_GRACE  # real time: the threads must really leave
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
