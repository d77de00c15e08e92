"""The embedded ``Loader``: one rank's slice of every global batch, with resumable state."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Protocol

from zephon_flow.core.assemble import assemble_rows
from zephon_flow.core.batches import Batch
from zephon_flow.core.checkpoint.state import LaneState, LoaderState
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.checkpoint.window_check import PendingChecks
from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import (
    SpecError,
    StateError,
    ZephonError,
)
from zephon_flow.core.lanes import RankRows, RankSlice
from zephon_flow.core.roles import MixPolicy
from zephon_flow.engine import recipe
from zephon_flow.engine.balance import RankBalance, RowCost
from zephon_flow.engine.endsync import EndSync, bind_end_sync, default_end_sync
from zephon_flow.engine.options import ResumeOptions, StateOptions, TopologyOptions, WorkOptions
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.engine.steps import LaneSteps, MadeStep, produce
from zephon_flow.operators.mix import Mix, Mixture
from zephon_flow.runners.backends import DEFAULT_CHUNK_TIMEOUT
from zephon_flow.runners.backends.base import Backend
from zephon_flow.runners.backends.processes import can_fork, start_worker_server
from zephon_flow.runners.lane import LaneRunner, SkipHook
from zephon_flow.runners.plan import Plan
from zephon_flow.runners.streams import CHUNK_RECORDS

_END = object()
_log = logging.getLogger("zephon_flow")


class Loader:
    """Iterates ``(step, batch)`` for rank ``rank`` of ``world_size``; ``batch`` maps field
    names to numpy arrays holding this rank's rows ``[rank*B/W, (rank+1)*B/W)`` of global batch
    ``step``.

    Only the lanes under this rank's rows are run. Stateless work goes to ``backend``
    (``"inline"``, ``"threads"``, ``"processes"`` or ``"ray"`` with ``workers``; ``ray_address``
    joins a Ray cluster, ``None`` a local Ray started for the loader); ``prefetch`` batches are
    produced ahead on a background thread. Each lane keeps up to ``prefetch_chunks`` chunks in flight on
    the backend, each of at most ``chunk_records`` records and about 128 KB of input (fewer and
    smaller at a start: the read-ahead grows with each chunk taken, so the first batch waits
    for small chunks only).
    ``state`` (from ``state_dict``, ``merge_states`` or checkpoint bytes) resumes the global
    sequence under any topology.

    ``allow_mix_change=True`` accepts a ``state`` written for a pipeline that differs only in
    its ``Mix``'s weights, schedule or interpolation: the new mixture applies from the state's
    step on, and the states this loader writes record it (``mix_history``), so a resume from
    any later one replays the change. Records dropped by a source's ``on_error="skip"`` are
    logged (a warning per source, with the first message) and counted: ``skipped()``.

    ``allow_batch_change=True`` accepts a ``state`` written for a pipeline that differs only
    in its ``global_batch_size`` (another schedule, or another int): the new sizes apply from
    the state's step on (the lanes' outputs so far are kept; window ``step`` and later are
    cut by the new sizes), and the states this loader writes carry the new fingerprint, so a
    resume from them needs the new spec. Without it such a state is refused naming
    ``global_batch_size`` (docs/batch-schedule.md).

    ``allow_code_change=True`` accepts a ``state`` written before the code of a user function
    or DoFn changed (the fingerprint's ``code <label>`` parts): for a deliberate fix or
    refactor; without it such a state is refused with ``operator <label>: code changed``.

    ``end_sync`` is how the ranks of a finite pipeline agree on its last step (see
    ``zephon_flow.engine.endsync``); by default ``torch.distributed`` when it is initialised.

    ``chunk_timeout`` (seconds) bounds one chunk's stateless work: past it the processes backend
    kills the stuck worker, replaces it and raises ``ChunkTimeoutError`` naming the DoFn and the
    record (threads: the error, but the thread stays stuck; inline: a logged warning only). A
    worker that dies is replaced and its chunks recomputed, with the same batches. ``clock`` is
    what ``chunk_timeout`` is measured on (tests pass a ``ManualClock`` and advance it).

    ``verify_resume`` (default True): a ``state`` that records its lanes' next windows (every
    state this version writes) is verified as the lanes make their first windows, before any
    batch is yielded; a lane whose window differs raises ``ResumeMismatchError`` naming the
    lane, the step and the record that changed. ``False`` accepts a changed stream knowingly.

    ``keep_states`` is how many states the loader keeps, the one after each of the last
    batches yielded (references to snapshots it takes anyway, not copies):
    ``state(step)`` gives the one from which ``step`` is the next batch, for a trainer that
    reads ahead of the batch it trains on.

    ``balance`` (default None: the contiguous rows above) gives this rank, instead, the rows
    of each global batch that even out a per-row cost across the ranks (``"tokens"``,
    ``"attention"``, ``"images"`` or a function of a row: ``zf.RankBalance``), chosen by
    ``zf.balance_rows`` from the whole batch and ``world_size``; the batch gains ``rows``
    (int64), the global indices of its rows, ascending. The global batch, its digest and the
    states are the same as without it, but a rank needs every row's cost, so **every rank
    runs every lane** (the work of ``world_size=1`` per rank; ``zephon serve --balance``
    chooses the rows on the server instead). Every rank of a run must use the same
    ``balance``.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        *,
        rank: int = 0,
        world_size: int = 1,
        backend: str = "inline",
        workers: int = 1,
        state: LoaderState | bytes | Mapping[str, Any] | None = None,
        prefetch: int = 2,
        chunk_records: int = CHUNK_RECORDS,
        prefetch_chunks: int = 8,
        allow_mix_change: bool = False,
        allow_code_change: bool = False,
        allow_batch_change: bool = False,
        end_sync: EndSync | None = None,
        chunk_timeout: float = DEFAULT_CHUNK_TIMEOUT,
        ray_address: str | None = None,
        state_mode: str = "compact",
        verify_resume: bool = True,
        keep_states: int = 8,
        balance: str | RowCost | RankBalance | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        # Phases: check the options, start the backend and restore the state, build the
        # lanes, take the first state, get the producer ready.
        if not isinstance(spec, LoaderSpec):
            raise SpecError(f"spec must be a zf.LoaderSpec, got {type(spec).__name__}")
        topology = TopologyOptions(rank=rank, world_size=world_size)
        work = WorkOptions(
            backend=backend,
            workers=workers,
            prefetch=prefetch,
            chunk_records=chunk_records,
            prefetch_chunks=prefetch_chunks,
            chunk_timeout=chunk_timeout,
            ray_address=ray_address,
        )
        resume = ResumeOptions(
            verify_resume=verify_resume,
            allow_mix_change=allow_mix_change,
            allow_code_change=allow_code_change,
            allow_batch_change=allow_batch_change,
        )
        states = StateOptions(state_mode=state_mode, keep_states=keep_states)
        if work.backend == "processes" and not can_fork():  # its server boots while the pipeline compiles
            start_worker_server()
        self._balance = RankBalance.of(balance)
        plan = self._compile(spec, topology, states)
        start = self._start_backend(plan, work, state, resume, clock)
        self._build_lanes(plan, start, chunk_records=work.chunk_records, depth=work.prefetch_chunks)
        self._take_first_state(plan, start, end_sync, keep_states=states.keep_states)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=work.prefetch)
        self._stop = threading.Event()
        self._requested = 0  # batches the consumer has asked for (see _wait_for_request)
        self._requested_cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._fed = False  # ``feed`` makes the batches; the loader is not iterated
        self._closed = False

    def _compile(self, spec: LoaderSpec, topology: TopologyOptions, states: StateOptions) -> Plan:
        """This rank's rows and the loader's own plan (its copies of DoFns with a lifecycle,
        torn down at close); a recipe state's writer is refused now, by name, rather than at
        the first ``state_dict()``."""
        self.spec = spec
        # This rank's rows of each step (one size, or the step's size of a schedule).
        self._slice = RankRows(
            rank=topology.rank, world_size=topology.world_size, lanes=spec.lanes, schedule=spec.batch_schedule
        )
        self._fingerprint = spec.fingerprint
        self._plan = plan = spec.compile().for_executor()
        self._recipes = recipe.RecipeWriter(plan) if states.state_mode == "recipe" else None
        return plan

    def _start_backend(
        self,
        plan: Plan,
        work: WorkOptions,
        state: LoaderState | bytes | Mapping[str, Any] | None,
        resume: ResumeOptions,
        clock: Clock,
    ) -> LaneStart:
        """Starts the backend (first: a recipe state's restore runs the front on it) and
        restores where this rank's lanes start, and their mixture; the backend is closed if
        that fails."""
        self._backend = work.make_backend(plan.front_segment(), clock)
        try:
            start = self._restore(plan, state, **resume.kwargs())
            self._slice.check_from(start.step)  # the world size divides every size from there
        except BaseException:
            self._backend.close()
            raise
        self._mix_history = [] if start.mixture is None else start.mixture.history()
        self._mixture = start.mixture  # changed in place from a step on: change_mixture
        self._mix_lock = threading.Lock()
        self._begun = start.step  # the first step the lanes have not begun to make
        return start

    def _take_first_state(
        self, plan: Plan, start: LaneStart, end_sync: EndSync | None, *, keep_states: int
    ) -> None:
        """How the ranks agree on the end of a finite pass, and the state before the first
        batch (its next-window checks those of a restored state), the first of those kept."""
        self._finite = plan.finite
        self._padding = plan.padding_sample() if plan.finite else None
        self._end_sync = bind_end_sync(  # this rank's side: its votes, and its leaving
            end_sync
            or default_end_sync(
                self._slice.world_size,
                finite=plan.finite,
                all_lanes_local=len(self._lanes) == self.spec.lanes,
            ),
            self._slice.rank,
        )
        self._step = start.step
        self._steps = LaneSteps(
            self._lanes, first_step=start.step, per_lane_at=self.spec.per_lane_at, finite=plan.finite
        )
        self._last = self._state(start.step, {ln.lane: ln.snapshot() for ln in self._lanes})
        known = {lane: ls.next_window for lane, ls in start.lanes.items() if ls is not None}
        if self._last.checks is not None and known and all(known.values()):
            self._last.checks.fill(known)  # a restored state's checks, verified as the lanes run
        # The states after the last batches yielded, oldest first (``state(step)``).
        self._kept: deque[LoaderState] = deque([self._last], maxlen=keep_states)

    def _restore(
        self,
        plan: Plan,
        state: LoaderState | bytes | Mapping[str, Any] | None,
        *,
        allow_mix_change: bool,
        allow_code_change: bool,
        allow_batch_change: bool,
        verify_resume: bool,
    ) -> LaneStart:
        """Where this rank's lanes start: fresh, or from ``state`` (checked against the spec)."""
        return restore_lanes(
            self.spec,
            plan,
            state,
            list(range(self.spec.lanes)) if self._balance is not None else list(self._slice.lane_ids),
            who=f"rank {self._slice.rank} of {self._slice.world_size}",
            allow_mix_change=allow_mix_change,
            allow_code_change=allow_code_change,
            allow_batch_change=allow_batch_change,
            submit=self._backend.submit,
            verify=verify_resume,
        )

    def _build_lanes(
        self,
        plan: Plan,
        start: LaneStart,
        *,
        chunk_records: int,
        depth: int,
    ) -> None:
        """One ``LaneRunner`` per lane under this rank's rows, on the stateless backend."""
        self._skip_lock = threading.Lock()
        self._skip_warned: set[str] = set()
        self._source_labels = [sp.label for sp in plan.sources]
        self._lanes = build_lane_runners(
            self.spec,
            plan,
            self._backend,
            start,
            chunk_records=chunk_records,
            depth=depth,
            on_skip=self._on_skip,
        )

    @property
    def rank_slice(self) -> RankSlice:
        """This rank's rows of the next global batch (of every batch, for a fixed size)."""
        return self._slice.at(self._last.step)

    def _state(self, step: int, lanes: dict[int, LaneState]) -> LoaderState:
        """The state at ``step``; its lanes' next windows complete it (``checks``) once made."""
        return LoaderState(
            step,
            self.spec.lanes,
            self._fingerprint,
            lanes,
            list(self._mix_history),
            checks=PendingChecks(alive=_producing(self)),
            codecs=self._plan.derived_codecs,
        )

    def _on_skip(self, source: int, message: str) -> None:
        label = self._source_labels[source]
        with self._skip_lock:
            if label in self._skip_warned:
                return
            self._skip_warned.add(label)
        _log.warning(
            "source %r has on_error='skip': dropping bad records (counted in the state, see "
            "Loader.skipped()); the first: %s",
            label,
            message,
        )

    def skipped(self) -> dict[str, int]:
        """Per source label, the records dropped by ``on_error="skip"`` in this rank's lanes,
        up to the last batch yielded (exact and the same on every topology and resume)."""
        totals = dict.fromkeys(self._source_labels, 0)
        for ls in self._last.lane_states.values():
            for label, n in zip(self._source_labels, ls.cursor.skipped, strict=True):
                totals[label] += n
        return totals

    def change_mixture(
        self,
        step: int,
        *,
        weights: Sequence[float] | None = None,
        schedule: Sequence[tuple[int, Sequence[float]]] | None = None,
        interpolation: str = "constant",
    ) -> list[tuple[int, dict[str, Any]]]:
        """Puts new mixture weights in force from global ``step`` on, while the loader runs:
        ``weights`` from then on, or a ``schedule`` of ``(step, weights)`` at absolute steps
        whose first point is ``step`` (``Mix.starting_at``). Buffers are kept; what the lanes
        made before ``step`` is unchanged. ``step`` must be one the lanes have not begun to
        make (else ``StateError`` naming it and the first step still open); the change is
        recorded in every state saved from now on (``mix_history``), so a resume from any of
        them, on any topology, makes the same batches. Give every rank's loader the same
        change. Returns the mixture history now."""
        if (weights is None) == (schedule is None):
            raise SpecError("change_mixture: give either weights=[...] or schedule=[(step, weights), ...]")
        points = [(step, weights)] if weights is not None else list(schedule or ())
        mix = checked_mix_change(self._mixture, step, points, interpolation=interpolation)
        with self._mix_lock:
            if self._closed:
                raise ZephonError("change_mixture: this Loader is closed")
            if step < self._begun:
                raise refused_mix_step(step, self._begun, "the lanes")
            self._mix_history = apply_mix_change(self._mixture, step, mix)
            return list(self._mix_history)

    def _produce(self, sink: StepSink | None = None) -> None:
        """The producer: the engine's loop (``engine/steps.py``) from this rank's lanes into
        the queue of ``prefetch`` batches, or into ``sink`` (``feed``)."""
        lanes = _Queued(self, _Queue(self) if sink is None else _Fed(self, sink))
        try:
            produce(self._steps, room=lanes.room, put=lanes.put, fail=lanes.fail)
        finally:
            lanes.stopped()

    def feed(self, sink: StepSink) -> None:
        """Makes this rank's batches in the calling thread, straight into ``sink``, instead of
        being iterated: no queue and no thread of the loader's own between its lanes and what
        holds the batches (``zephon serve`` holds them this way). Returns once the sequence
        ended (``sink.end(None)``), the loader closed or ``sink.room`` said stop; a failure is
        handed to ``sink.end(exc)``, not raised. A loader is fed or iterated, once; ``state()``,
        ``snapshot()`` and ``skipped()`` follow the batches handed to the sink."""
        if self._closed:
            raise ZephonError("this Loader is closed")
        if self._thread is not None:
            raise ZephonError("Loader.feed: this Loader is already producing (iterated or fed)")
        if getattr(self._end_sync, "lockstep", False):
            raise ZephonError(
                "Loader.feed: a lockstep end_sync waits for a trainer's requests; iterate instead"
            )
        self._thread, self._fed = threading.current_thread(), True
        self._produce(sink)

    def _goes_on(self, step: int, exists: bool) -> bool:
        """Whether global batch ``step`` exists, given whether it does from this rank's lanes
        (``step_exists``): an endless pipeline's lanes fill every window; a finite one goes on
        while any lane (of any rank: ``end_sync``) has a real sample."""
        if not self._finite or self._end_sync is None:
            return exists
        if getattr(self._end_sync, "lockstep", False) and not self._wait_for_request(step):
            return False
        return self._end_sync.any_rank(step, exists, self._stop)

    def _wait_for_request(self, step: int) -> bool:
        """Waits until the consumer has asked for ``step`` (False: the loader closed first).

        A collective agreement (``lockstep``) is entered only for steps every rank's trainer
        asks for, so ranks that stop at the same step never leave one waiting in it."""
        with self._requested_cond:
            while self._requested <= step - self._step:
                if self._stop.is_set():
                    return False
                self._requested_cond.wait(timeout=0.1)
        return True

    def _assemble(self, made: MadeStep) -> Batch:
        """This rank's rows of global batch ``made.step`` (see ``assemble_rows``); balanced,
        the whole batch (every lane is local), then this rank's rows of ``balance``."""
        step = made.step
        batch = assemble_rows(
            step,
            list(made.windows),
            made.lane_layouts(),
            rows=self._slice.at(step).rows_of_lanes() if self._balance is None else slice(None),
            per_lane=self.spec.per_lane_at(step),
            finite=self._finite,
            padding=self._padding,
        )
        if self._balance is None:
            return batch
        where = f"global batch {step}"
        rows = self._balance.assign(batch, self._slice.world_size, where=where)[self._slice.rank]
        return self._balance.select(batch, rows, where=where)

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        # Production starts here, not at the first next(): ranks simulated in one process
        # (``simulate.py``) start together and agree on the end of a finite pass step by step.
        if self._closed:
            raise ZephonError("this Loader is closed")
        if self._fed:
            raise ZephonError("this Loader is fed (Loader.feed): its batches go to its sink")
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="zephon-lanes", daemon=True)
            self._thread.start()
        return self._batches()

    def _batches(self) -> Iterator[tuple[int, Batch]]:
        while True:
            with self._requested_cond:
                self._requested += 1
                self._requested_cond.notify_all()
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._closed:  # closed from another thread while this one waited
                    return
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            step, batch, after = item
            self._last = after
            self._kept.append(after)
            yield step, batch

    def state(self, step: int | None = None) -> LoaderState:
        """This rank's lanes, positioned so that ``step`` is the next batch (default: after the
        last batch yielded); ``save_state`` takes it. Buffered sequences as recipes with
        ``state_mode="recipe"``. A step outside the kept ones (``keep_states``) is refused."""
        return self.saved_form(self.snapshot(step))

    def snapshot(self, step: int | None = None) -> LoaderState:
        """``state(step)`` as the loader holds it (never recipes): a reference, no copy. It
        is never changed afterwards; ``saved_form`` turns it into what ``state`` gives."""
        if step is None:
            return self._last
        kept = self._kept  # the producer never touches it: only this consumer's thread appends
        first, last = kept[0].step, kept[-1].step
        if not first <= step <= last:
            raise StateError(
                f"Loader.state(step={step}): the loader keeps the states from which steps "
                f"{first}..{last} are next (keep_states={kept.maxlen}); save more often or "
                f"raise keep_states"
            )
        return kept[step - first]

    def saved_form(self, state: LoaderState) -> LoaderState:
        """``state`` (a ``snapshot``) as this loader saves it: recipes with ``state_mode="recipe"``,
        and the mixture history as it is now (a change made after the state was taken applies
        from a step at or after it: ``change_mixture``)."""
        state = self._completed(state)
        if state.mix_history != self._mix_history:
            state = replace(state, mix_history=list(self._mix_history))
        return state if self._recipes is None else self._recipes(state)

    def _completed(self, state: LoaderState) -> LoaderState:
        """``state`` with its lanes' next-window checks (``LoaderState.completed``): waits only
        while the producer is still making those windows, at most one window's time."""
        return state.completed(_producing(self))

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """Plain data: ``state(step)``, this rank's lanes positioned so that ``step`` is the
        next batch (default: after the last batch yielded)."""
        return self.state(step).to_plain()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._end_sync is not None:  # peers waiting on a step this rank never votes on raise
            self._end_sync.leave(None)
        for lane in self._lanes:
            lane.close()
        self._backend.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)  # a lane stuck in an inline call must not hold close()
        self._plan.teardown()  # the DoFns this process ran (inline, threads, the lanes' back)

    def __enter__(self) -> Loader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class StepSink(Protocol):
    """What ``Loader.feed`` hands its batches to, instead of its own queue."""

    def room(self, step: int) -> bool:
        """Waits until global batch ``step`` may be made; False: stop producing."""
        ...

    def add(self, step: int, batch: Batch, after: LoaderState) -> None:
        """Takes batch ``step`` and the state from which ``step + 1`` is next."""
        ...

    def end(self, error: BaseException | None) -> None:
        """The sequence ended (None) or failed (``error``); nothing more comes."""
        ...


