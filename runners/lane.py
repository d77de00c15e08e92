"""One lane: its feed (sources, mix, chunks on a backend, reorder buffer) and its ordered back."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from zephon_flow.errors import CorruptStateError
from zephon_flow.operators.splits import START, Record, Source, dealt_split
from zephon_flow.runners.backends.base import Backend, ChunkResult
from zephon_flow.runners.dofns import DocId, DoFnLaneState, StatefulInvoker, dofn_errors, dofn_seed
from zephon_flow.runners.plan import Plan
from zephon_flow.runners.reorder import ReorderBuffer
from zephon_flow.runners.segment import Chunk, Failure
from zephon_flow.state import FeedCursor, LaneState


class SourceReader:
    """One source as seen by one lane: its dealt splits in order, from a cursor."""

    def __init__(
        self,
        source: Source,
        label: str,
        *,
        lane: int,
        lanes: int,
        seed: int,
        item: int,
        position: int,
    ) -> None:
        self._source, self._label = source, label
        self._lane, self._lanes, self._seed = lane, lanes, seed
        self.item, self.position = item, position
        self._records: Iterator[tuple[int, Record]] | None = None
        self.exhausted = False
        #: The index (in the source's split table) of the split being read.
        self.split_index = -1

    def next(self) -> Record | None:
        """The next record, or None once the source's epochs are used up."""
        splits = self._source.splits()
        entry = (self.item, self.position)
        while not self.exhausted:
            if self._records is None:
                epoch, index = dealt_split(
                    n_splits=len(splits),
                    lanes=self._lanes,
                    lane=self._lane,
                    item=self.item,
                    seed=self._seed,
                    source=self._label,
                )
                if self._source.epochs is not None and epoch >= self._source.epochs:
                    # Keep the cursor where the last record left it, so the end of the data
                    # has one canonical position whatever the chunking.
                    self.item, self.position = entry
                    self.exhausted = True
                    return None
                self._records = self._source.read_split(splits[index], self.position)
                self.split_index = index
            step = next(self._records, None)
            if step is not None:
                self.position, record = step
                return record
            self._records, self.item, self.position = None, self.item + 1, START
        return None

    @property
    def cursor(self) -> list[int]:
        return [self.item, self.position]


class LaneFeed:
    """Reads a lane's records in order, runs the stateless front ahead on the backend, and
    yields outputs in sequence order with the cursor to resume *after* each of them."""

    def __init__(
        self,
        plan: Plan,
        backend: Backend,
        *,
        lane: int,
        lanes: int,
        seed: int,
        cursor: FeedCursor,
        chunk_records: int,
        depth: int,
    ) -> None:
        self._plan, self._backend = plan, backend
        self._lane = lane
        self._mix_seed = dofn_seed(seed, plan.mix_label or "")
        self._readers = [
            SourceReader(sp.source, sp.label, lane=lane, lanes=lanes, seed=seed, item=item, position=pos)
            for sp, (item, pos) in zip(plan.sources, cursor.sources, strict=True)
        ]
        self._mix_position = cursor.mix_position
        self._skip = cursor.skip
        self._chunk_records, self._depth = chunk_records, depth
        self._reorder: ReorderBuffer[ChunkResult] = ReorderBuffer(f"lane {lane} stateless results")
        # Per chunk in flight, in order: cursors before each record, the cursor after the
        # last one, each record's provenance id, and the backend's future (cancelled on close).
        self._inflight: deque[tuple[list[FeedCursor], FeedCursor, list[DocId], Future[ChunkResult]]] = deque()
        self._ended = False
        # Slow start: the k-th chunk holds at most 2**k records and the in-flight budget grows
        # by one per chunk taken, so the first outputs after a (re)start need one small
        # chunk, not the full read-ahead; steady state is ``depth`` chunks of
        # ``chunk_records`` records (or ``CHUNK_BYTES``).
        self._submitted = 0
        self._taken = 0

    def _cursor(self) -> FeedCursor:
        return FeedCursor(self._mix_position, [r.cursor for r in self._readers])

    def _read(self) -> tuple[int, Record, DocId] | None:
        if self._plan.mixer is None:
            index = 0
        else:
            index = self._plan.mixer.choose(self._mix_seed, self._lane, self._mix_position)
        reader = self._readers[index]
        record = reader.next()
        if record is None:
            return None
        self._mix_position += 1
        return index, record, (index, reader.split_index, record.offset)

    def _submit_one(self) -> bool:
        if self._ended:
            return False
        chunk: Chunk = []
        befores: list[FeedCursor] = []
        docs: list[DocId] = []
        size = 0
        for _ in range(min(self._chunk_records, 1 << min(self._submitted, 30))):
            before = self._cursor()
            item = self._read()
            if item is None:
                self._ended = True
                break
            index, record, doc = item
            befores.append(before)
            chunk.append((index, record))
            docs.append(doc)
            size += _payload_size(record)
            if size >= CHUNK_BYTES:
                break
        if not chunk:
            return False
        self._submitted += 1
        seq = self._reorder.expect()
        after = self._cursor()
        future = self._backend.submit(chunk)
        self._inflight.append((befores, after, docs, future))
        future.add_done_callback(functools.partial(self._deliver, seq))
        return True

    def _deliver(self, seq: int, future: Future[ChunkResult]) -> None:
        self._reorder.put(seq, _result(future))

    def prime(self) -> None:
        """Submits the first chunk(s) now, so lanes start their stateless work together."""
        self._top_up()

    def _top_up(self) -> None:
        budget = min(self._depth, 1 + self._taken)
        while self._reorder.in_flight() < budget and self._submit_one():
            pass

    def __iter__(self) -> Iterator[tuple[Any, FeedCursor, DocId]]:
        while True:
            self._top_up()
            if self._reorder.in_flight() == 0:
                return
            result = self._reorder.take()
            self._taken += 1
            befores, after, docs, _ = self._inflight.popleft()
            if isinstance(result, Failure):
                result.reraise()
            assert isinstance(result, list)
            for i, outputs in enumerate(result):
                first = self._skip if i == 0 else 0
                self._skip = 0
                for j in range(first, len(outputs)):
                    if j + 1 < len(outputs):
                        resume = FeedCursor(befores[i].mix_position, befores[i].sources, j + 1)
                    else:
                        resume = befores[i + 1] if i + 1 < len(befores) else after
                    yield outputs[j], resume, docs[i]

    def close(self) -> None:
        for *_, future in self._inflight:
            future.cancel()


