"""The embedded ``Loader``: one rank's slice of every global batch, with resumable state."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from zephon_flow.batches import Batch, stack
from zephon_flow.errors import CorruptStateError, FingerprintMismatchError, SpecError, StateError, ZephonError
from zephon_flow.lanes import RankSlice
from zephon_flow.operators.mix import Mix, Mixture
from zephon_flow.runners.backends.base import DEFAULT_CHUNK_TIMEOUT, make_backend
from zephon_flow.runners.lane import LaneRunner
from zephon_flow.spec import LoaderSpec
from zephon_flow.state import LaneState, LoaderState, to_loader_state

_END = object()
_log = logging.getLogger("zephon_flow")


class Loader:
    """Iterates ``(step, batch)`` for rank ``rank`` of ``world_size``; ``batch`` maps field
    names to numpy arrays holding this rank's rows ``[rank*B/W, (rank+1)*B/W)`` of global batch
    ``step``.

    Only the lanes under this rank's rows are run. Stateless work goes to ``backend``
    (``"inline"``, ``"threads"`` or ``"processes"`` with ``workers``); ``prefetch`` batches are
    produced ahead on a background thread. ``state`` (from ``state_dict``, ``merge_states``
    or checkpoint bytes) resumes the global sequence under any topology.

    ``allow_mix_change=True`` accepts a ``state`` written for a pipeline that differs only in
    its ``Mix``'s weights, schedule or interpolation: the new mixture applies from the state's
    step on, and the states this loader writes record it (``mix_history``), so a resume from
    any later one replays the change. Records dropped by a source's ``on_error="skip"`` are
    logged (a warning per source, with the first message) and counted: ``skipped()``.

    ``chunk_timeout`` (seconds) bounds one chunk's stateless work: past it the processes backend
    kills the stuck worker, replaces it and raises ``ChunkTimeoutError`` naming the DoFn and the
    record (threads: the error, but the thread stays stuck; inline: a logged warning only). A
    worker that dies is replaced and its chunks recomputed, with the same batches.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        *,
        rank: int = 0,
        world_size: int = 1,
        backend: str = "inline",
        workers: int = 1,
        state: Any = None,
        prefetch: int = 2,
        chunk_records: int = 16,
        prefetch_chunks: int = 4,
        allow_mix_change: bool = False,
        chunk_timeout: float = DEFAULT_CHUNK_TIMEOUT,
    ) -> None:
        if not isinstance(spec, LoaderSpec):
            raise SpecError(f"spec must be a zf.LoaderSpec, got {type(spec).__name__}")
        self._slice = RankSlice(
            rank=rank,
            world_size=world_size,
            lanes=spec.lanes,
            global_batch_size=spec.global_batch_size,
        )
        for name, value in (
            ("prefetch", prefetch),
            ("chunk_records", chunk_records),
            ("prefetch_chunks", prefetch_chunks),
        ):
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(allow_mix_change, bool):
            raise SpecError(f"allow_mix_change must be True or False, got {allow_mix_change!r}")
        self.spec = spec
        fingerprint = spec.fingerprint
        plan = spec.compile()
        lane_ids = list(self._slice.lane_ids)
        restored: dict[int, LaneState | None] = dict.fromkeys(lane_ids)
        step = 0
        history: list[tuple[int, dict[str, Any]]] = [] if plan.mixer is None else [(0, plan.mixer.params())]
        if state is not None:
            loaded = to_loader_state(state)
            changed = loaded.check_compatible(
                lanes=spec.lanes,
                fingerprint=fingerprint,
                mix_part=None if plan.mix_label is None else f"operator {plan.mix_label}",
                allow_mix_change=allow_mix_change,
            )
            history = _mix_history(plan.mixer, loaded.mix_history, loaded.step, changed)
            missing = [lane for lane in lane_ids if lane not in loaded.lane_states]
            if missing:
                raise StateError(
                    f"the state has no entry for lane(s) {missing}, which rank {rank} of {world_size} "
                    f"runs; gather every rank's state_dict() and pass zf.merge_states(states)"
                )
            restored = {lane: loaded.lane_states[lane] for lane in lane_ids}
            step = loaded.step
        self._mix_history = history
        mixture = None if plan.mixer is None else _mixture(history)
        self._skip_lock = threading.Lock()
        self._skip_warned: set[str] = set()
        self._source_labels = [sp.label for sp in plan.sources]
        self._backend = make_backend(
            backend, workers=workers, segment=plan.front_segment(), chunk_timeout=chunk_timeout
        )
        self._lanes = [
            LaneRunner(
                plan,
                self._backend,
                lane=lane,
                lanes=spec.lanes,
                seed=spec.seed,
                window=spec.per_lane,
                state=restored[lane],
                chunk_records=chunk_records,
                depth=prefetch_chunks,
                step=step,
                mixture=mixture,
                on_skip=self._on_skip,
            )
            for lane in lane_ids
        ]
        self._fingerprint = fingerprint
        self._step = step
        self._last = self._state(step, {ln.lane: ln.snapshot() for ln in self._lanes})
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def rank_slice(self) -> RankSlice:
        return self._slice

    def _state(self, step: int, lanes: dict[int, LaneState]) -> LoaderState:
        return LoaderState(step, self.spec.lanes, self._fingerprint, lanes, list(self._mix_history))

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

    def _produce(self) -> None:
        step = self._step
        rows = self._slice.rows_of_lanes()
        try:
            for lane in self._lanes:
                lane.prime()
            while not self._stop.is_set():
                windows = []
                for lane in self._lanes:
                    w = lane.next_window()
                    if w is None:
                        self._put(_END)
                        return
                    windows.append(w)
                samples = [s for w in windows for s in w][rows]
                batch = stack(samples, where=f"global batch {step}")
                snap = {ln.lane: ln.snapshot() for ln in self._lanes}
                step += 1
                self._put((step - 1, batch, self._state(step, snap)))
        except BaseException as exc:  # delivered to the consumer, re-raised there
            self._put(exc)

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        if self._closed:
            raise ZephonError("this Loader is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="zephon-lanes", daemon=True)
            self._thread.start()
        while True:
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
            yield step, batch

    def state_dict(self) -> dict[str, Any]:
        """Plain data: this rank's lanes, positioned after the last batch yielded."""
        return self._last.to_plain()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for lane in self._lanes:
            lane.close()
        self._backend.close()
        if self._thread is not None:
            self._thread.join(timeout=30)

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


def _mix_history(
    mixer: Mix | None, stored: list[tuple[int, dict[str, Any]]], step: int, changed: bool
) -> list[tuple[int, dict[str, Any]]]:
    """The mixture history to run with: the checkpoint's, plus the spec's Mix from ``step``
    on when the mixture was changed on this resume."""
    if mixer is None:
        return []
    if not stored or stored[0][0] != 0:
        raise CorruptStateError(f"the checkpoint's mix_history {stored!r} does not start at step 0")
    if not changed:
        return list(stored)
    old = stored[-1][1]
    new = mixer.params()
    if old.get("exhausted") != new["exhausted"]:
        raise FingerprintMismatchError(
            f"Mix: exhausted={new['exhausted']!r} differs from the checkpoint's "
            f"{old.get('exhausted')!r}; only weights, schedule and interpolation may change on resume"
        )
    return [(s, p) for s, p in stored if s < step] + [(step, new)]


def _mixture(history: list[tuple[int, dict[str, Any]]]) -> Mixture:
    try:
        return Mixture([(step, Mix.from_params(params)) for step, params in history])
    except (SpecError, KeyError, TypeError, ValueError) as exc:
        raise CorruptStateError(f"the checkpoint's mix_history {history!r} is not valid: {exc}") from exc
