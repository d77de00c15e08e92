"""The contract of a backend for stateless work: what it runs, what it returns, the choices."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from zephon_flow.core.clock import Clock
from zephon_flow.core.errors import WorkerLostError
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

    def hurry(self, future: Future[ChunkResult]) -> None:
        """A lane waits for ``future``: its chunk, if still waiting for a worker, runs next
        (ahead of other lanes' read-ahead). Only the order of the work changes, never a result."""
        ...

    def close(self) -> None: ...


#: How many workers (processes or actors) a chunk may kill before it fails as poison.
MAX_ATTEMPTS = 3


@dataclass(eq=False)
class Task:
    """A submitted chunk as a pool backend tracks it: ``deaths`` names each worker it killed."""

    id: int
    chunk: Chunk
    future: Future[ChunkResult]
    lane: int
    deaths: list[str] = field(default_factory=list)
    #: The clock's ``skew`` when it was last sent to a worker: its start stamp plus this is on
    #: the backend's clock.
    skew: float = 0.0


def settle(future: Future[ChunkResult], result: ChunkResult) -> None:
    """Sets ``future``'s result unless a closing stream cancelled it meanwhile."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(result)


def lost_message(task: Task, *, killed: str, replacement: str, logs: str) -> str:
    """Why ``task`` failed after killing ``MAX_ATTEMPTS`` workers (``killed``: "worker
    processes", "Ray actors"), and what to do about it."""
    deaths = "\n".join(f"  - {d}" for d in task.deaths)
    return (
        f"lane {task.lane}: the stateless work on a chunk of {len(task.chunk)} record(s) killed "
        f"{len(task.deaths)} {killed} in a row (it is retried on {replacement} "
        f"{MAX_ATTEMPTS - 1} times):\n{deaths}\nA DoFn that exhausts memory is the usual cause "
        f"({logs} for the OOM killer); reduce its memory or the chunk "
        f"size (Loader(chunk_records=...)), or fix how it handles this record."
    )


def record_death(task: Task, note: str, *, killed: str, replacement: str, logs: str) -> bool:
    """Counts a worker's death against ``task`` (``note`` says which and where); once it has
    killed ``MAX_ATTEMPTS``, fails it with ``WorkerLostError`` and returns True (not to rerun)."""
    task.deaths.append(note)
    if len(task.deaths) < MAX_ATTEMPTS:
        return False
    message = lost_message(task, killed=killed, replacement=replacement, logs=logs)
    settle(task.future, Failure.of(WorkerLostError(message)))
    return True


def to_front(pending: deque[Any], future: Future[ChunkResult]) -> None:
    """Moves the waiting task of ``future`` (anything with ``.future``) to the front of
    ``pending``, if it is there; the caller holds the lock guarding ``pending``."""
    for i, task in enumerate(pending):
        if task.future is future:
            if i:
                del pending[i]
                pending.appendleft(task)
            return


def skew(clock: Clock) -> float:
    """``clock``'s reading less the system's monotonic time, now. A worker process or a Ray
    actor stamps the start of its call on the system's time (the one clock processes share);
    that stamp plus the skew taken as the call was sent is on ``clock``: the stamp itself on
    the system's clock, the time of sending plus the real seconds until the start on a
    test's ``ManualClock``."""
    return clock.now() - time.monotonic()


H = TypeVar("H")


def breadth_first(holders: Sequence[H], held: Callable[[H], int], most: int) -> Iterator[H]:
    """The holder (a worker, an actor) to give the next piece of work, while any has room:
    every holder gets a first one to run before any gets a second to queue, else two pieces
    handed out together would both go to the first holder while the next idles (and a short
    one would wait behind a long one there). ``held(h)`` is re-read after each piece handed
    out; one the caller could not hand out (cancelled, unsendable) is simply asked for again."""
    for depth in range(1, most + 1):
        for holder in holders:
            while held(holder) < depth:
                yield holder
