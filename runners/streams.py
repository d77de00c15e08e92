"""One source as one lane reads it: its dealt splits from a cursor, read ahead on the backend in order."""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

from zephon_flow.core.checkpoint.state import SourceCursor
from zephon_flow.core.errors import DataError
from zephon_flow.core.markers import DocId
from zephon_flow.core.source import START, Record, Source, Split
from zephon_flow.runners.backends.base import Backend, ChunkResult
from zephon_flow.runners.dealing import Dealing, Share
from zephon_flow.runners.plan import SourcePlan
from zephon_flow.runners.reorder import ReorderBuffer
from zephon_flow.runners.segment import Chunk, Failure, RecordResult, Skipped

#: A chunk is closed once its records' payloads reach this many bytes, or at ``chunk_records``
#: records (``CHUNK_RECORDS`` by default), whichever comes first: the work a chunk carries is
#: about its bytes, what it costs to send and settle is per chunk. Measured against 16 records
#: and 256 KB, back to back (2 workers): documents of ~150 tokens 3.0-3.7M -> 4.1-4.7M tokens/s
#: (chunks of 16 records were 10 KB: their overhead, not the tokenizer, set the pace); ~3,800
#: tokens unchanged within the noise (6.3-6.8M either way); the VLM workload 560-569 -> 601-632
#: images/s, its first batch 0.54-0.72 -> 0.25-0.39 s (the records its first windows need no
#: longer share a chunk with the large photos that follow them).
CHUNK_BYTES = 128 * 1024
CHUNK_RECORDS = 256
#: A stream's chunks hold at most this many records until it has handed out ``RAMP_TAKEN``
#: chunks, then twice as many until ``2 * RAMP_TAKEN``, and so on up to ``chunk_records``. A
#: lane's first window of short documents takes about 30 chunks: growing by chunks submitted
#: alone, every lane read 2,300 records ahead before the first batch (11,900 in all, against
#: 3,600 with chunks of 16), and the first batch came 0.55-0.61 s after ``Loader()`` instead
#: of 0.24-0.29 s; with this ramp 0.32-0.36 s, and the same rate once past it.
RAMP_RECORDS = 16
RAMP_TAKEN = 8
_RAMP_DOUBLINGS = RAMP_RECORDS.bit_length() - 1  # 2**4 = 16
#: Chunks a stream puts in flight before any is taken (of 1, 2 and 4 records): every lane's
#: first window then keeps the workers busy from the start, not one doubling at a time while
#: the lane thread is still on an earlier lane. Measured against one chunk, both with 8 per
#: lane: after ``Loader()``, text's first batch 0.8-1.0 s -> 0.5-0.7 s; VLM's 0.48-0.52 ->
#: 0.38-0.44 s.
START_CHUNKS = 3


@dataclass(frozen=True)
class ReadSkip:
    """The rest of a split dropped after a ``DataError`` while reading (``on_error="skip"``)."""

    message: str


class SourceReader:
    """One source as seen by one lane: its shares of each pass in order, from a cursor
    (``SourceCursor``; the reader keeps its fields as plain attributes, as it moves them per
    record)."""

    def __init__(
        self, source: Source, label: str, *, lane: int, lanes: int, seed: int, cursor: SourceCursor
    ) -> None:
        self._source, self._label = source, label
        self._lane, self._lanes, self._seed = lane, lanes, seed
        self.epoch, self.item, self.position, self.count = (
            cursor.epoch,
            cursor.share,
            cursor.position,
            cursor.count,
        )
        self._records: Iterator[tuple[int, Record]] | None = None
        self._share: Share | None = None
        self._dealing: Dealing | None = None
        self.exhausted = False
        #: The index (in the source's split table) of the split being read.
        self.split_index = -1

    def _shares(self) -> tuple[Share, ...]:
        if self._dealing is None:
            splits = self._source.splits(self._lanes)
            self._dealing = Dealing(
                [s.cost for s in splits], lanes=self._lanes, seed=self._seed, source=self._label
            )
        return self._dealing.shares(self._lane, self.epoch)

    def _open(self) -> bool:
        """Opens the share at the cursor (moving on to the next pass after the last share);
        False once the source's passes are used up."""
        while True:
            if self._source.epochs is not None and self.epoch >= self._source.epochs:
                return False
            shares = self._shares()
            if self.item < len(shares):
                break
            self.epoch, self.item, self.position, self.count = self.epoch + 1, 0, START, 0
        share = shares[self.item]
        split = self._source.splits(self._lanes)[share.split]
        if share.of > 1:
            _note_shared(self._source, self._label, split, share.of)
        self._share, self.split_index = share, share.split
        self._records = self._source.read_split_in_pass(split, self.position, self.epoch)
        return True

    def _next_share(self) -> None:
        self._records, self._share = None, None
        self.item, self.position, self.count = self.item + 1, START, 0

    def next(self) -> Record | ReadSkip | None:
        """The lane's next record of this source, a read skip, or None once its passes are used up."""
        while not self.exhausted:
            try:
                if self._records is None and not self._open():
                    self.exhausted = True
                    return None
                assert self._records is not None and self._share is not None
                step = next(self._records, None)
            except DataError as exc:
                if self._source.on_error != "skip":
                    raise
                self._next_share()
                return ReadSkip(str(exc))
            if step is None:
                self._next_share()
                continue
            self.position, record = step
            self.count += 1
            if self._share.keeps(self.count - 1):
                return record
        return None

    @property
    def cursor(self) -> SourceCursor:
        return SourceCursor(self.epoch, self.item, self.position, self.count)


