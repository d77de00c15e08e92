"""Unit tests of one source as one lane reads it: ``SourceReader`` (dealt shares, stride-shared
splits, cursors, read skips) and ``SourceStream`` (chunks on a backend, results back in order)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import apache_beam as beam
import pytest
from lane_parts import Lines, write_lines

from zephon_flow.core.checkpoint.state import SourceCursor
from zephon_flow.core.errors import DataError, StageError
from zephon_flow.core.source import START, Record
from zephon_flow.runners.backends import make_backend
from zephon_flow.runners.backends.base import ChunkResult
from zephon_flow.runners.backends.inline import InlineBackend
from zephon_flow.runners.backends.threads import ThreadBackend
from zephon_flow.runners.dealing import Dealing, Share
from zephon_flow.runners.dofns import StatelessInvoker
from zephon_flow.runners.plan import SourcePlan
from zephon_flow.runners.segment import Chunk, FrontSegment, Skipped
from zephon_flow.runners.streams import RAMP_RECORDS, RAMP_TAKEN, ReadSkip, SourceReader, SourceStream, Taken

FRESH = SourceCursor.first()


def _source(tmp_path: Path, values: Sequence[object], *, per_split: int, **kwargs: object) -> Lines:
    source = Lines(write_lines(tmp_path / "values.txt", values), per_split=per_split, **kwargs)
    source.bind_label("numbers")
    return source


def _read_all(reader: SourceReader) -> list[str | ReadSkip]:
    out: list[str | ReadSkip] = []
    while (got := reader.next()) is not None:
        out.append(got if isinstance(got, ReadSkip) else got.payload)
    return out


def _reader(source: Lines, lane: int, lanes: int, cursor: SourceCursor = FRESH) -> SourceReader:
    return SourceReader(source, "numbers", lane=lane, lanes=lanes, seed=7, cursor=cursor)


# -- SourceReader -------------------------------------------------------------------------------


def _dealt(source: Lines, lanes: int, lane: int, epoch: int) -> list[str]:
    """The lines lane ``lane`` owns in pass ``epoch``, in its order, from the dealing itself."""
    splits = source.splits(lanes)
    dealing = Dealing([s.cost for s in splits], lanes=lanes, seed=7, source="numbers")
    lines = Path(splits[0].path).read_text(encoding="utf-8").splitlines()
    return [
        lines[line]
        for share in dealing.shares(lane, epoch)
        for i, line in enumerate(range(splits[share.split].start, splits[share.split].stop))
        if share.keeps(i)
    ]


def test_each_lane_reads_its_dealt_shares_and_the_pass_holds_every_record_once(tmp_path: Path) -> None:
    source = _source(tmp_path, range(40), per_split=5, epochs=1)
    seen: list[int] = []
    for lane in range(3):
        got = _read_all(_reader(source, lane, 3))
        assert got == _dealt(source, 3, lane, 0) and got, lane
        seen += [int(v) for v in got]  # type: ignore[arg-type]
    assert sorted(seen) == list(range(40))


def test_a_split_shared_by_k_lanes_gives_lane_j_the_records_i_mod_k_equal_j(tmp_path: Path) -> None:
    source = _source(tmp_path, range(10), per_split=10, epochs=1)  # one split, three lanes
    dealing = Dealing([s.cost for s in source.splits(3)], lanes=3, seed=7, source="numbers")
    assert [dealing.shares(j, 0) for j in range(3)] == [(Share(0, 3, j),) for j in range(3)]
    assert [_read_all(_reader(source, j, 3)) for j in range(3)] == [
        ["0", "3", "6", "9"],
        ["1", "4", "7"],
        ["2", "5", "8"],
    ]


def test_a_lane_starts_the_next_pass_only_after_its_own_share(tmp_path: Path) -> None:
    source = _source(tmp_path, range(12), per_split=1, epochs=2)
    for lane in range(2):
        reader = _reader(source, lane, 2)
        assert _read_all(reader) == _dealt(source, 2, lane, 0) + _dealt(source, 2, lane, 1)
        assert reader.exhausted and reader.next() is None
    assert _dealt(source, 2, 0, 0) != _dealt(source, 2, 0, 1)  # each pass is dealt anew


@pytest.mark.parametrize("lanes", [2, 3])
def test_a_reader_from_any_cursor_continues_as_the_uninterrupted_one(tmp_path: Path, lanes: int) -> None:
    # 7 lines in splits of 4 and 3: with 3 lanes one of them is shared by stride (count matters)
    source = _source(tmp_path, range(7), per_split=4, epochs=2)
    for lane in range(lanes):
        reader = _reader(source, lane, lanes)
        whole = _read_all(reader)
        for k in range(len(whole) + 1):
            head = _reader(source, lane, lanes)
            for _ in range(k):
                head.next()
            assert _read_all(_reader(source, lane, lanes, head.cursor)) == whole[k:], (lane, k)


def test_a_read_error_of_a_skipping_source_drops_the_rest_of_its_split(tmp_path: Path) -> None:
    values: list[object] = [0, 1, 2, "unreadable", 4, 5]
    source = _source(tmp_path, values, per_split=6, epochs=2, on_error="skip")
    reader = _reader(source, 0, 1)
    got = _read_all(reader)
    message = f"Lines('numbers'): {tmp_path / 'values.txt'} line 3: cannot be read"
    # lines 4 and 5 are lost with the rest of the split, in each pass
    assert got == ["0", "1", "2", ReadSkip(message), "0", "1", "2", ReadSkip(message)]
    assert reader.cursor == SourceCursor(2, 0, START, 0)


def test_a_read_error_of_a_raising_source_names_the_file_and_line(tmp_path: Path) -> None:
    source = _source(tmp_path, [0, "unreadable"], per_split=2)
    reader = _reader(source, 0, 1)
    assert reader.next() is not None
    with pytest.raises(DataError, match=r"values\.txt line 1: cannot be read"):
        reader.next()


# -- SourceStream -------------------------------------------------------------------------------


class Recording:
    """The inline backend, noting the size of every chunk submitted."""

    def __init__(self, segment: FrontSegment) -> None:
        self._inner = InlineBackend(segment)
        self.sizes: list[int] = []

    def submit(self, chunk: Chunk, *, lane: int = -1) -> Future[ChunkResult]:
        self.sizes.append(len(chunk))
        return self._inner.submit(chunk)

    def hurry(self, future: Future[ChunkResult]) -> None:
        pass

    def close(self) -> None:
        pass


class Late:
    """Runs each chunk at once but completes its future from a timer thread, the odd-numbered
    submissions late: results arrive out of order. Notes the order of completion."""

    def __init__(self, segment: FrontSegment) -> None:
        self._segment = segment
        self._submitted = 0
        self.completed: list[int] = []
        self.hurried: list[int] = []  # submission numbers the stream asked to run next
        self._numbers: dict[int, int] = {}
        self._timers: list[threading.Timer] = []

    def submit(self, chunk: Chunk, *, lane: int = -1) -> Future[ChunkResult]:
        future: Future[ChunkResult] = Future()
        result, seq = self._segment.run_chunk(chunk), self._submitted
        self._submitted += 1
        self._numbers[id(future)] = seq

        def complete() -> None:
            self.completed.append(seq)
            future.set_result(result)

        timer = threading.Timer(0.3 if seq % 2 else 0.0, complete)
        self._timers.append(timer)
        timer.start()
        return future

    def hurry(self, future: Future[ChunkResult]) -> None:
        self.hurried.append(self._numbers[id(future)])

    def close(self) -> None:
        for timer in self._timers:
            timer.join()


class Fails(beam.DoFn):  # type: ignore[misc]
    def process(self, n: int) -> list[int]:
        if n == 5:
            raise ValueError(f"five is not allowed here ({n})")
        return [n]


def _stream(
    source: Lines, backend: object, chain: tuple[StatelessInvoker, ...] = (), **kw: int
) -> SourceStream:
    plan = SourcePlan("numbers", source, chain)
    options = {"chunk_records": 4, "depth": 3, **kw}
    return SourceStream(
        0,
        plan,
        backend,  # type: ignore[arg-type]
        lane=0,
        lanes=1,
        seed=7,
        cursor=FRESH,
        chunk_records=options["chunk_records"],
        depth=options["depth"],
    )


def _segment(source: Lines, chain: Sequence[StatelessInvoker] = ()) -> FrontSegment:
    return FrontSegment([source], [list(chain)], [])


def _take_all(stream: SourceStream) -> list[Taken]:
    out = []
    while (taken := stream.take()) is not None:
        out.append(taken)
    return out


def test_a_stream_hands_out_each_record_in_order_with_its_cursor_and_id(tmp_path: Path) -> None:
    source = _source(tmp_path, range(23), per_split=10, epochs=1)
    backend = Recording(_segment(source))
    got = _take_all(_stream(source, backend))
    reader = _reader(source, 0, 1)
    expected = []
    while (record := reader.next()) is not None:
        assert isinstance(record, Record)
        expected.append(([int(record.payload)], reader.cursor, (0, reader.split_index, record.offset)))
    assert [(t.result, t.after, t.doc) for t in got] == expected
    assert sorted(v for t in got for v in t.result) == list(range(23))  # type: ignore[union-attr]
    # slow start: chunks of 1, 2, 4 records, then chunk_records (4) each
    assert backend.sizes == [1, 2, 4, 4, 4, 4, 4]


def test_chunks_grow_past_ramp_records_only_as_the_stream_hands_them_out(tmp_path: Path) -> None:
    # Chunks double per submission up to RAMP_RECORDS; past it, once per RAMP_TAKEN chunks
    # taken, so a lane that has not been read yet does not read far ahead at the start.
    source = _source(tmp_path, range(2000), per_split=2000, epochs=1)
    backend = Recording(_segment(source))
    got = _take_all(_stream(source, backend, chunk_records=256, depth=3))
    assert [t.result for t in got] == [[n] for n in range(2000)]
    # Inline, each chunk is done at once and taken before the next one past the first three
    # is submitted: 1, 2, 4, 8, then 16 until 8 were taken, 32 until 16, 64 until 24, ...
    assert (RAMP_RECORDS, RAMP_TAKEN) == (16, 8)
    assert backend.sizes[:34] == [1, 2, 4, 8] + [16] * 6 + [32] * 8 + [64] * 8 + [128] * 8
    assert sum(backend.sizes) == 2000


def test_results_completing_out_of_order_are_taken_in_order(tmp_path: Path) -> None:
    source = _source(tmp_path, range(30), per_split=30, epochs=1)
    backend = Late(_segment(source))
    got = _take_all(_stream(source, backend, chunk_records=2, depth=4))
    backend.close()
    assert [t.result for t in got] == [[n] for n in range(30)]
    assert backend.completed != sorted(backend.completed)  # some arrived before an earlier one
    assert sorted(backend.completed) == list(range(len(backend.completed)))
    # The stream asked the backend to hurry the late chunks it waited for, and only those.
    assert backend.hurried and all(n % 2 == 1 for n in backend.hurried)


def test_a_record_that_fails_to_decode_in_a_skipping_source_comes_back_skipped(tmp_path: Path) -> None:
    source = _source(tmp_path, [0, 1, "bad", 3], per_split=4, epochs=1, on_error="skip")
    got = _take_all(_stream(source, InlineBackend(_segment(source))))
    assert [t.result for t in got] == [
        [0],
        [1],
        Skipped(f"Lines('numbers'): {tmp_path / 'values.txt'} line 2: not a number"),
        [3],
    ]
    assert got[2].after == SourceCursor(0, 0, 3, 3) and got[2].doc == (0, 0, 2)


def test_a_read_skip_travels_in_order_without_backend_work(tmp_path: Path) -> None:
    source = _source(tmp_path, [0, "unreadable", 2, 3], per_split=2, epochs=1, on_error="skip")
    got = _take_all(_stream(source, InlineBackend(_segment(source)), chunk_records=1))
    results = [t.result for t in got]
    assert sorted(r[0] for r in results if isinstance(r, list)) == [0, 2, 3]
    (skip,) = [(t.result, t.doc) for t in got if isinstance(t.result, Skipped)]
    assert skip == (
        Skipped(f"Lines('numbers'): {tmp_path / 'values.txt'} line 1: cannot be read"),
        (0, -1, -1),
    )


@pytest.mark.parametrize("backend", ["inline", "threads"])
def test_a_chunk_failure_comes_back_with_the_worker_traceback(tmp_path: Path, backend: str) -> None:
    source = _source(tmp_path, range(10), per_split=10, epochs=1)
    chain = (StatelessInvoker("strict", Fails()),)
    segment = _segment(source, chain)
    runs: InlineBackend | ThreadBackend = (
        InlineBackend(segment) if backend == "inline" else ThreadBackend(segment, 2)
    )
    stream = _stream(source, runs, chain, chunk_records=8)
    try:
        assert [stream.take() is not None for _ in range(3)] == [True] * 3  # chunks of 1 and 2 records
        with pytest.raises(StageError) as info:
            _take_all(stream)
    finally:
        runs.close()
    text = str(info.value)
    assert text.startswith(
        "DoFn 'strict' raised ValueError: five is not allowed here (5) "
        f"(on the record at {tmp_path / 'values.txt'} line 5, via Lines('numbers'))"
    )
    assert "-- traceback --" in text and "in process" in text  # in this process: no worker named


# -- read errors met ahead -----------------------------------------------------------------------


def test_a_read_error_met_while_reading_ahead_comes_after_the_records_before_it(tmp_path: Path) -> None:
    values: list[object] = [*range(9), "unreadable", 10]
    source = _source(tmp_path, values, per_split=11, epochs=1)
    stream = _stream(source, InlineBackend(_segment(source)), chunk_records=4, depth=4)
    taken = []
    with pytest.raises(DataError, match=r"values\.txt line 9: cannot be read"):
        while (got := stream.take()) is not None:
            taken.append(got.result)
    assert taken == [[n] for n in range(9)]


class Refusing:
    """The inline backend, refusing the ``refuse``-th submission (counted from 0) by raising."""

    def __init__(self, segment: FrontSegment, refuse: int) -> None:
        self._inner, self._refuse, self._count = InlineBackend(segment), refuse, 0

    def submit(self, chunk: Chunk, *, lane: int = -1) -> Future[ChunkResult]:
        self._count += 1
        if self._count - 1 == self._refuse:
            raise RuntimeError("the backend is gone")
        return self._inner.submit(chunk)

    def hurry(self, future: Future[ChunkResult]) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_submit_that_raises_is_raised_after_the_records_before_it_not_waited_for(tmp_path: Path) -> None:
    source = _source(tmp_path, range(20), per_split=20, epochs=1)
    stream = _stream(source, Refusing(_segment(source), refuse=2), chunk_records=4, depth=4)
    outcome: list[object] = []

    def drain() -> None:
        taken = []
        try:
            while (got := stream.take()) is not None:
                taken.append(got.result)
        except RuntimeError as exc:
            outcome.append((taken, str(exc)))

    worker = threading.Thread(target=drain, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "take() waited for a chunk that was never submitted"
    assert outcome == [([[0], [1], [2]], "the backend is gone")]  # chunks of 1 and 2 records first


class Ran(beam.DoFn):  # type: ignore[misc]
    """Which process ran the record and when its work started, after a pause long enough to
    keep the chunks submitted together in flight together."""

    def __init__(self, pause: float) -> None:
        self.pause = pause

    def process(self, value: str) -> Iterator[tuple[int, int, float]]:
        started = time.monotonic()
        time.sleep(self.pause)
        yield int(value), os.getpid(), started


def _on_processes(
    tmp_path: Path, n: int, pause: float, *, hurry: int | None = None
) -> dict[int, tuple[int, float]]:
    """Submits ``n`` one-record chunks together to a processes backend of 2 workers (then
    hurries chunk ``hurry``); per record, the pid that ran it and when it started."""
    source = _source(tmp_path, range(n), per_split=n, epochs=1)
    backend = make_backend(
        "processes", workers=2, segment=_segment(source, [StatelessInvoker("ran", Ran(pause))])
    )
    try:
        records = [(0, Record(str(k), source.paths()[0], f"line {k}", k)) for k in range(n)]
        futures = [backend.submit([record]) for record in records]
        if hurry is not None:
            backend.hurry(futures[hurry])
        ran = {}
        for future in futures:
            result = future.result(timeout=60)
            assert isinstance(result, list)
            ((value, pid, started),) = result[0]  # type: ignore[misc]
            ran[value] = (pid, started)
    finally:
        backend.close()
    return ran


def test_two_chunks_submitted_together_run_on_two_workers_not_one_after_the_other(tmp_path: Path) -> None:
    """The processes backend gives every idle worker a chunk before queueing a second chunk
    behind a busy one (it used to fill the first worker's queue first)."""
    pids = [pid for pid, _ in _on_processes(tmp_path, 2, 0.2).values()]
    assert pids[0] != pids[1], pids


def test_a_hurried_chunk_runs_before_chunks_submitted_earlier(tmp_path: Path) -> None:
    """``hurry`` moves a waiting chunk to the front of the processes backend's queue: what a
    lane does when it is blocked on it while other lanes' read-ahead is queued."""
    ran = _on_processes(tmp_path, 7, 0.4, hurry=6)  # the first 4 fill both workers
    started = {value: when for value, (_, when) in ran.items()}
    assert started[6] < started[4] and started[6] < started[5], started
