"""The ray backend: stateless work on a pool of Ray actors, one per worker, each fed whole chunks."""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from apache_beam.internal import pickler

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import ChunkTimeoutError
from zephon_flow.runners import ray_env
from zephon_flow.runners.backends import oob
from zephon_flow.runners.backends.base import (
    ChunkResult,
    Task,
    breadth_first,
    record_death,
    settle,
    skew,
    to_front,
)
from zephon_flow.runners.segment import Chunk, Failure, FrontSegment

#: What the errors call this backend when Ray is missing or unreachable.
FEATURE = "backend='ray'"
#: A chunk whose actor dies this many times (each time while running it) fails the loader.
#: Calls queued on one actor (one runs, the next waits in the actor's mailbox).
PER_WORKER = 2
#: One call carries the chunks waiting when it is sent, up to this many chunks or records (a
#: Ray call costs about a millisecond of CPU, far more than a pipe write).
BUNDLE_CHUNKS = 32
BUNDLE_RECORDS = 512
#: Seconds ``close`` (and a deadline's probe) waits on the dispatcher or an actor.
CLOSE_GRACE = 1.0
#: Seconds a chunk may wait for an actor that does not answer a probe (still starting, or
#: wedged in code that holds the GIL) beyond ``chunk_timeout`` before the actor is killed.
UNANSWERED_GRACE = 30.0
_PROTOCOL = pickle.HIGHEST_PROTOCOL


class _FrontActor:
    """One Ray actor: installs the pipeline's front segment once (its DoFns set up lazily, once
    per actor), then runs the chunks sent to it one at a time. ``where`` answers from its own
    concurrency group, so the driver can ask what a long call is doing while it runs."""

    def __init__(self, payload: bytes, sys_path: list[str]) -> None:
        # DoFns pickled by reference (a test module, a pipeline file loaded by path) must import
        # here as they do in the driver.
        sys.path[:] = sys_path + [p for p in sys.path if p not in sys_path]
        self._segment: FrontSegment | None = None
        self._load_error: Failure | None = None
        self._task, self._started, self._where = -1, 0.0, (0, 0, 0)
        try:
            self._segment = pickler.loads(payload)
        except Exception as exc:
            self._load_error = Failure.of(exc, f"a Ray actor could not load the pipeline's DoFns: {exc}")

    def _report(self, stage: int, first: int, last: int) -> None:
        self._where = (stage, first, last)

    def run(self, sent: bytes) -> tuple[bool, int, bytes]:
        """(the segment loaded, this actor's pid, each chunk's result in order, pickled).

        Chunks and results travel as one pickle each way: Ray's serialiser costs more per
        object than the standard pickler does on lists of small values. Each chunk goes as
        columns and each result's small token arrays as one array (``oob``), as to the
        processes backend's workers."""
        if self._segment is None:
            assert self._load_error is not None
            return False, os.getpid(), pickle.dumps([self._load_error], _PROTOCOL)
        bundle: list[tuple[int, Chunk]] = [(i, oob.unpack_chunk(c)) for i, c in pickle.loads(sent)]
        results: list[ChunkResult] = []
        try:
            for task_id, chunk in bundle:
                self._where, self._started, self._task = (0, 0, 0), time.monotonic(), task_id
                results.append(oob.pack_result(self._segment.run_chunk(chunk, self._report)))
        finally:
            self._task = -1
        return True, os.getpid(), pickle.dumps(results, _PROTOCOL)

    def stop(self) -> None:
        """The DoFns' ``teardown``, before the backend kills this actor (after its last call:
        calls run one at a time)."""
        if self._segment is not None:
            self._segment.teardown()

    def where(self) -> tuple[int, float, int, int, int, int]:
        """(running task or -1, seconds it has run, stage, first, last record, pid)."""
        stage, first, last = self._where
        return self._task, time.monotonic() - self._started, stage, first, last, os.getpid()


@cache
def _actor_class() -> Any:
    """``_FrontActor`` as a Ray actor class (built once Ray is imported)."""
    ray = ray_env.require_ray(FEATURE)
    return ray.remote(concurrency_groups={"probe": 1})(_FrontActor)


@dataclass(eq=False)
class _Task(Task):
    #: In a bundle whose actor died: sent alone from now on, so that a death names its chunk.
    alone: bool = False


@dataclass(eq=False)
class _Call:
    """One call to an actor: the chunks it runs, in order."""

    tasks: list[_Task]