#: Ints per cursor in ``_Sent.cursors``: a ``SourceCursor``'s fields, in order.
CURSOR_LENGTH = 4
_noted: set[tuple[str, str]] = set()
_log = logging.getLogger("zephon_flow")


def _note_shared(source: Source, label: str, split: Split, k: int) -> None:
    """Logs once per process and file that lanes share a split by stride, and what it costs."""
    key = (label, split.path)
    if key in _noted:
        return
    _noted.add(key)
    _log.info(
        "%s: %s cannot be split finer for this lane count; %d lanes share a split of it by "
        "stride (each reads the whole split and keeps every %d-th record)",
        source.operator_name,
        split.path,
        k,
        k,
    )


class Taken(NamedTuple):
    """One record of a source, in order: its outputs (or skip note), the cursor after it, its id.
    (A named tuple: one is made per record, three times faster than a frozen dataclass.)"""

    result: RecordResult
    after: SourceCursor
    doc: DocId


class _Sent:
    """What a stream remembers of a chunk in flight, per record, as columns: the cursor after
    each record (``CURSOR_LENGTH`` ints each, end to end), each record's split and offset (its
    id with the stream's source index), and the messages of read skips by their place.

    Columns, not a tuple, a list and an id per record (and ``take`` makes each ``Taken`` when
    it hands it out, not a whole chunk's at once): records in flight live long enough for
    Python's cycle collector to count, promote and scan them. On documents of ~150 tokens
    (stand-in tokenizer, 200 steps of 64 x 2048) that was 348-360 young, 32-33 middle and 3
    full collections per run, 0.44-0.49 s of the consumer's CPU; with columns 70-81, 7-8 and
    1, 0.13-0.16 s."""

    __slots__ = ("cursors", "notes", "offsets", "splits")

    def __init__(self) -> None:
        self.cursors: list[int] = []
        self.splits: list[int] = []
        self.offsets: list[int] = []
        self.notes: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.splits)

    def add(self, reader: SourceReader, split: int, offset: int) -> None:
        """Notes a record just read by ``reader``: the cursor after it, its split and offset."""
        self.cursors += (reader.epoch, reader.item, reader.position, reader.count)
        self.splits.append(split)
        self.offsets.append(offset)

    def add_skip(self, reader: SourceReader, message: str) -> None:
        self.notes[len(self.splits)] = message
        self.add(reader, -1, -1)

    def cursor(self, i: int) -> SourceCursor:
        """The cursor after record ``i``."""
        c, at = self.cursors, i * CURSOR_LENGTH
        return SourceCursor(c[at], c[at + 1], c[at + 2], c[at + 3])


