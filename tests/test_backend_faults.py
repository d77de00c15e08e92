"""Process faults recover by themselves: dead workers are replaced, stuck calls are named and
killed, ``close`` returns within seconds, and workers never outlive the trainer."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import psutil
import pytest
from helpers import chain_spec, run_batches, write_jsonl

import zephon_flow as zf
from zephon_flow.core.clock import ManualClock
from zephon_flow.core.errors import ChunkTimeoutError, WorkerLostError

TARGET = 17
TESTS = Path(__file__).parent


class Fault(beam.DoFn):  # type: ignore[misc]
    """Passes ``{"n": n}`` through; on record ``TARGET`` misbehaves as ``mode`` says.

    ``once-*`` modes misbehave only the first time (a marker file in ``marker_dir`` remembers),
    so a retry on a new worker succeeds. ``hang`` and ``hold`` first leave the marker
    ``stuck`` (holding the pid of the process running the call); ``hold`` then waits until the
    test leaves ``released``.
    """

    def __init__(self, mode: str, marker_dir: str) -> None:
        self.mode, self.marker_dir = mode, marker_dir

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        n = int(text)
        if n == TARGET and self.mode != "none":
            if self.mode.startswith("once-"):
                try:
                    os.close(os.open(os.path.join(self.marker_dir, "fired"), os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    yield {"n": np.int64(n)}
                    return
            if self.mode.endswith("sigkill"):
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode.endswith("exit"):
                os._exit(3)
            if self.mode in ("hang", "hold"):  # "stuck" holds the pid, whole once it exists
                Path(self.marker_dir, "stuck.part").write_text(str(os.getpid()))
                Path(self.marker_dir, "stuck.part").rename(Path(self.marker_dir, "stuck"))
            if self.mode == "hang":
                time.sleep(3600)
            if self.mode == "hold":
                wait_for(Path(self.marker_dir, "released").exists)
        yield {"n": np.int64(n)}


def wait_for(happened: Callable[[], bool], seconds: float = 30.0) -> None:
    """Polls until ``happened()`` (an event, never time itself), failing after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not happened():
        assert time.monotonic() < deadline, f"still waiting for {happened}"
        time.sleep(0.01)


