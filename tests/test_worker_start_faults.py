"""The processes backend when a replacement worker cannot start (the system refuses a fork with
EAGAIN, or the forkserver dies while it starts one): every pending and later chunk fails with
``WorkerLostError`` naming the lane, the chunk, the DoFns and why, never a hang. And on the ray
backend, chunks submitted after its dispatcher died fail instead of waiting forever."""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from multiprocessing import forkserver
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from lane_parts import Lines, write_lines
from test_backend_faults import _spec

import zephon_flow as zf
from zephon_flow.core.errors import WorkerLostError
from zephon_flow.core.source import Record
from zephon_flow.runners.backends import make_backend
from zephon_flow.runners.backends.processes import ProcessBackend
from zephon_flow.runners.dofns import StatelessInvoker
from zephon_flow.runners.segment import Failure, FrontSegment

#: A guard against a hang only (a settled future returns at once): never a timed assertion.
SETTLES = 60.0


def _refuse_after(monkeypatch: pytest.MonkeyPatch, first: int, refuse: Callable[[], None]) -> list[int]:
    """Lets the first ``first`` worker starts through, then calls ``refuse`` before each other
    one (which raises, or breaks what the start needs); returns the list of refused starts."""
    original = ProcessBackend._start_worker
    started: list[int] = []
    refused: list[int] = []

    def start(self: ProcessBackend, *args: Any, **kwargs: Any) -> Any:
        if len(started) >= first:
            refused.append(len(started))
            refuse()
        started.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ProcessBackend, "_start_worker", start)
    return refused


def _eagain() -> None:
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))


@pytest.mark.timeout(120)
def test_a_refused_fork_fails_the_loader_naming_why_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = _refuse_after(monkeypatch, 2, _eagain)
    with pytest.raises(WorkerLostError) as info:
        for _ in zf.Loader(_spec(tmp_path, "once-sigkill"), backend="processes", workers=2, chunk_records=4):
            pass
    assert (tmp_path / "fired").exists() and refused, "the fault never fired: the test tests nothing"
    text = str(info.value)
    assert "the processes backend cannot run a chunk of " in text, text
    assert "was killed by SIGKILL" in text and "a worker to replace it cannot be started" in text, text
    assert f"[Errno {errno.EAGAIN}] {os.strerror(errno.EAGAIN)}" in text, text
    assert "too many processes" in text, text
    assert "through DoFn 'fault'" in text and "docs.jsonl byte " in text and "via ReadJsonl('src')" in text, (
        text
    )
    assert "dispatcher failed" not in text, text


class Echo(beam.DoFn):  # type: ignore[misc]
    def process(self, value: int) -> Iterator[int]:
        yield value


def _backend(tmp_path: Path, workers: int) -> tuple[ProcessBackend, Lines]:
    source = Lines(write_lines(tmp_path / "values.txt", range(8)), per_split=8)
    source.bind_label("numbers")
    segment = FrontSegment([source], [[StatelessInvoker("echo", Echo())]], [])
    backend = make_backend("processes", workers=workers, segment=segment)
    assert isinstance(backend, ProcessBackend)
    return backend, source


def _chunk(source: Lines, k: int) -> list[tuple[int, Record]]:
    return [(0, Record(str(k), source.paths()[0], f"line {k}", k))]


def _settled(future: Future[Any]) -> Any:
    return future.result(timeout=SETTLES)


def _lost(result: Any) -> str:
    assert isinstance(result, Failure), result
    assert result.error is WorkerLostError, result
    return result.message


def _kill_worker(backend: ProcessBackend) -> None:
    """SIGKILLs one worker by its pid and waits (on its sentinel: no reaping, no sleep) until it
    is gone."""
    worker = backend._workers[0]
    os.kill(worker.process.pid, signal.SIGKILL)
    wait([worker.process.sentinel])


@pytest.mark.timeout(120)
def test_chunks_submitted_after_the_backend_broke_fail_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuse_after(monkeypatch, 1, _eagain)
    backend, source = _backend(tmp_path, 1)
    try:
        assert backend.submit(_chunk(source, 0)).result(timeout=SETTLES) == [[0]]
        _kill_worker(backend)
        first = _settled(backend.submit(_chunk(source, 1), lane=3))
        # The backend is broken by now: later chunks must settle too (they used to wait forever
        # once the dispatcher had exited, and the lane with them in ReorderBuffer.take).
        later = [_settled(backend.submit(_chunk(source, k), lane=3)) for k in (2, 3)]
    finally:
        backend.close()
    for message in map(_lost, (first, *later)):
        assert message.startswith("lane 3: the processes backend cannot run a chunk of 1 record(s)"), message
        assert "(from " in message and "values.txt line " in message and "via Lines('numbers')" in message, (
            message
        )
        assert "through DoFn 'echo': worker 0 (pid " in message and "was killed by SIGKILL" in message, (
            message
        )
        assert "a worker to replace it cannot be started" in message, message
        assert os.strerror(errno.EAGAIN) in message, message