class SourceStream:
    """Reads one source ahead for one lane: chunks of its records go to the backend, results
    come back through a reorder buffer, and ``take`` hands them out one record at a time.

    Slow start: the k-th chunk holds at most 2**k records (and ``RAMP_RECORDS``, doubled per
    ``RAMP_TAKEN`` chunks taken) and the in-flight budget starts at ``START_CHUNKS`` and grows
    by one per chunk taken, so the first record after a (re)start
    needs one small chunk, not the full read-ahead; steady state is ``depth`` chunks of
    ``chunk_records`` records (or ``CHUNK_BYTES``). A lane waiting for a chunk that no worker
    has started asks the backend to run it next (``Backend.hurry``). A read error met while
    reading ahead is raised once the records before it have been taken, so they are delivered
    first.
    """

    def __init__(
        self,
        index: int,
        plan: SourcePlan,
        backend: Backend,
        *,
        lane: int,
        lanes: int,
        seed: int,
        cursor: SourceCursor,
        chunk_records: int,
        depth: int,
    ) -> None:
        self._index, self._backend, self._lane = index, backend, lane
        self._reader = SourceReader(plan.source, plan.label, lane=lane, lanes=lanes, seed=seed, cursor=cursor)
        self._chunk_records, self._depth = chunk_records, depth
        self._reorder: ReorderBuffer[ChunkResult] = ReorderBuffer(
            f"lane {lane} source {plan.label!r} stateless results"
        )
        # Per chunk in flight, in order: its records' cursors and ids, and the backend's future
        # (cancelled on close).
        self._inflight: deque[tuple[_Sent, Future[ChunkResult]]] = deque()
        # The chunk being handed out: its columns, its outputs, its next record and its end.
        self._head = _Sent()
        self._outputs: Iterator[RecordResult] = iter(())
        self._next = self._end = 0
        self._ended = False
        self._submitted = 0
        self._taken = 0
        #: A read error met ahead of the records still in flight: raised after them.
        self._error: Exception | None = None

    def _records_cap(self) -> int:
        """Records in the next chunk at most: ``2**k`` for the k-th, and ``RAMP_RECORDS``
        doubled once per ``RAMP_TAKEN`` chunks taken (read-ahead grows as the lane consumes)."""
        doublings = min(self._submitted, _RAMP_DOUBLINGS + self._taken // RAMP_TAKEN, 30)
        return min(self._chunk_records, 1 << doublings)

    def _submit_one(self) -> bool:
        if self._ended:
            return False
        chunk: Chunk = []
        sent = _Sent()
        reader = self._reader
        size = 0
        for _ in range(self._records_cap()):
            try:
                got = reader.next()
            except Exception as exc:
                if not len(sent):
                    raise
                self._error = exc  # the records read before it still go out, in order
                break
            if got is None:
                self._ended = True
                break
            if isinstance(got, ReadSkip):
                sent.add_skip(reader, got.message)
                continue
            chunk.append((self._index, got))
            sent.add(reader, reader.split_index, got.offset)
            size += _payload_size(got)
            if size >= CHUNK_BYTES:
                break
        if not len(sent):
            return False
        if chunk:
            future = self._backend.submit(chunk, lane=self._lane)
        else:  # only read skips: nothing for the backend to do
            future = Future()
            future.set_result([])
        # Reserved once submitted: a submit that raises leaves no number the buffer would wait for.
        self._submitted += 1
        seq = self._reorder.expect()
        self._inflight.append((sent, future))
        future.add_done_callback(functools.partial(self._deliver, seq))
        return True

    def _deliver(self, seq: int, future: Future[ChunkResult]) -> None:
        self._reorder.put(seq, _result(future))

    def prime(self, chunks: int = START_CHUNKS) -> None:
        """Submits its first ``chunks`` chunks now (at most its start budget), so lanes and
        sources start their stateless work together (``prime_lanes``: every lane's first
        chunk before any lane's second)."""
        self._top_up(chunks)

    def _top_up(self, limit: int | None = None) -> None:
        budget = min(self._depth, START_CHUNKS + self._taken)
        if limit is not None:
            budget = min(budget, limit)
        while self._error is None and self._reorder.in_flight() < budget:
            try:
                if not self._submit_one():
                    return
            except Exception as exc:  # raised by take once the records before it are out
                self._error = exc

    def take(self) -> Taken | None:
        """The source's next record in order, or None when the source has no more."""
        sent = self._head
        while self._next >= self._end:
            self._top_up()
            if self._reorder.in_flight() == 0:
                if self._error is not None:
                    raise self._error
                return None
            head = self._inflight[0][1]
            if not head.done():  # the lane waits for it: ahead of other lanes' read-ahead
                self._backend.hurry(head)
            result = self._reorder.take()
            self._taken += 1
            sent, _ = self._inflight.popleft()
            if isinstance(result, Failure):
                result.reraise()
            self._head, self._outputs, self._next, self._end = sent, iter(result), 0, len(sent)
        i = self._next
        self._next = i + 1
        after = sent.cursor(i)
        note = sent.notes.get(i) if sent.notes else None
        if note is not None:
            return Taken(Skipped(note), after, (self._index, -1, -1))
        return Taken(next(self._outputs), after, (self._index, sent.splits[i], sent.offsets[i]))

    def close(self) -> None:
        # Called from another thread than the lane's: copy the deque in one step (atomic).
        for _, future in tuple(self._inflight):
            future.cancel()


_TEXT = (str, bytes)  # a tuple: ``str | bytes`` would build a union on every call


def _payload_size(record: Record) -> int:
    """Bytes a record brings, for closing chunks: text and bytes by length, samples that know
    their size (``nbytes``, e.g. a WebDataset sample) by that, anything else as 1 KiB."""
    payload = record.payload
    if isinstance(payload, _TEXT):
        return len(payload)
    nbytes = getattr(payload, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else 1024


def _result(future: Future[ChunkResult]) -> ChunkResult:
    if future.cancelled():
        return Failure(False, "stateless work was cancelled (the loader is closing)", "")
    exc = future.exception()
    if exc is not None:  # the backend itself failed (a worker process died, ...)
        return Failure.of(exc, f"stateless backend failed: {type(exc).__name__}: {exc}")
    return future.result()