class CountingClock(ManualClock):
    """A manual clock that counts its readings, so that a test knows the loader looked at it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def now(self) -> float:
        self.reads += 1
        return super().now()

    def jump(self, seconds: float) -> None:
        """Moves ``seconds`` on, and returns once the deadlines were read since, twice (a jump
        of 0 wakes them again): what the first reading decided is done."""
        for step in (seconds, 0.0):
            seen = self.reads
            self.advance(step)
            wait_for(self._read_since(seen))

    def _read_since(self, seen: int) -> Callable[[], bool]:
        return lambda: self.reads > seen


class Inflate(beam.DoFn):  # type: ignore[misc]
    """A large record in, a larger array out: chunks and results that fill the worker pipes."""

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        n = int(text.split()[0])
        yield {"n": np.int64(n), "big": np.full(400_000, n, dtype=np.int32)}


def _spec(tmp_path: Path, mode: str) -> zf.LoaderSpec:
    path = tmp_path / "docs.jsonl"
    if not path.exists():
        write_jsonl(path, [str(i) for i in range(40)])
    return chain_spec(
        str(path),
        ("fault", Fault(mode, str(tmp_path))),
        lanes=2,
        global_batch_size=2,
        epochs=1,
        split_bytes=64,
    )


def _ns(batches: list[dict[str, np.ndarray]]) -> list[list[int]]:
    return [b["n"].tolist() for b in batches]


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["once-sigkill", "once-exit"])
def test_a_dead_worker_is_replaced_and_its_chunks_recomputed(tmp_path: Path, mode: str) -> None:
    expected = _ns(run_batches(_spec(tmp_path, "none")))
    got = _ns(run_batches(_spec(tmp_path, mode), backend="processes", workers=2, chunk_records=4))
    assert (tmp_path / "fired").exists(), "the fault never fired: the test tests nothing"
    assert got == expected
    assert any(TARGET in b for b in got)


@pytest.mark.timeout(120)
def test_large_chunks_and_results_do_not_deadlock_the_worker_pipes(tmp_path: Path) -> None:
    # Chunks of ~256 KiB and 1.6 MB results per record, two chunks queued per worker: a
    # dispatcher that wrote the next chunk itself would block on a busy worker that is
    # blocked writing its result back (both pipes full), and the loader would hang.
    path = tmp_path / "big.jsonl"
    write_jsonl(path, [f"{i} " + "x" * 150_000 for i in range(24)])
    spec = chain_spec(str(path), ("inflate", Inflate()), lanes=1, global_batch_size=1, epochs=1)
    got = run_batches(spec, backend="processes", workers=2, chunk_records=4, prefetch_chunks=8)
    assert [int(b["n"][0]) for b in got] == [int(b["n"][0]) for b in run_batches(spec, chunk_records=4)]
    assert sorted(int(b["n"][0]) for b in got) == list(range(24))
    assert all(int(b["big"][0, -1]) == int(b["n"][0]) for b in got)


@pytest.mark.timeout(60)
def test_a_record_that_kills_every_worker_fails_naming_worker_lane_operator_and_record(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path, "exit")
    with pytest.raises(WorkerLostError) as info:
        run_batches(spec, backend="processes", workers=2, chunk_records=4)
    text = str(info.value)
    assert "killed 3 worker processes in a row" in text
    assert text.count("exited with code 3 in DoFn 'fault' on the record at") == 3
    assert "docs.jsonl byte 245, via ReadJsonl('src')" in text  # record 17: 10 * 14 + 7 * 15 bytes in
    assert "lane " in text and "worker " in text and "(pid " in text
    assert "BrokenProcessPool" not in text


def _consume(loader: zf.Loader, failed: list[BaseException]) -> threading.Thread:
    """A thread reading ``loader`` to its end (then closing it), its error put in ``failed``."""

    def run() -> None:
        try:
            with loader:
                for _ in loader:
                    pass
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["processes", "threads"])
def test_a_stuck_call_is_named_and_its_worker_killed(tmp_path: Path, backend: str) -> None:
    # chunk_timeout is read on the loader's clock: once the call is stuck, the test moves the
    # clock past it, and nothing sleeps (a backend on the system's time would wait 1000 s).
    # One worker: the stuck call is the only one running when the clock jumps.
    spec = _spec(tmp_path, "hang")
    before = _descendants()
    clock = CountingClock()
    loader = zf.Loader(spec, backend=backend, workers=1, chunk_records=4, chunk_timeout=1000.0, clock=clock)
    failed: list[BaseException] = []
    consumer = _consume(loader, failed)
    wait_for((tmp_path / "stuck").exists)
    clock.jump(990.0)
    assert consumer.is_alive() and not failed, f"timed out before chunk_timeout: {failed}"
    if backend == "processes":  # killed at the first reading past the deadline, so not yet
        stuck = psutil.Process(int((tmp_path / "stuck").read_text()))
        assert stuck.is_running() and stuck.status() != "zombie", "the worker was killed before chunk_timeout"
    clock.advance(20.0)
    consumer.join(timeout=30)
    assert not consumer.is_alive(), "the stuck call was not timed out"
    assert len(failed) == 1 and isinstance(failed[0], ChunkTimeoutError), failed
    assert re.search(
        r"chunk_timeout=1000 s in DoFn 'fault' on the record at .*docs\.jsonl byte 245", str(failed[0])
    ), failed[0]
    if backend == "processes":
        _wait_gone(_descendants() - before - _multiprocessing_services())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["processes", "threads"])
def test_close_returns_within_seconds_while_a_call_hangs(tmp_path: Path, backend: str) -> None:
    spec = _spec(tmp_path, "hang")
    loader = zf.Loader(spec, backend=backend, workers=2, chunk_records=4)
    consumer = threading.Thread(target=lambda: [None for _ in loader], daemon=True)
    consumer.start()
    wait_for((tmp_path / "stuck").exists)  # the call on record TARGET is stuck
    started = time.monotonic()
    loader.close()
    assert time.monotonic() - started < 5
    consumer.join(timeout=5)
    assert not consumer.is_alive()


@pytest.mark.timeout(60)
def test_the_inline_backend_logs_a_call_past_its_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The call on record TARGET holds until the warning is logged, which takes the loader's
    # clock moved past chunk_timeout: no real time passes.
    expected = _ns(run_batches(_spec(tmp_path, "none")))
    clock = CountingClock()
    got: list[dict[str, np.ndarray]] = []

    def warned() -> bool:
        return any(
            "more than chunk_timeout=1000 s in DoFn 'fault' on the record at" in r.getMessage()
            and "cannot interrupt" in r.getMessage()
            for r in caplog.records
        )

    with caplog.at_level(logging.WARNING, logger="zephon_flow"):
        spec = _spec(tmp_path, "hold")
        consumer = threading.Thread(
            target=lambda: got.extend(run_batches(spec, chunk_records=4, chunk_timeout=1000.0, clock=clock)),
            daemon=True,
        )
        consumer.start()
        wait_for((tmp_path / "stuck").exists)
        clock.jump(990.0)
        assert not warned(), "logged before chunk_timeout"
        clock.advance(20.0)
        wait_for(warned)
        (tmp_path / "released").touch()
        consumer.join(timeout=30)
    assert _ns(got) == expected


def test_chunk_timeout_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(zf.SpecError, match=r"chunk_timeout must be a positive number of seconds, got 0"):
        zf.Loader(_spec(tmp_path, "none"), chunk_timeout=0)


TRAINER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_backend_faults import _spec
    from pathlib import Path
    import zephon_flow as zf
    loader = zf.Loader(_spec(Path({tmp!r}), "none"), backend="processes", workers=2, chunk_records=1)
    for step, batch in loader:
        if step == 0:
            print("ready", flush=True)
            time.sleep(3600)
    """
)


def _multiprocessing_services() -> set[int]:
    """multiprocessing's own per-process helpers (the forkserver, the resource tracker): they
    live as long as this process, started by whichever test first needed them, and are no
    loader's workers. Run alone, this test is the one that starts the resource tracker."""
    services = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
    return {p.pid for p in psutil.Process().children() if any(s in " ".join(p.cmdline()) for s in services)}


def _wait_gone(pids: set[int], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"}
        time.sleep(0.05)
    assert not alive, [" ".join(psutil.Process(pid).cmdline()) for pid in alive]


@pytest.mark.timeout(60)
def test_workers_die_with_a_killed_trainer(tmp_path: Path) -> None:
    script = TRAINER.format(tests=str(TESTS), tmp=str(tmp_path))
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "ready"
        family = {p.pid for p in psutil.Process(trainer.pid).children(recursive=True)}
        # Two workers, forked from the trainer (single-threaded here) or from a forkserver.
        assert len(family) >= 2, "expected two workers"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=10)
        _wait_gone(family)
    finally:
        if trainer.poll() is None:
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=10)
        if trainer.stdout is not None:
            trainer.stdout.close()
