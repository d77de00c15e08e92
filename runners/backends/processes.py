"""The processes backend: stateless work in worker processes that are watched, replaced and die with us."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import multiprocessing
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from apache_beam.internal import pickler

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import ChunkTimeoutError, WorkerLostError
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

#: Chunks queued on one worker (one runs, the next waits in its pipe: no idle round trip).
PER_WORKER = 2
#: How long ``close`` lets workers exit on their own before killing them.
CLOSE_GRACE = 1.0
#: How long a worker told to stop may spend in its DoFns' ``teardown`` (within ``CLOSE_GRACE``).
TEARDOWN_GRACE = 0.5
#: Workers in a row that die before they are ready (the pipeline's DoFns installed) fail the
#: loader: a replacement would die the same way, forever. The usual cause is a script that
#: builds and runs a loader at top level: a worker started from the forkserver imports it
#: again, and Python refuses to start processes from a process still starting.
START_ATTEMPTS = 3

# Progress slots a worker writes into shared memory for the parent to read; ``_READY`` is
# set once the worker has installed the pipeline's DoFns.
_TASK, _STAGE, _FIRST, _LAST, _STARTED, _READY = range(6)
_IDLE = -1.0

_PR_SET_PDEATHSIG = 1

#: The bytes a worker's results may wait in its socket for the dispatcher to read (the kernel
#: caps it at twice ``net.core.wmem_max``, at least 416 KB by default): a chunk's outputs of a few
#: hundred KB (a clip of video frames) go in one write, and the worker starts its next chunk
#: instead of waiting, on a busy machine, for the dispatcher's turn to read the rest. Measured on
#: 320x240 video at load 6 (2 workers, 2 cores): a result's send 2.1-3.0 ms against 2.1-6.2 ms.
RESULT_BUFFER = 4 << 20


def _roomy(conn: Connection) -> None:
    """Lets ``conn``'s writer queue up to ``RESULT_BUFFER`` bytes (the socket's send buffer;
    the default holds about 210 KB); any refusal leaves the default."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:  # same socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, RESULT_BUFFER)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (the forkserver, which itself exits
    when the trainer does). Elsewhere the watchdog thread alone does the job."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _default_signal_handlers() -> None:
    """Python's own handlers, as a worker started by the forkserver has them: SIGINT raises
    ``KeyboardInterrupt``, any handler the trainer installed in Python is dropped."""
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(sig)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _watch_parent(alive: Connection, done: threading.Event) -> None:
    """Blocks on a pipe whose only writer is the parent's backend: EOF means the parent closed
    the backend or died, and either way this worker has nothing left to do. A worker told to
    stop (``close``) is let finish its DoFns' teardown for ``TEARDOWN_GRACE`` seconds first."""
    with contextlib.suppress(EOFError, OSError):
        alive.recv()
    done.wait(TEARDOWN_GRACE)
    os._exit(0)


def _worker_main(
    payload: bytes,
    sys_path: list[str],
    conn: Connection,
    alive: Connection,
    progress: Any,
    inherited: tuple[Connection, ...] = (),
) -> None:
    """A worker: install the segment, then run the chunks the parent sends until told to stop.

    ``inherited``: the parent's ends of its pipes, which a forked worker holds copies of and
    closes first (the watchdog's EOF needs the parent's end of ``alive`` closed everywhere)."""
    for end in inherited:
        end.close()
    if inherited:  # forked from the trainer: not its signal handlers (a save on SIGTERM, ...)
        _default_signal_handlers()
    _die_with_parent()
    done = threading.Event()  # set when the worker has left its loop (and torn its DoFns down)
    threading.Thread(
        target=_watch_parent, args=(alive, done), name="zephon-parent-watch", daemon=True
    ).start()
    # The forkserver may predate the parent's current sys.path (a pipeline file loaded by
    # path, a test directory); DoFns pickled by reference must import the same way here.
    sys.path[:] = sys_path + [p for p in sys.path if p not in sys_path]
    try:
        segment: FrontSegment = pickler.loads(payload)
    except Exception as exc:
        oob.send(conn, (-1, Failure.of(exc, f"a worker could not load the pipeline's DoFns: {exc}")))
        return

    progress[_READY] = 1.0
    try:
        _serve_chunks(segment, conn, progress)
    finally:
        done.set()


