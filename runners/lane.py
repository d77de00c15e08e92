"""One lane: its feed (per-source read-ahead, the mix drawn at consumption) and its ordered back."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from zephon_flow.core.batches import SampleLayout
from zephon_flow.core.checkpoint.state import FeedCursor, LaneState, SourceCursor
from zephon_flow.core.checkpoint.window_check import FedOutputs, MadeWindow, difference
from zephon_flow.core.errors import CorruptStateError, ResumeMismatchError
from zephon_flow.core.markers import DocId
from zephon_flow.core.roles import MixPolicy
from zephon_flow.runners.backends.base import Backend
from zephon_flow.runners.dofns import DoFnLaneState, StatefulInvoker, dofn_errors, dofn_seed
from zephon_flow.runners.plan import Plan
from zephon_flow.runners.segment import Skipped
from zephon_flow.runners.streams import START_CHUNKS, SourceStream

#: Called once per record dropped by ``on_error="skip"``: (source index, the error's message).
SkipHook = Callable[[int, str], None]
#: Records a lane drops in a row (``on_error="skip"``, nothing delivered between them) before
#: it warns that every record may be bad, and again at each doubling: on an endless stream whose
#: records all fail, the lane would otherwise read pass after pass without a word.
DRY_WARN = 1024

_log = logging.getLogger("zephon_flow")


class FedRecord(NamedTuple):
    """One consumed record with outputs: ``outputs[start:]`` are still to be pushed. (A named
    tuple: one is made per record, three times faster than a frozen dataclass.)"""

    outputs: list[Any]
    start: int
    source: int
    before: FeedCursor | None  # the cursor at this record (to resume inside it); None: one output
    after: FeedCursor  # the cursor past it
    doc: DocId


class LaneFeed:
    """A lane's records in mix order. Each source is read ahead on its own stream; the source
    of the record at mix position ``i`` is drawn only when the lane's back asks for it, with
    the weights at the lane's step *then*, so a schedule over steps is deterministic."""

    def __init__(
        self,
        plan: Plan,
        backend: Backend,
        *,
        lane: int,
        lanes: int,
        seed: int,
        cursor: FeedCursor,
        mixture: MixPolicy | None,
        chunk_records: int,
        depth: int,
        on_skip: SkipHook,
    ) -> None:
        self._lane, self._mixture, self._on_skip = lane, mixture, on_skip
        self._mix_seed = dofn_seed(seed, plan.mix_label or "")
        # The lane's read-ahead budget of ``depth`` chunks is shared by its sources, so a mix
        # holds about as much in flight as a single source does.
        per_source = max(1, -(-depth // len(plan.sources)))
        self._streams = [
            SourceStream(
                i,
                sp,
                backend,
                lane=lane,
                lanes=lanes,
                seed=seed,
                cursor=pos,
                chunk_records=chunk_records,
                depth=per_source,
            )
            for i, (sp, pos) in enumerate(zip(plan.sources, cursor.sources, strict=True))
        ]
        self._cursor = cursor.copy()
        self._cursor.skip, self._cursor.source = 0, -1
        # A record partly consumed at the checkpoint comes from the source it came from then.
        self._resume = (cursor.source, cursor.skip) if cursor.skip > 0 else None
        self._dry = 0  # records dropped in a row since the last one with outputs

    @property
    def cursor(self) -> FeedCursor:
        """The cursor past every record consumed so far."""
        return self._cursor.copy()

    def _choose(self, step: int) -> int | None:
        if self._mixture is None:
            return 0
        cursor = self._cursor
        return self._mixture.choose(
            self._mix_seed, self._lane, cursor.mix_position, step=step, exhausted=cursor.exhausted
        )

    def next_record(self, step: int) -> FedRecord | None:
        """The next record with outputs left, drawn at lane step ``step``; None when the lane's
        input ends. Records without outputs and skipped records are consumed on the way."""
        while True:
            start = 0
            if self._resume is not None:
                (index, start), self._resume = self._resume, None
            else:
                chosen = self._choose(step)
                if chosen is None:
                    return None
                index = chosen
            taken = self._streams[index].take()
            if taken is None:
                if self._mixture is None or self._mixture.exhausted != "renormalize":
                    return None
                self._cursor.exhausted = sorted({*self._cursor.exhausted, index})
                continue
            at = self._cursor.sources[index]
            self._cursor.mix_position += 1
            self._cursor.sources[index] = taken.after
            if isinstance(taken.result, Skipped):
                self._cursor.skipped[index] += 1
                self._on_skip(index, taken.result.message)
                self._dried(index, taken.result.message)
                continue
            self._dry = 0
            if len(taken.result) > start:
                after = self._cursor.copy()
                before = None
                if len(taken.result) - start > 1:  # the lane may stop inside this record
                    before = after.copy()
                    before.mix_position -= 1
                    before.sources[index] = at
                return FedRecord(taken.result, start, index, before, after, taken.doc)

    def _dried(self, index: int, message: str) -> None:
        """Counts a dropped record; warns at ``DRY_WARN`` of them in a row, and at each doubling."""
        self._dry += 1
        if self._dry >= DRY_WARN and self._dry & (self._dry - 1) == 0:
            _log.warning(
                "lane %d has dropped its last %d records (on_error='skip') without delivering one: "
                "is every record bad? (source %d, pass %d; the last: %s)",
                self._lane,
                self._dry,
                index,
                self._cursor.sources[index].epoch,
                message,
            )

    def prime(self, chunks: int = START_CHUNKS) -> None:
        """Submits each source's first ``chunks`` chunks now, so lanes start their stateless
        work together."""
        for stream in self._streams:
            stream.prime(chunks)

    def close(self) -> None:
        for stream in self._streams:
            stream.close()


def _no_skip_hook(index: int, message: str) -> None:
    pass


def _start_state(plan: Plan, lane: int, state: LaneState | None) -> LaneState:
    """Lane ``lane``'s state to start from: ``state``, checked against ``plan`` (a
    ``CorruptStateError`` names what does not match), or a fresh one."""
    n = len(plan.sources)
    if state is None:
        state = LaneState(lane, FeedCursor(0, [SourceCursor.first() for _ in plan.sources], skipped=[0] * n))
        state.stages = {s.label: DoFnLaneState().snapshot() for s in plan.stateful}
    missing = [s.label for s in plan.stateful if s.label not in state.stages]
    cursor = state.cursor
    if missing or len(cursor.sources) != n or len(cursor.skipped) != n:
        raise CorruptStateError(
            f"state of lane {lane} does not match the pipeline: missing stateful stage(s) "
            f"{missing} or wrong number of source cursors ({len(cursor.sources)}) or skip counts "
            f"({len(cursor.skipped)}) for {n} source(s)"
        )
    if any(not 0 <= i < n for i in [*cursor.exhausted, *([cursor.source] if cursor.skip else [])]):
        raise CorruptStateError(f"state of lane {lane} names a source that the pipeline does not have")
    return state


class LaneRunner:
    """Runs one lane to window boundaries; its snapshot is the lane's entire checkpoint.

    ``step`` is the number of windows the lane has closed (the checkpoint's step); the mix
    draws each record at the step of the window the lane is filling when it consumes it.
    A state that records its next window's check (``LaneState.next_window``) is verified: the
    lane's first window is compared with it as it is made (``ResumeMismatchError`` if it
    differs). ``made`` is the last window made, whose check completes the state taken before it.
    ``window`` is the length of every window, or, under a batch size schedule, a function of
    the step giving the length of the lane's window of that step.
    """

    def __init__(
        self,
        plan: Plan,
        backend: Backend,
        *,
        lane: int,
        lanes: int,
        seed: int,
        window: int | Callable[[int], int],
        state: LaneState | None,
        chunk_records: int,
        depth: int,
        step: int = 0,
        mixture: MixPolicy | None = None,
        on_skip: SkipHook = _no_skip_hook,
    ) -> None:
        self._plan = plan
        self._fixed = window if isinstance(window, int) else None
        self._window_at: Callable[[int], int] = (lambda step: window) if isinstance(window, int) else window
        self.lane = lane
        state = _start_state(plan, lane, state)
        cursor = state.cursor
        if plan.mixer is not None and mixture is None:
            mixture = plan.mixer.mixture()
        self._cursor = cursor.copy()
        self._stages = {s.label: DoFnLaneState.restore(state.stages[s.label]) for s in plan.stateful}
        self._pending = list(state.pending)
        self._ended = state.ended
        self._layout = state.layout
        self._windows = step
        self._lanes = lanes
        self._expect = state.next_window
        self._fed: list[FedOutputs] = []  # the records read for the window being made
        self.made: MadeWindow | None = None
        self._record: FedRecord | None = None
        self._next = 0
        self._feed = LaneFeed(
            plan,
            backend,
            lane=lane,
            lanes=lanes,
            seed=seed,
            cursor=cursor,
            mixture=mixture,
            chunk_records=chunk_records,
            depth=depth,
            on_skip=on_skip,
        )

    def _push(self, index: int, value: Any, doc: DocId | None) -> None:
        back = self._plan.back
        if index == len(back):
            self._pending.append(value)
            return
        stage = back[index]
        try:
            if isinstance(stage, StatefulInvoker):
                outputs = stage.process(self.lane, value, self._stages[stage.label], doc)
            else:
                outputs = stage(value)
        except Exception as exc:  # the place is written out only for an error: it costs a dict repr
            with dofn_errors(stage.label, f"lane {self.lane}, after source cursor {self._cursor.to_plain()}"):
                raise exc
        for out in outputs:
            self._push(index + 1, out, doc)

    def _end_of_input(self) -> None:
        self._cursor = self._feed.cursor
        back = self._plan.back
        for i, stage in enumerate(back):
            if isinstance(stage, StatefulInvoker):
                with dofn_errors(stage.label, f"lane {self.lane}, in a timer at the end of its input"):
                    outputs = stage.fire_timers(self.lane, self._stages[stage.label], None)
                for out in outputs:
                    self._push(i + 1, out, None)
        self._ended = True

    def _next_output(self) -> tuple[Any, FeedCursor, DocId] | None:
        """The next output of the lane's input, with the cursor to resume after it."""
        record = self._record
        while record is None or self._next >= len(record.outputs):
            record = self._feed.next_record(self._filling())
            if record is None:
                return None
            self._record, self._next = record, record.start
            if not record.start:  # a record resumed inside belongs to the window before
                self._fed.append((record.doc, record.outputs))
        j = self._next
        self._next += 1
        if j + 1 < len(record.outputs):
            assert record.before is not None
            resume = record.before.copy()
            resume.skip, resume.source = j + 1, record.source
        else:
            resume = record.after
        return record.outputs[j], resume, record.doc

    def _filling(self) -> int:
        """The step of the window being filled: windows closed plus those the pending
        outputs complete."""
        if self._fixed is not None:
            return self._windows + len(self._pending) // self._fixed
        step, left = self._windows, len(self._pending)
        while left >= (size := self._window_at(step)):
            step, left = step + 1, left - size
        return step

    def next_window(self) -> list[Any]:
        """The lane's next window: ``window`` outputs, or fewer once its finite input has
        ended (the rest of the window is padding; an empty list once nothing is left)."""
        self._fed = []
        size = self._window_at(self._windows)
        while len(self._pending) < size and not self._ended:
            item = self._next_output()
            if item is None:
                self._end_of_input()
                break
            value, resume, doc = item
            self._push(0, value, doc)
            self._cursor = resume
        window, self._pending = self._pending[:size], self._pending[size:]
        if window and self._layout is None:
            self._layout = SampleLayout.of(window[0])
        self.made = MadeWindow(window, self._fed)
        if self._expect is not None:
            self._verify()
        self._windows += 1
        return window

    def _verify(self) -> None:
        """Compares the first window made after a restore with the check its state recorded."""
        expect, self._expect = self._expect, None
        assert expect is not None and self.made is not None
        fed = self.made.fed
        changed = difference(expect, self.made.check(), fed, self._name)
        if changed is not None:
            raise ResumeMismatchError(
                f"lane {self.lane}, step {self._windows}: the first window after the restore is not "
                f"the one the checkpoint recorded: {changed}. Resuming would train on another stream "
                f"than the one saved; put the data and the tokenizer back as they were, or accept the "
                f"new stream knowingly with verify_resume=False (zf.Loader) or --no-verify-resume "
                f"(zephon serve)"
            )

    def _name(self, doc: tuple[int, int, int]) -> str:
        """A record id as its source, file and offset."""
        source, split, offset = doc
        try:
            sp = self._plan.sources[source]
            path = sp.source.splits(self._lanes)[split].path
        except (IndexError, AttributeError, TypeError):
            return f"the record {doc}"
        return f"the record at {path} offset {offset} (source {sp.label!r})"

    @property
    def layout(self) -> SampleLayout | None:
        """The layout of the lane's first sample (None before it made one)."""
        return self._layout

    def snapshot(self) -> LaneState:
        """The lane's state now: only valid between windows (a quiescent point)."""
        return LaneState(
            lane=self.lane,
            cursor=self._cursor.copy(),
            stages={label: st.snapshot() for label, st in self._stages.items()},
            pending=list(self._pending),  # outputs are never changed after they are made
            ended=self._ended,
            layout=self._layout,
        )

    def prime(self, chunks: int = START_CHUNKS) -> None:
        self._feed.prime(chunks)

    def close(self) -> None:
        self._feed.close()


def prime_lanes(runners: Sequence[LaneRunner]) -> None:
    """Starts the lanes' stateless work breadth first: every lane's first chunk of each source
    before any lane's second, every lane's second before any lane's third, and so on up to the
    start budget, so the first step (which needs every lane, often more than one chunk of each:
    a chunk of video is about one clip) is not queued behind any lane's read-ahead. The order
    chunks are submitted in changes no byte."""
    for chunks in range(1, START_CHUNKS + 1):
        for runner in runners:
            runner.prime(chunks)