class _Queued:
    """The embedded Loader's sink for the engine's producer loop: each step it makes, if the
    step exists (``Loader._goes_on``), assembled into this rank's rows and handed on with the
    state after it (to the loader's queue, or to a fed ``StepSink``); the state before it
    completed with the checks of the windows made."""

    def __init__(self, loader: Loader, sink: StepSink) -> None:
        self._loader, self._sink = loader, sink
        self._before = loader._last.checks  # the state the next windows complete

    def room(self, step: int) -> bool:
        loader = self._loader
        if loader._stop.is_set() or not self._sink.room(step):
            return False
        with loader._mix_lock:  # from here on a mixture change at ``step`` is refused
            loader._begun = step + 1
        return True

    def put(self, made: MadeStep) -> bool:
        loader = self._loader
        if self._before is not None:
            self._before.fill(made.made)
        if not loader._goes_on(made.step, made.exists):
            self._sink.end(None)
            return False
        batch = loader._assemble(made)
        after = loader._state(made.step + 1, made.snapshots)
        self._before = after.checks
        self._sink.add(made.step, batch, after)
        return True

    def fail(self, exc: BaseException) -> None:
        """Delivered to the consumer, re-raised there."""
        loader = self._loader
        self.stopped()
        if loader._end_sync is not None:  # peers waiting on this rank raise at once, naming it
            loader._end_sync.leave(exc)
        self._sink.end(exc)

    def stopped(self) -> None:
        """A state() waiting for windows that will not be made returns."""
        if self._before is not None:
            self._before.give_up()