@pytest.mark.timeout(120)
def test_a_forkserver_killed_while_it_starts_a_worker_fails_every_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def kill_the_forkserver() -> None:
        # The forkserver is alive when the start checks it, and dies (SIGKILL, by its pid)
        # before it answers: the start finds nobody listening.
        server = forkserver._forkserver
        server.ensure_running()
        pid = server._forkserver_pid  # type: ignore[attr-defined]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # gone, left for ensure_running to reap
        monkeypatch.setattr(server, "ensure_running", lambda: None)

    refused = _refuse_after(monkeypatch, 1, kill_the_forkserver)
    backend, source = _backend(tmp_path, 1)
    try:
        assert backend.submit(_chunk(source, 0)).result(timeout=SETTLES) == [[0]]
        _kill_worker(backend)
        results = [_settled(backend.submit(_chunk(source, k), lane=1)) for k in (1, 2)]
    finally:
        backend.close()
        monkeypatch.undo()  # the next start checks the forkserver again (and starts a new one)
    assert refused
    for message in map(_lost, results):
        assert "through DoFn 'echo': worker 0 (pid " in message, message
        assert "a worker to replace it cannot be started: [Errno 111]" in message, message
        assert "forkserver, which starts the workers, died while it started this one" in message, message


@pytest.mark.timeout(120)
def test_workers_that_cannot_start_at_all_fail_the_backend_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _refuse_after(monkeypatch, 1, _eagain)
    started: list[Any] = []
    original = ProcessBackend._start_worker

    def start(self: ProcessBackend, *args: Any, **kwargs: Any) -> Any:
        worker = original(self, *args, **kwargs)
        started.append(worker.process)
        return worker

    monkeypatch.setattr(ProcessBackend, "_start_worker", start)  # wraps the refusing start
    with pytest.raises(WorkerLostError) as info:
        _backend(tmp_path, 2)
    text = str(info.value)
    assert text.startswith("the processes backend cannot start worker 1 of 2 for DoFn 'echo': [Errno 11]"), (
        text
    )
    assert "too many processes" in text, text
    assert len(started) == 1 and not started[0].is_alive()  # the one that started is stopped


@pytest.mark.timeout(180)
def test_chunks_submitted_after_the_ray_dispatcher_died_fail_instead_of_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray")
    from zephon_flow.runners.backends.ray import RayBackend

    def broken(self: RayBackend) -> None:
        raise RuntimeError("injected dispatcher fault")

    monkeypatch.setattr(RayBackend, "_serve", broken)
    source = Lines(write_lines(tmp_path / "values.txt", range(8)), per_split=8)
    source.bind_label("numbers")
    backend = make_backend(
        "ray", workers=1, segment=FrontSegment([source], [[StatelessInvoker("echo", Echo())]], [])
    )
    try:
        backend._thread.join()  # type: ignore[attr-defined]  # the dispatcher is gone
        result = _settled(backend.submit(_chunk(source, 0), lane=2))
    finally:
        backend.close()
    assert isinstance(result, Failure), result
    assert result.message == "the ray backend's dispatcher failed: injected dispatcher fault", result


def test_a_threads_chunk_is_settled_even_when_its_deadline_machinery_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure of the thread backend's own wrapper (not of the DoFn, which it reports as a
    ``Failure``) settles the chunk's future with it, instead of leaving the lane waiting."""
    from zephon_flow.runners.backends.threads import Deadlines, ThreadBackend

    source = Lines(write_lines(tmp_path / "values.txt", range(8)), per_split=8)
    source.bind_label("numbers")
    segment = FrontSegment([source], [[StatelessInvoker("echo", Echo())]], [])
    backend = make_backend("threads", workers=1, segment=segment)
    assert isinstance(backend, ThreadBackend)

    def broken(self: Deadlines, call: Any) -> Any:
        raise RuntimeError("the deadline bookkeeping failed")

    try:
        assert _settled(backend.submit(_chunk(source, 0))) == [[0]]
        monkeypatch.setattr(Deadlines, "run", broken)
        failed = backend.submit(_chunk(source, 1))
        with pytest.raises(RuntimeError, match="the deadline bookkeeping failed"):
            _settled(failed)
        monkeypatch.undo()
        assert _settled(backend.submit(_chunk(source, 2))) == [[2]]  # its thread is still there
    finally:
        backend.close()