def _serve_chunks(segment: FrontSegment, conn: Connection, progress: Any) -> None:
    """Runs the chunks the parent sends until told to stop (``None``: then the DoFns' teardown
    runs, as Beam's at a worker's end) or the parent is gone (no teardown: nothing waits)."""

    def report(stage: int, first: int, last: int) -> None:
        progress[_STAGE], progress[_FIRST], progress[_LAST] = stage, first, last

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            segment.teardown()
            return
        task_id, chunk = message[0], oob.unpack_chunk(message[1])
        progress[_STARTED] = time.monotonic()
        progress[_TASK] = task_id
        result: ChunkResult = segment.run_chunk(chunk, report)
        progress[_TASK] = _IDLE
        try:
            oob.send(conn, (task_id, oob.pack_result(result)))  # pickled whole before a byte is written
        except (EOFError, OSError):
            return
        except Exception as exc:  # outputs that do not pickle: say which DoFn made them
            oob.send(conn, (task_id, Failure.of(exc, f"the outputs of a chunk cannot be sent back: {exc}")))


def _context() -> multiprocessing.context.ForkServerContext:
    """A forkserver that has imported zephon-flow (and so Beam) once; workers fork from it
    cheaply instead of each paying Beam's import. The server process runs no threads, so
    forking from it is safe, and it exits by itself when the process that started it dies."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["zephon_flow.runners.backends.processes", "zephon_flow.operators"])
    return ctx


#: Native threads that may be running when workers are forked: pools that inherit the main
#: thread's name (OpenBLAS's, started by importing numpy) and jemalloc's background thread
#: (pyarrow's); both are built to survive a fork. gRPC's, CUDA's and others have names.
_FORK_SAFE_NATIVE = ("jemalloc_bg_thd",)


def can_fork() -> bool:
    """Whether workers may be forked from this process directly, as torch's ``DataLoader``
    forks its own: on Linux, when no Python thread but this one runs and every native thread
    is one of the pools above (``/proc/self/task``). Then no thread can hold a lock that the
    child would inherit locked, which is what makes forking a threaded process unsafe, and the
    child starts in milliseconds with the parent's imports and caches (Beam, the tokenizer)
    instead of a fresh interpreter importing them for seconds."""
    if not sys.platform.startswith("linux") or threading.active_count() != 1:
        return False
    try:
        main = _thread_name("self")
        names = [_thread_name(f"self/task/{tid}") for tid in os.listdir("/proc/self/task")]
    except OSError:
        return False
    return all(name == main or name in _FORK_SAFE_NATIVE for name in names)


def _thread_name(where: str) -> str:
    with open(f"/proc/{where}/comm", encoding="utf-8", errors="replace") as f:
        return f.read().strip()


def start_worker_server() -> None:
    """Starts the forkserver now, without waiting for it: a fresh interpreter importing Beam
    takes seconds, which then overlap the caller's own start-up (compiling the pipeline, loading
    its tokenizer) instead of following it. ``ProcessBackend`` later finds it running."""
    _context()
    forkserver.ensure_running()


@dataclass(eq=False)
class _Worker:
    number: int
    process: Any  # multiprocessing's Process of the forkserver context
    conn: Connection
    progress: Any  # a shared array of doubles, see _TASK.._STARTED
    tasks: dict[int, Task] = field(default_factory=dict)
    #: Pickled chunks for the sender thread: a send blocks while the worker is busy and the
    #: pipe is full, and the dispatcher must never wait on one worker.
    outbox: queue.SimpleQueue[memoryview | None] = field(default_factory=queue.SimpleQueue)


def _poller(wake: int, workers: list[_Worker]) -> tuple[Any, dict[int, tuple[str, _Worker | None]]]:
    """A poll object watching the wake-up pipe ``wake`` and each worker's pipe and sentinel,
    and what each descriptor is."""
    poller = select.poll()
    handlers: dict[int, tuple[str, _Worker | None]] = {wake: ("wake", None)}
    for worker in workers:
        handlers[worker.conn.fileno()] = ("conn", worker)
        handlers[worker.process.sentinel] = ("sentinel", worker)
    for fd in handlers:
        poller.register(fd, select.POLLIN)
    return poller, handlers


def _has_input(conn: Connection) -> bool:
    """Whether reading ``conn`` would not block (data, or its end closed): one ``poll`` call,
    where ``Connection.poll`` builds a selector each time."""
    try:
        fd = conn.fileno()
    except OSError:  # closed: a read says so
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _start_sender(worker: _Worker) -> None:
    threading.Thread(target=_send_all, args=(worker,), name="zephon-worker-send", daemon=True).start()


def _send_all(worker: _Worker) -> None:
    """A worker's sender thread: writes its pickled chunks in order until told to stop or the
    worker is gone (the dispatcher learns that from the worker's sentinel)."""
    while (data := worker.outbox.get()) is not None:
        try:
            worker.conn.send_bytes(data)
        except (OSError, ValueError):
            return


def _why_no_start(exc: BaseException) -> str:
    """What a failed worker start means, by its error: the system refused a process, or the
    forkserver died while it started one."""
    what = f"{type(exc).__name__}: {exc}" if not isinstance(exc, OSError) or not exc.strerror else str(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.ENOMEM):
        return (
            f"{what}. The system refused a new process: too many processes for this user or "
            f"container (ulimit -u, the pids cgroup limit) or too little memory; lower "
            f"Loader(workers=...) or make room"
        )
    if isinstance(exc, ConnectionError | EOFError | FileNotFoundError):
        return (
            f"{what}. multiprocessing's forkserver, which starts the workers, died while it started this one"
        )
    return what


def _start_failure_message(note: str, count: int) -> str:
    return (
        f"worker processes die as they start: {count} in a row, none of them ready to run the "
        f"pipeline (the last: {note}). The most common cause: the script that makes this "
        f'Loader(backend="processes") runs it at top level. A worker started from the '
        f"forkserver (as when your process runs other threads, and for every replacement) "
        f"imports your main script again, and Python refuses to start processes while one is "
        f'starting. Keep the script\'s work under `if __name__ == "__main__":`. Otherwise the '
        f"workers' own error is printed above this one (stderr)."
    )


class ProcessBackend:
    """``workers`` processes, each with its own copy of the DoFns (pickled once, with Beam's
    pickler), fed chunks by one dispatcher thread.

    Faults recover by themselves: a worker that dies (SIGKILL, the OOM killer, ``os._exit``)
    is replaced and its chunks run again on the new one, so results, and the batches, do not
    change; a chunk that kills ``MAX_ATTEMPTS`` workers fails with ``WorkerLostError`` naming
    the worker, the lane, the operator and the record. A chunk that runs longer than
    ``chunk_timeout`` seconds fails with ``ChunkTimeoutError`` naming the DoFn and the record,
    and its worker is killed and replaced. ``close`` returns within a couple of seconds whatever
    the workers are doing. Workers never outlive the process that started them: each watches a
    pipe only the parent writes to and, on Linux, asks for SIGKILL when the forkserver (its
    parent, which exits with ours) dies.

    ``chunk_timeout`` is measured on ``clock``: a worker stamps a chunk's start on the system's
    time (the one clock processes share), carried onto ``clock`` by the ``skew`` taken as the
    chunk was sent, and the dispatcher looks again at once when ``clock`` jumps. Waits for
    processes to exit (``close``, a killed worker) stay on real time: a process takes real
    time to die.
    """

    def __init__(
        self,
        segment: FrontSegment,
        workers: int,
        *,
        chunk_timeout: float = 300.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._segment = segment
        self._payload = pickler.dumps(segment)
        self._sys_path = list(sys.path)
        self._timeout, self._clock = chunk_timeout, clock
        self._ctx = _context()
        self._alive_r, self._alive_w = self._ctx.Pipe(duplex=False)
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._lock = threading.Lock()
        self._pending: deque[Task] = deque()
        self._woken = False  # a wake-up is in the pipe that the dispatcher has not drained
        self._next_id = 0
        self._numbers = 0
        self._closing = False
        self._broken: Failure | None = None
        #: Why no worker can be started (set with ``_broken``): each chunk's failure names it.
        self._cannot_start: str | None = None
        self._start_failures = 0  # workers in a row that died before they were ready
        # The first workers are forked from this process when it is single-threaded (see
        # ``can_fork``), all before any thread of ours starts; replacements come from the
        # forkserver (by then the dispatcher runs).
        fork = multiprocessing.get_context("fork") if can_fork() else None
        self._workers: list[_Worker] = []
        try:
            for _ in range(workers):
                self._workers.append(self._start_worker(fork, sender=False))
        except Exception as exc:
            self._stop_started()
            raise WorkerLostError(
                f"the processes backend cannot start worker {len(self._workers)} of {workers} "
                f"for {self._dofns()}: {_why_no_start(exc)}"
            ) from exc
        for worker in self._workers:
            _start_sender(worker)
        self._unwatch = clock.on_move(self._wake)
        self._thread = threading.Thread(target=self._dispatch, name="zephon-workers", daemon=True)
        self._thread.start()

    # -- the caller's side -----------------------------------------------------------------
    def submit(self, chunk: Chunk, *, lane: int = -1) -> Future[ChunkResult]:
        # Never marked running: cancel() succeeds until the result is in, so a closing stream
        # is never left waiting on a chunk a stuck worker holds.
        future: Future[ChunkResult] = Future()
        with self._lock:
            if self._closing:
                future.cancel()
                return future
            task = Task(self._next_id, chunk, future, lane)
            self._next_id += 1
            if self._broken is not None:  # no dispatcher may be left to settle it
                self._fail(task)
                return future
            self._pending.append(task)
            wake, self._woken = not self._woken, True
        if wake:  # one wake-up in the pipe is enough: the dispatcher takes every pending chunk
            self._wake()
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
        self._wake()
        self._thread.join(timeout=CLOSE_GRACE)
        for worker in self._workers:
            worker.outbox.put(ForkingPickler.dumps(None))
            worker.outbox.put(None)
        self._alive_w.close()  # every worker's watchdog sees EOF and exits
        deadline = time.monotonic() + CLOSE_GRACE  # real time: the processes must really exit
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=CLOSE_GRACE)
            worker.conn.close()
            self._orphan(worker.tasks.values())
            worker.tasks.clear()
        with self._lock:
            pending, self._pending = list(self._pending), deque()
        self._orphan(pending)
        for conn in (self._alive_r, self._wake_r, self._wake_w):
            conn.close()

    # -- the dispatcher's side -------------------------------------------------------------
    def _wake(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._wake_w.send_bytes(b"")

    def _start_worker(self, fork: Any = None, *, sender: bool = True) -> _Worker:
        """A new worker process: forked from this process with ``fork`` (the fork context),
        else from the forkserver; its sender thread started unless ``sender`` is False."""
        ctx = fork or self._ctx
        parent, child = ctx.Pipe(duplex=True)
        _roomy(child)  # the worker's end: its results
        progress = ctx.RawArray(ctypes.c_double, 6)
        progress[_TASK] = _IDLE
        inherited: tuple[Connection, ...] = ()
        if fork is not None:
            others = (w.conn for w in self._workers)  # the workers forked before this one
            inherited = (parent, self._alive_w, self._wake_r, self._wake_w, *others)
        process = ctx.Process(
            target=_worker_main,
            args=(self._payload, self._sys_path, child, self._alive_r, progress, inherited),
            name=f"zephon-worker-{self._numbers}",
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        worker = _Worker(self._numbers, process, parent, progress)
        self._numbers += 1
        if sender:
            _start_sender(worker)
        return worker

    def _dispatch(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # a bug here must fail the loader, not hang it
            self._break(Failure.of(exc, f"the processes backend's dispatcher failed: {exc}"))
            for worker in self._workers:
                for task in worker.tasks.values():
                    self._fail(task)
            for task in self._drain():
                self._fail(task)

    def _break(self, failure: Failure, cannot_start: str | None = None) -> None:
        """Marks the backend broken (the first cause stays): from now on every chunk waiting
        for a worker and every chunk submitted fails with ``failure`` (or, when no worker can
        be started, a ``WorkerLostError`` naming the chunk and ``cannot_start``)."""
        with self._lock:
            if self._broken is None:
                self._broken, self._cannot_start = failure, cannot_start

    def _fail(self, task: Task) -> None:
        """Settles ``task`` with the reason the backend is broken."""
        assert self._broken is not None
        if self._cannot_start is None:
            settle(task.future, self._broken)
            return
        where = ""
        if task.chunk:
            index, record = task.chunk[0]
            where = f" (from {record.path} {record.where}, via {self._segment.sources[index].operator_name})"
        message = (
            f"lane {task.lane}: the processes backend cannot run a chunk of {len(task.chunk)} "
            f"record(s){where} through {self._dofns()}: {self._cannot_start}. Chunks already "
            f"on a live worker finish; every other chunk fails."
        )
        settle(task.future, Failure.of(WorkerLostError(message)))

    def _dofns(self) -> str:
        labels = [step.label for step in self._segment.stages]
        if not labels:
            return "its sources' decode"
        return ("DoFn " if len(labels) == 1 else "DoFns ") + ", ".join(map(repr, labels))

    def _stop_started(self) -> None:
        """Kills the workers started so far (a constructor that cannot start them all)."""
        self._alive_w.close()
        for worker in self._workers:
            worker.process.kill()
            worker.process.join(timeout=CLOSE_GRACE)
            worker.conn.close()
        for conn in (self._alive_r, self._wake_r, self._wake_w):
            conn.close()

    def _serve(self) -> None:
        # One poll object for the wake-up pipe and every worker's pipe and sentinel, rebuilt
        # only when a worker is replaced: ``multiprocessing.connection.wait`` would register
        # every handle anew on each call, which was most of this thread's time per chunk.
        wake = self._wake_r.fileno()
        watched = tuple(map(id, self._workers))  # the workers the poll object watches
        poller, handlers = _poller(wake, self._workers)
        while True:
            with self._lock:
                if self._closing:
                    return
            self._assign()
            if watched != (now := tuple(map(id, self._workers))):
                watched = now
                poller, handlers = _poller(wake, self._workers)
            timeout = self._next_deadline()
            events = poller.poll(None if timeout is None else max(1, int(timeout * 1000)))
            died: list[_Worker] = []
            for fd, _ in events:
                kind, worker = handlers[fd]
                if kind == "wake":
                    with contextlib.suppress(EOFError, OSError):
                        while _has_input(self._wake_r):
                            self._wake_r.recv_bytes()
                    with self._lock:  # chunks submitted from now on wake it again
                        self._woken = False
                elif kind == "conn":
                    assert worker is not None
                    self._receive(worker)
                else:
                    assert worker is not None
                    died.append(worker)
            for worker in died:  # after every result that came in with the death
                if worker in self._workers:
                    self._replace(worker, self._death_note(worker))
            self._check_deadlines()

    def _assign(self) -> None:
        if self._broken is not None:
            for task in self._drain():
                self._fail(task)
            return
        for worker in breadth_first(self._workers, lambda w: len(w.tasks), PER_WORKER):
            with self._lock:
                if not self._pending:
                    return
                task = self._pending.popleft()
            if task.future.cancelled():
                continue
            try:
                data = ForkingPickler.dumps((task.id, oob.pack_chunk(task.chunk)))  # a view: no copy
            except Exception as exc:
                settle(task.future, Failure.of(exc, f"a chunk cannot be sent to a worker: {exc}"))
                continue
            task.skew = skew(self._clock)
            worker.outbox.put(data)
            worker.tasks[task.id] = task

    def _receive(self, worker: _Worker) -> None:
        try:
            while _has_input(worker.conn):
                task_id, result = oob.recv(worker.conn)
                if task_id == -1:  # the worker could not install the DoFns: no worker can
                    self._break(result)
                    for task in [*worker.tasks.values(), *self._drain()]:
                        self._fail(task)
                    worker.tasks.clear()
                    return
                if task_id in worker.tasks:
                    settle(worker.tasks.pop(task_id).future, oob.unpack_result(result))
        except (EOFError, OSError):
            pass  # it died: the sentinel is (or will be) ready too

    def _drain(self) -> list[Task]:
        with self._lock:
            tasks, self._pending = list(self._pending), deque()
        return tasks

    def _running(self, worker: _Worker) -> tuple[Task | None, str]:
        """The chunk the worker is running (if any) and where in it, from its progress slots."""
        progress = worker.progress
        task = worker.tasks.get(int(progress[_TASK]))
        if task is None:
            return None, ""
        where = self._segment.describe(
            task.chunk, int(progress[_STAGE]), int(progress[_FIRST]), int(progress[_LAST])
        )
        return task, where

    def _death_note(self, worker: _Worker) -> str:
        worker.process.join(timeout=CLOSE_GRACE)
        code = worker.process.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
            if code == -signal.SIGKILL:
                how += " (the kernel's OOM killer sends it when memory runs out)"
        else:
            how = f"exited with code {code}"
        return f"worker {worker.number} (pid {worker.process.pid}) {how}"

    def _replace(
        self, worker: _Worker, note: str, *, failed: Task | None = None, error: Failure | None = None
    ) -> None:
        """Swaps a dead (or killed) worker for a new one; its chunks run again, except ``failed``.
        After ``START_ATTEMPTS`` workers in a row died before they were ready, fails the
        loader instead."""
        self._receive(worker)  # results it sent before dying still count
        if worker.progress[_READY]:
            self._start_failures = 0
        else:
            self._start_failures += 1
            if self._start_failures >= START_ATTEMPTS:
                self._break(Failure.of(WorkerLostError(_start_failure_message(note, self._start_failures))))
        running, where = self._running(worker)
        again: list[Task] = []
        for task in sorted(worker.tasks.values(), key=lambda t: t.id):
            if task is failed:
                assert error is not None
                settle(task.future, error)
                continue
            lost = task is running and record_death(
                task,
                f"{note} {where}",
                killed="worker processes",
                replacement="a new worker",
                logs="see the kernel log",
            )
            if not lost:
                again.append(task)
        worker.tasks.clear()
        worker.outbox.put(None)
        with contextlib.suppress(OSError):
            worker.conn.close()
        self._workers.remove(worker)
        with self._lock:
            self._pending.extendleft(reversed(again))
            if self._closing or self._broken is not None:
                return
        try:
            self._workers.append(self._start_worker())
        except Exception as exc:  # a refused fork, a forkserver that died while starting it
            why = f"{note}, and a worker to replace it cannot be started: {_why_no_start(exc)}"
            self._break(Failure.of(WorkerLostError(why)), cannot_start=why)

    def _started(self, worker: _Worker) -> tuple[Task | None, float]:
        """The chunk the worker is running (if any) and when it started, on the clock."""
        task = worker.tasks.get(int(worker.progress[_TASK]))
        if task is None:
            return None, 0.0
        return task, float(worker.progress[_STARTED]) + task.skew

    def _next_deadline(self) -> float | None:
        """Real seconds until the dispatcher next reads the clock (a jump wakes it sooner)."""
        starts = [started for task, started in map(self._started, self._workers) if task is not None]
        if not starts:
            return 1.0  # progress is not pushed: look again soon
        return max(0.01, min(min(starts) + self._timeout - self._clock.now(), 1.0))

    def _check_deadlines(self) -> None:
        now = self._clock.now()
        for worker in list(self._workers):
            task, started = self._started(worker)
            if task is None or now - started <= self._timeout:
                continue
            running, where = self._running(worker)
            if running is not task:  # it finished meanwhile
                continue
            worker.process.kill()
            message = (
                f"a stateless call ran for more than chunk_timeout={self._timeout:g} s {where} "
                f"(lane {task.lane}, worker {worker.number}, pid {worker.process.pid}): it is stuck "
                f"or too slow. The worker was killed and replaced. Fix the DoFn, or raise "
                f"Loader(chunk_timeout=...) if such records legitimately take this long."
            )
            worker.process.join(timeout=CLOSE_GRACE)
            note = f"worker {worker.number} (pid {worker.process.pid}) was killed past chunk_timeout"
            self._replace(worker, note, failed=task, error=Failure.of(ChunkTimeoutError(message)))

    def _orphan(self, tasks: Any) -> None:
        for task in tasks:
            task.future.cancel()