class _Queue:
    """An iterated loader's sink: its queue of ``prefetch`` batches, read by ``_batches``
    (which keeps the states), the end and a failure queued after them."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def room(self, step: int) -> bool:
        return True  # the queue's bound waits in ``_put``

    def add(self, step: int, batch: Batch, after: LoaderState) -> None:
        self._loader._put((step, batch, after))

    def end(self, error: BaseException | None) -> None:
        self._loader._put(_END if error is None else error)


class _Fed:
    """A fed loader's sink: the caller's, with the loader's own states kept first (the
    feeding thread is the loader's consumer)."""

    def __init__(self, loader: Loader, sink: StepSink) -> None:
        self._loader, self._sink = loader, sink

    def room(self, step: int) -> bool:
        return self._sink.room(step)

    def add(self, step: int, batch: Batch, after: LoaderState) -> None:
        self._loader._last = after
        self._loader._kept.append(after)
        self._sink.add(step, batch, after)

    def end(self, error: BaseException | None) -> None:
        self._sink.end(error)


@dataclass(frozen=True)
class LaneStart:
    """Where a loader's lanes start: the step, each lane's state (None: fresh), the mixture."""

    step: int
    lanes: dict[int, LaneState | None]
    mixture: MixPolicy | None


def restore_lanes(
    spec: LoaderSpec,
    plan: Plan,
    state: LoaderState | bytes | Mapping[str, Any] | None,
    lane_ids: list[int],
    *,
    who: str,
    allow_mix_change: bool = False,
    allow_code_change: bool = False,
    allow_batch_change: bool = False,
    submit: recipe.Submit | None = None,
    rebuild_recipes: bool = True,
    verify: bool = True,
    quiet: bool = False,
) -> LaneStart:
    """Where lanes ``lane_ids`` start: fresh, or from ``state`` (checked against the spec);
    ``who`` names what runs them in the error for a lane the state lacks. A recipe state's
    lanes are rebuilt (their records re-read, the front re-run on ``submit``, a backend's, if
    given) unless ``rebuild_recipes`` is False (the caller only plans from the state).
    With ``verify`` (the default) the lanes keep the checks of their next windows, which
    their runners verify; a state without them is logged once as not verifiable (unless
    ``quiet``: the caller reports it)."""
    mixture = None if plan.mixer is None else plan.mixer.mixture()
    if state is None:
        return LaneStart(0, dict.fromkeys(lane_ids), mixture)
    loaded = to_loader_state(state)
    changed = loaded.check_compatible(
        lanes=spec.lanes,
        fingerprint=spec.fingerprint,
        mix_part=None if plan.mix_label is None else f"operator {plan.mix_label}",
        allow_mix_change=allow_mix_change,
        allow_code_change=allow_code_change,
        allow_batch_change=allow_batch_change,
    )
    if plan.mixer is not None:
        mixture = Mixture.resume(plan.mixer, loaded.mix_history, loaded.step, changed=changed)
    missing = [lane for lane in lane_ids if lane not in loaded.lane_states]
    if missing:
        raise StateError(
            f"the state has no entry for lane(s) {missing}, which {who} runs; gather every "
            f"rank's state_dict() and pass zf.merge_states(states)"
        )
    if rebuild_recipes:
        loaded = recipe.from_recipes(plan, loaded, spec.lanes, lane_ids, submit)
    if verify and loaded.fingerprint != spec.fingerprint:
        # A change accepted with allow_mix_change / allow_code_change / allow_batch_change
        # changes the stream on
        # purpose: the windows recorded before it are not the ones to expect.
        if not quiet:
            _log.info(
                "the pipeline changed since the checkpoint at step %d (accepted with "
                "allow_mix_change, allow_code_change or allow_batch_change): its next windows "
                "are not verified",
                loaded.step,
            )
        verify = False
    loaded = resume_checks(loaded, lane_ids, verify=verify, quiet=quiet)
    return LaneStart(loaded.step, {lane: loaded.lane_states[lane] for lane in lane_ids}, mixture)