@dataclass(eq=False)
class _Actor:
    number: int
    handle: Any  # a Ray ActorHandle
    #: Calls sent to it, in the order it runs them: the first is running (or next to run).
    calls: deque[_Call] = field(default_factory=deque)
    #: When the chunk it runs could start (a lower bound of its start), on the backend's clock.
    head_since: float = 0.0
    pid: int | None = None
    dead: bool = False


class RayBackend:
    """``workers`` Ray actors, each holding its own copy of the DoFns: the
    segment is pickled once with Beam's pickler, put in Ray's object store once and loaded
    once per actor, so a DoFn's ``setup`` (a tokenizer load) runs once per actor, not per
    chunk. Chunks, not records, are what travels: one dispatcher thread sends each actor the
    chunks waiting, several per call (``BUNDLE_CHUNKS``, ``BUNDLE_RECORDS``, shared out among
    the actors with room), two calls in flight per actor, and collects the results, which may
    complete in any order.

    Actors take Ray's default resources (placed on a node with a CPU, holding none while they
    run), so several loaders in one process (simulated ranks, ``zephon digest --world-size``)
    share one Ray without waiting on each other; ``SPREAD`` places them across a cluster's nodes.

    ``ray_address=None`` joins the Ray this process is already connected to, or starts a local
    one on loopback with at least ``workers`` CPUs and shuts it down at ``close``; an address
    joins that cluster and leaves it running. Faults behave as with ``backend='processes'``: an
    actor that dies (SIGKILL, ``ray.kill``, the OOM killer) is replaced and its chunks run again,
    so the batches do not change; a chunk that kills ``MAX_ATTEMPTS`` actors fails with
    ``WorkerLostError`` naming the lane and the records; a chunk past ``chunk_timeout`` fails
    with ``ChunkTimeoutError`` naming the DoFn and the record, and its actor is killed and
    replaced. ``close`` returns within seconds whatever the actors are doing.

    ``chunk_timeout`` is measured on ``clock``: an actor reports how long its chunk has run on
    the system's time, carried onto ``clock`` by the ``skew`` taken as the chunk was sent, and
    the dispatcher looks again at once when ``clock`` jumps. Waits on Ray itself (``close``,
    a probe's answer) stay on real time.
    """

    def __init__(
        self,
        segment: FrontSegment,
        workers: int,
        *,
        chunk_timeout: float = 300.0,
        ray_address: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._ray = ray_env.require_ray(FEATURE)
        self._address = ray_address
        self._started_ray = ray_env.connect(FEATURE, ray_address, num_cpus=max(workers, os.cpu_count() or 1))
        try:
            self._segment = segment
            self._timeout, self._clock = chunk_timeout, clock
            self._payload = self._ray.put(pickler.dumps(segment))
            self._sys_path = list(sys.path)
            self._events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
            self._lock = threading.Lock()
            self._pending: deque[_Task] = deque()
            self._next_id = 0
            self._numbers = 0
            self._closing = False
            self._broken: Failure | None = None
            self._actors = [self._start_actor() for _ in range(workers)]
        except BaseException:
            ray_env.disconnect_if_started(self._started_ray)
            raise
        self._unwatch = clock.on_move(lambda: self._events.put(("wake",)))
        self._thread = threading.Thread(target=self._dispatch, name="zephon-ray", daemon=True)
        self._thread.start()

    # -- the caller's side -----------------------------------------------------------------
    def submit(self, chunk: Chunk, *, lane: int = -1) -> Future[ChunkResult]:
        # Never marked running: cancel() succeeds until the result is in, so a closing stream
        # is never left waiting on a chunk a stuck actor holds.
        future: Future[ChunkResult] = Future()
        with self._lock:
            if self._closing:
                future.cancel()
                return future
            if self._broken is not None:  # no dispatcher may be left to settle it
                settle(future, self._broken)
                return future
            self._pending.append(_Task(self._next_id, chunk, future, lane))
            self._next_id += 1
        self._events.put(("wake",))
        return future

    def hurry(self, future: Future[ChunkResult]) -> None:
        with self._lock:
            to_front(self._pending, future)

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._unwatch()
        self._events.put(("wake",))
        self._thread.join(timeout=CLOSE_GRACE)
        self._stop_actors()
        for actor in list(self._actors):
            self._kill(actor)
            for task in _tasks(actor):
                task.future.cancel()
            actor.calls.clear()
        for task in self._drain():
            task.future.cancel()
        ray_env.disconnect_if_started(self._started_ray)

    def _stop_actors(self) -> None:
        """Asks each live actor to tear its DoFns down and waits ``CLOSE_GRACE`` seconds for
        all of them; an actor still busy then (a stuck call) is killed without it."""
        stops = []
        for actor in self._actors:
            if not actor.dead:
                with contextlib.suppress(Exception):
                    stops.append(actor.handle.stop.remote())
        if stops:
            with contextlib.suppress(Exception):
                self._ray.wait(stops, num_returns=len(stops), timeout=CLOSE_GRACE)

    # -- the dispatcher's side -------------------------------------------------------------
    def _start_actor(self) -> _Actor:
        handle = (
            _actor_class()
            .options(max_restarts=0, scheduling_strategy="SPREAD")
            .remote(self._payload, self._sys_path)
        )
        actor = _Actor(self._numbers, handle)
        self._numbers += 1
        return actor

    def _kill(self, actor: _Actor) -> None:
        actor.dead = True
        with contextlib.suppress(Exception):  # already gone, or Ray is shutting down
            self._ray.kill(actor.handle, no_restart=True)

    def _dispatch(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # a bug here must fail the loader, not hang it
            with self._lock:  # chunks submitted from now on fail in submit()
                self._broken = self._broken or Failure.of(exc, f"the ray backend's dispatcher failed: {exc}")
            for actor in self._actors:
                for task in _tasks(actor):
                    settle(task.future, self._broken)
            for task in self._drain():
                settle(task.future, self._broken)

    def _serve(self) -> None:
        while True:
            try:
                event = self._events.get(timeout=self._next_check())
            except queue.Empty:
                event = None
            while event is not None:
                if self._closing:
                    return
                if event[0] == "done":
                    self._done(*event[1:])
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    event = None
            if self._closing:
                return
            self._assign()
            self._check_deadlines()

    def _assign(self) -> None:
        if self._broken is not None:
            for task in self._drain():
                settle(task.future, self._broken)
            return
        for actor in breadth_first(self._actors, lambda a: len(a.calls), PER_WORKER):
            bundle = self._bundle()
            if not bundle:
                return
            for task in bundle:  # before it is sent: it may start at once
                task.skew = skew(self._clock)
            try:
                sent = pickle.dumps([(t.id, oob.pack_chunk(t.chunk)) for t in bundle], _PROTOCOL)
                ref = actor.handle.run.remote(sent)
            except Exception as exc:  # a chunk does not serialise: say so
                for task in bundle:
                    settle(task.future, Failure.of(exc, f"a chunk cannot be sent to a Ray actor: {exc}"))
                continue
            call = _Call(bundle)
            if not actor.calls:
                actor.head_since = self._clock.now()
            actor.calls.append(call)
            ref.future().add_done_callback(
                lambda done, actor=actor, call=call: self._events.put(("done", actor, call, done))
            )

    def _bundle(self) -> list[_Task]:
        """The next call's chunks: the waiting ones shared out among the calls the actors have
        room for, within ``BUNDLE_CHUNKS`` and ``BUNDLE_RECORDS``; a chunk marked ``alone``
        goes by itself."""
        room = sum(PER_WORKER - len(a.calls) for a in self._actors) or 1
        bundle: list[_Task] = []
        records = 0
        with self._lock:
            share = min(BUNDLE_CHUNKS, -(-len(self._pending) // room))
            while self._pending and len(bundle) < share and records < BUNDLE_RECORDS:
                task = self._pending[0]
                if task.future.cancelled():
                    self._pending.popleft()
                    continue
                if task.alone and bundle:
                    break
                self._pending.popleft()
                bundle.append(task)
                records += len(task.chunk)
                if task.alone:
                    break
        return bundle

    def _done(self, actor: _Actor, call: _Call, done: Future[Any]) -> None:
        if actor.dead or call not in actor.calls:
            return  # the actor was replaced meanwhile and its chunks settled or queued again
        try:
            loaded, pid, blob = done.result()
            results = [oob.unpack_result(r) for r in pickle.loads(blob)]
        except self._ray.exceptions.RayActorError as exc:
            self._replace(actor, self._death_note(actor, exc))
            return
        except Exception as exc:  # the results could not come back (they do not deserialise)
            results = [
                Failure.of(
                    exc, f"lane {t.lane}: a chunk's outputs cannot be sent back from a Ray actor: {exc}"
                )
                for t in call.tasks
            ]
            loaded, pid = True, actor.pid
        actor.pid = pid
        if not loaded:  # the actor could not install the DoFns: no actor can
            self._broken = results[0]
            for queued in [*_tasks(actor), *self._drain()]:
                settle(queued.future, results[0])
            actor.calls.clear()
            return
        if actor.calls[0] is call:
            actor.head_since = self._clock.now()
        actor.calls.remove(call)
        for task, result in zip(call.tasks, results, strict=True):
            settle(task.future, result)

    def _drain(self) -> list[_Task]:
        with self._lock:
            tasks, self._pending = list(self._pending), deque()
        return tasks

    def _death_note(self, actor: _Actor, exc: BaseException) -> str:
        first = str(exc).strip().splitlines()
        why = first[0] if first else type(exc).__name__
        pid = f"pid {actor.pid}" if actor.pid is not None else "pid unknown"
        return f"Ray actor {actor.number} ({pid}) died ({type(exc).__name__}: {why})"

    def _replace(
        self, actor: _Actor, note: str, *, failed: _Task | None = None, error: Failure | None = None
    ) -> None:
        """Swaps a dead (or killed) actor for a new one; its chunks run again, except ``failed``.

        A death counts against the chunk it was running when that chunk was sent alone; the
        chunks of a bundle that died are sent alone from then on, so a chunk that kills its
        actor is found and named, and the others are not blamed."""
        self._kill(actor)
        again: list[_Task] = []
        for k, call in enumerate(actor.calls):
            running = k == 0  # an actor runs its calls in order
            for task in call.tasks:
                if task is failed:
                    assert error is not None
                    settle(task.future, error)
                    continue
                if running and failed is None and len(call.tasks) > 1:
                    task.alone = True
                elif running and failed is None:
                    lost = record_death(
                        task,
                        f"{note} {_records(self._segment, task.chunk)}",
                        killed="Ray actors",
                        replacement="a new actor",
                        logs="see `ray logs` and the kernel log",
                    )
                    if lost:
                        continue
                again.append(task)
        actor.calls.clear()
        self._actors.remove(actor)
        with self._lock:
            self._pending.extendleft(sorted(again, key=lambda t: t.id, reverse=True))
            if self._closing or self._broken is not None:
                return
        self._actors.append(self._start_actor())

    def _next_check(self) -> float:
        """Real seconds until the dispatcher next reads the clock (a jump wakes it sooner)."""
        heads = [a.head_since for a in self._actors if a.calls]
        if not heads:
            return 1.0
        return max(0.01, min(min(heads) + self._timeout - self._clock.now(), 1.0))

    def _check_deadlines(self) -> None:
        now = self._clock.now()
        for actor in list(self._actors):
            if not actor.calls or now - actor.head_since <= self._timeout:
                continue
            head = actor.calls[0]
            try:
                task_id, ran, stage, first, last, pid = self._ray.get(
                    actor.handle.where.options(concurrency_group="probe").remote(), timeout=CLOSE_GRACE
                )
            except Exception:  # still starting, wedged or dead (a death arrives as an event)
                if now - actor.head_since > self._timeout + UNANSWERED_GRACE:
                    task = head.tasks[0]
                    where = f"{_records(self._segment, task.chunk)}, in an actor that does not answer"
                    if actor.pid is None:
                        where += " and never started (see `ray status` for the cluster's resources)"
                    self._time_out(actor, task, where)
                continue
            actor.pid = pid
            running = next((t for t in head.tasks if t.id == task_id), None)
            if running is None:  # not started yet, or between chunks: look again later
                actor.head_since = now
                continue
            ran = now - (time.monotonic() - ran + running.skew)  # on the clock (see skew)
            if ran <= self._timeout:
                actor.head_since = now - ran
                continue
            self._time_out(actor, running, self._segment.describe(running.chunk, stage, first, last))

    def _time_out(self, actor: _Actor, task: _Task, where: str) -> None:
        message = (
            f"a stateless call ran for more than chunk_timeout={self._timeout:g} s {where} "
            f"(lane {task.lane}, Ray actor {actor.number}, pid {actor.pid}): it is stuck or too "
            f"slow. The actor was killed and replaced. Fix the DoFn, or raise "
            f"Loader(chunk_timeout=...) if such records legitimately take this long."
        )
        self._replace(actor, "killed", failed=task, error=Failure.of(ChunkTimeoutError(message)))


def _tasks(actor: _Actor) -> list[_Task]:
    return [task for call in actor.calls for task in call.tasks]


def _records(segment: FrontSegment, chunk: Chunk) -> str:
    """Names a chunk's records (an actor's death leaves no word of where in them it was)."""
    if not chunk:
        return "before its first record"
    (i, a), (j, b) = chunk[0], chunk[-1]
    names = segment.sources
    if len(chunk) == 1:
        return f"while running the record at {a.path} {a.where}, via {names[i].operator_name}"
    return (
        f"while running the {len(chunk)} records from {a.path} {a.where} (via {names[i].operator_name}) "
        f"to {b.path} {b.where} (via {names[j].operator_name})"
    )