#: A chunk is closed once its records' payloads reach this many bytes (long documents).
CHUNK_BYTES = 256 * 1024


def _payload_size(record: Record) -> int:
    payload = record.payload
    return len(payload) if isinstance(payload, str | bytes) else 1024


def _result(future: Future[ChunkResult]) -> ChunkResult:
    if future.cancelled():
        return Failure(False, "stateless work was cancelled (the loader is closing)", "")
    exc = future.exception()
    if exc is not None:  # the backend itself failed (a worker process died, ...)
        return Failure.of(exc, f"stateless backend failed: {type(exc).__name__}: {exc}")
    return future.result()


class LaneRunner:
    """Runs one lane to window boundaries; its snapshot is the lane's entire checkpoint."""

    def __init__(
        self,
        plan: Plan,
        backend: Backend,
        *,
        lane: int,
        lanes: int,
        seed: int,
        window: int,
        state: LaneState | None,
        chunk_records: int,
        depth: int,
    ) -> None:
        self._plan, self._window = plan, window
        self.lane = lane
        if state is None:
            state = LaneState(lane, FeedCursor(0, [[0, START] for _ in plan.sources]))
            state.stages = {s.label: DoFnLaneState().to_plain() for s in plan.stateful}
        missing = [s.label for s in plan.stateful if s.label not in state.stages]
        if missing or len(state.cursor.sources) != len(plan.sources):
            raise CorruptStateError(
                f"state of lane {lane} does not match the pipeline: missing stateful stage(s) "
                f"{missing} or wrong number of source cursors ({len(state.cursor.sources)})"
            )
        self._cursor = state.cursor
        self._stages = {s.label: DoFnLaneState.from_plain(state.stages[s.label]) for s in plan.stateful}
        self._pending = list(state.pending)
        self._ended = state.ended
        self._feed = LaneFeed(
            plan,
            backend,
            lane=lane,
            lanes=lanes,
            seed=seed,
            cursor=state.cursor,
            chunk_records=chunk_records,
            depth=depth,
        )
        self._stream = iter(self._feed)

    def _push(self, index: int, value: Any, doc: DocId | None) -> None:
        back = self._plan.back
        if index == len(back):
            self._pending.append(value)
            return
        step = back[index]
        with dofn_errors(step.label, f"lane {self.lane}, after source cursor {self._cursor.to_plain()}"):
            if isinstance(step, StatefulInvoker):
                outputs = step.process(self.lane, value, self._stages[step.label], doc)
            else:
                outputs = step(value)
        for out in outputs:
            self._push(index + 1, out, doc)

    def _end_of_input(self) -> None:
        back = self._plan.back
        for i, step in enumerate(back):
            if isinstance(step, StatefulInvoker):
                with dofn_errors(step.label, f"lane {self.lane}, in a timer at the end of its input"):
                    outputs = step.fire_timers(self.lane, self._stages[step.label], None)
                for out in outputs:
                    self._push(i + 1, out, None)
        self._ended = True

    def next_window(self) -> list[Any] | None:
        """The lane's next ``window`` outputs, or None when its input ended first."""
        while len(self._pending) < self._window and not self._ended:
            item = next(self._stream, None)
            if item is None:
                self._end_of_input()
                break
            value, resume, doc = item
            self._push(0, value, doc)
            self._cursor = resume
        if len(self._pending) < self._window:
            return None
        window, self._pending = self._pending[: self._window], self._pending[self._window :]
        return window

    def snapshot(self) -> LaneState:
        """The lane's state now: only valid between windows (a quiescent point)."""
        return LaneState(
            lane=self.lane,
            cursor=FeedCursor(
                self._cursor.mix_position,
                [list(s) for s in self._cursor.sources],
                self._cursor.skip,
            ),
            stages={label: st.to_plain() for label, st in self._stages.items()},
            pending=list(self._pending),  # outputs are never changed after they are made
            ended=self._ended,
        )

    def prime(self) -> None:
        self._feed.prime()

    def close(self) -> None:
        self._feed.close()