def checked_mix_change(
    mixture: MixPolicy | None,
    step: int,
    points: Sequence[tuple[int, Sequence[float]]],
    *,
    interpolation: str = "constant",
) -> Mix:
    """The ``Mix`` an operator puts in force from ``step`` on (``points`` as in
    ``Mix.starting_at``), checked against ``mixture``: a ``SpecError`` names what is wrong
    (no Mix in the pipeline, a bad step or weights, another number of inputs). Put it in
    force with ``apply_mix_change`` once no lane has begun ``step``."""
    if not isinstance(mixture, Mixture):
        raise SpecError("change_mixture: the pipeline has no Mix, so there is no mixture to change")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise SpecError(f"change_mixture: step must be an integer >= 0, got {step!r}")
    mix = Mix.starting_at(step, points, interpolation=interpolation, exhausted=mixture.exhausted)
    mixture.check_change(mix)
    return mix


def apply_mix_change(mixture: MixPolicy | None, step: int, mix: Mix) -> list[tuple[int, dict[str, Any]]]:
    """Puts ``mix`` (from ``checked_mix_change``) in force in ``mixture`` from ``step`` on;
    returns the mixture history now. The caller makes sure no lane has begun ``step``."""
    if not isinstance(mixture, Mixture):
        raise SpecError("change_mixture: the pipeline has no Mix, so there is no mixture to change")
    mixture.change(step, mix)
    return mixture.history()


def refused_mix_step(step: int, begun: int, who: str) -> StateError:
    """The refusal of a mixture change at a ``step`` that ``who`` (e.g. "the lanes") began."""
    return StateError(
        f"a mixture change at step {step} is refused: step {step} is already produced "
        f"({who} have begun every step before {begun}); give step {begun} or later"
    )


def _producing(loader: Loader) -> Callable[[], bool]:
    """Whether ``loader``'s producer may still make windows (held weakly: a state kept by a
    trainer does not keep its loader alive)."""
    ref = weakref.ref(loader)

    def alive() -> bool:
        ld = ref()
        thread = None if ld is None else ld._thread
        return ld is not None and thread is not None and thread.is_alive() and not ld._closed

    return alive


_said_unverified: set[tuple[int, str]] = set()


def resume_checks(
    state: LoaderState, lane_ids: list[int], *, verify: bool, quiet: bool = False
) -> LoaderState:
    """``state`` with its lanes' next-window checks kept (``verify``) or dropped. A state
    without them for some of ``lane_ids`` (written before zephon-flow recorded them, or taken
    before the lanes made a window) is logged once per step and fingerprint: its resume is
    not verified."""
    if not verify:
        lanes = {lane: replace(ls, next_window=None) for lane, ls in state.lane_states.items()}
        return replace(state, lane_states=lanes)
    missing = sorted(lane for lane, ls in state.lane_states.items() if ls.next_window is None)
    key = (state.step, state.fingerprint.get("total", ""))
    if set(missing) & set(lane_ids) and not quiet and key not in _said_unverified:
        _said_unverified.add(key)
        _log.warning(
            "the checkpoint at step %d records no check of the next window of lane(s) %s (written "
            "before zephon-flow recorded them, or taken before the lanes made a window): their "
            "resume is not verified",
            state.step,
            missing if len(missing) <= 8 else f"{missing[:8]} and {len(missing) - 8} more",
        )
    return state


def build_lane_runners(
    spec: LoaderSpec,
    plan: Plan,
    backend: Backend,
    start: LaneStart,
    *,
    chunk_records: int,
    depth: int,
    on_skip: SkipHook,
) -> list[LaneRunner]:
    """One ``LaneRunner`` per lane of ``start``, in its order, sharing ``backend``."""
    return [
        LaneRunner(
            plan,
            backend,
            lane=lane,
            lanes=spec.lanes,
            seed=spec.seed,
            window=spec.per_lane_at if spec.batch_schedule.constant is None else spec.per_lane,
            state=lane_state,
            chunk_records=chunk_records,
            depth=depth,
            step=start.step,
            mixture=start.mixture,
            on_skip=on_skip,
        )
        for lane, lane_state in start.lanes.items()
    ]
