"""A lane owner: a deterministic runner over a fixed set of lanes, serving their windows by step.

``LaneOwner`` is plain Python (tested without Ray); ``actors.OwnerActor`` wraps it as the Ray
actor that ``Coordinator`` starts, one per group of lanes. An owner holds (in ``engine/hold.py``'s
``StepStore``), for the steps ``[low, produced)``, each lane's window and, for each step in
``[low, produced]``, each lane's snapshot from which that step is the next window. Its readers
are the trainer ranks whose rows fall on its lanes; as for ``zephon serve``'s held steps (one
rule, ``engine/hold.py``'s ``StepHold``),
production runs at most ``ahead`` steps past the slowest reader's position (the step it asks
for next) and steps more than ``keep`` behind it are dropped, so a rank that re-asks for the
step it is at gets the same bytes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from zephon_flow.core.assemble import assemble_rows
from zephon_flow.core.batches import Batch, SampleLayout
from zephon_flow.core.checkpoint.state import LaneState, LoaderState
from zephon_flow.core.checkpoint.window_check import MadeWindow, WindowCheck
from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import OwnerError as OwnerError  # also imported from here
from zephon_flow.core.errors import SpecError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.engine.hold import StepStore
from zephon_flow.engine.loader import LaneStart, apply_mix_change, build_lane_runners, restore_lanes
from zephon_flow.engine.options import OwnerOptions as OwnerOptions  # also imported from here
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.engine.steps import LaneSteps, MadeStep, produce


@dataclass(frozen=True)
class OwnerRows:
    """One step's windows of some of an owner's lanes, in lane order, with each lane's
    first-sample layout (for padding a finite pass) as it was when the window closed."""

    step: int
    lanes: tuple[int, ...]
    windows: tuple[list[Any], ...]
    layouts: tuple[SampleLayout | None, ...]


def share_of(rs: RankSlice, lanes: list[int]) -> tuple[list[int], slice]:
    """The lanes among ``lanes`` under rank slice ``rs``, and the rank's rows relative to their
    concatenated windows (what one owner of ``lanes`` sends that rank)."""
    mine = [lane for lane in rs.lane_ids if lane in lanes]
    if not mine:
        return [], slice(0, 0)
    per_lane = rs.per_lane
    lo_row, hi_row = mine[0] * per_lane, (mine[-1] + 1) * per_lane
    start, stop = max(rs.start, lo_row), min(rs.stop, hi_row)
    return mine, slice(start - lo_row, stop - lo_row)


#: How far past ``ahead`` an owner makes steps beyond the run's slowest rank: ranks report their
#: step every ``PROGRESS_EVERY`` steps (``engine/owned.py``) and the floor reaches owners a call
#: later, so ranks that keep in step never wait for it; one that runs ahead is held this close.
FLOOR_REACH = 32


class LaneOwner:
    """Runs ``lanes`` of ``spec`` from ``state`` (a ``LoaderState`` holding at least those lanes,
    or None: the start) for the ranks ``readers`` (rank -> the first step it may ask for);
    ``name`` is how errors refer to it. ``clock`` is what every wait of its production and of
    its readers, and its backend's chunk deadlines, read (an owner on Ray: the system's).
    ``replay``: how many steps past its first step ranks may come back at (served owners
    started again from a checkpoint while the ranks read on): until the run's slowest rank is
    reported past that step, production runs that much further past it."""

    def __init__(
        self,
        spec: LoaderSpec,
        lanes: list[int],
        *,
        state: LoaderState | None,
        readers: dict[int, int],
        options: OwnerOptions,
        name: str = "lane owner",
        clock: Clock = SYSTEM_CLOCK,
        replay: int = 0,
    ) -> None:
        # Phases: restore the lanes' start, build the runners, start producing (``start``).
        if not lanes or sorted(set(lanes)) != list(lanes) or not 0 <= lanes[0] <= lanes[-1] < spec.lanes:
            raise SpecError(f"{name}: lanes must be distinct, sorted and in [0, {spec.lanes}), got {lanes}")
        self.spec, self.lanes, self.name, self.options = spec, list(lanes), name, options
        self._replay = replay
        plan = spec.compile()
        self._finite = plan.finite
        self._padding = plan.padding_sample() if plan.finite else None
        start = restore_lanes(
            spec,
            plan,
            state,
            self.lanes,
            who=name,
            allow_mix_change=options.allow_mix_change,
            allow_code_change=options.allow_code_change,
            verify=options.verify_resume,
        )
        self._backend = options.work.make_backend(plan.front_segment(), clock)
        self.clock = clock
        self._runners = build_lane_runners(
            spec,
            plan,
            self._backend,
            start,
            chunk_records=options.chunk_records,
            depth=options.prefetch_chunks,
            on_skip=_ignore_skip,
        )
        self._steps = LaneSteps(
            self._runners, first_step=start.step, per_lane_at=spec.per_lane_at, finite=self._finite
        )
        self._hold_from(start, readers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name=f"zephon-{name}", daemon=True)

    def _hold_from(self, start: LaneStart, readers: dict[int, int]) -> None:
        """What it holds (``engine/hold.py``'s ``StepStore``: per step the ``MadeStep``, per
        step its lanes' snapshots), empty but for the snapshots (and checks) of ``start``'s
        step, for ``readers`` expected to ask from the steps given."""
        self.first_step = start.step
        self._mixture = start.mixture  # changed in place from a step on: hold/change_mixture
        self._begun = start.step  # the first step the lanes have not begun to make
        self._fence: int | None = None  # production waits before this step (a change pending)
        self._store: StepStore[MadeStep, dict[int, LaneState]] = StepStore(
            first_step=start.step,
            first_state={r.lane: r.snapshot() for r in self._runners},
            ahead=self.options.ahead,
            keep=self.options.keep,
            clock=self.clock,
        )
        self._cond, self._hold = self._store.cond, self._store.rule
        # The checks of the start's windows, as its state recorded them (a step's own windows
        # as made complete the checks of the snapshots at it: computed only when asked for).
        restored = {lane: ls.next_window for lane, ls in start.lanes.items() if ls is not None}
        self._restored: dict[int, MadeWindow | WindowCheck] | None = None
        if restored and all(restored.values()):
            self._restored = {lane: c for lane, c in restored.items() if c is not None}
        self._dead_from: int | None = None  # first step at which none of its lanes had a sample
        # Readers expected to ask, from the step given (steps from there on are held for them);
        # once they have asked, production waits for the slowest of them.
        self._hold.expected = {reader: max(start.step, at) for reader, at in readers.items()}

    # -- production ----------------------------------------------------------------------------
    def start(self) -> LaneOwner:
        self._thread.start()
        return self

    def _produce(self) -> None:
        """The producer thread: the engine's loop (``engine/steps.py``) from its lanes into the
        steps it holds for its readers."""
        produce(self._steps, room=self._room, put=self._keep, fail=self._fail)

    def _room(self, step: int) -> bool:
        """Waits until its readers leave room for one more step (``StepHold``) and no mixture
        change holds production back; False once it is closed."""
        with self._cond:
            if not self._store.wait_for_room(self._stop.is_set, blocked=self._fenced):
                return False
            self._begun = self._hold.produced + 1
        return not self._stop.is_set()

    def _keep(self, made: MadeStep) -> bool:
        """Holds step ``made`` (its windows and layouts for the readers, its windows as made
        for the checks of the snapshots at it) and the snapshots after it."""
        with self._cond:
            step = self._store.add(made, made.snapshots)
            if self._dead_from is None and not made.exists:
                self._dead_from = step
        return True

    def _fail(self, exc: BaseException) -> None:
        """Its pipeline failed: handed to every reader, naming the owner's lanes."""
        self._store.finish(exc)

    def check(self) -> None:
        """Raises its pipeline's failure (an ``OwnerError``), if it failed."""
        with self._cond:
            self._raise_error()

    def _raise_error(self) -> None:
        error = self._store.error
        if error is not None:
            raise OwnerError(
                f"{self.name} (lanes {self.lanes}) failed at step {self._hold.produced}: "
                f"{type(error).__name__}: {error}"
            ) from error

    def _held(self) -> str:
        return f"{self.name} (lanes {self.lanes}) holds steps [{self._hold.low}, {self._hold.produced})"

    def _made_at(self, step: int) -> dict[int, MadeWindow | WindowCheck] | None:
        """Step ``step``'s windows as made (its start's: the checks its state recorded); None
        while it is not made, or once it is let go."""
        if step < self._hold.low:
            return None
        if step == self.first_step and self._restored is not None:
            return self._restored
        return self._store.get(step).made if step < self._hold.produced else None

    # -- what readers and the coordinator ask ------------------------------------------------
    def rows(
        self,
        reader: int,
        step: int,
        lanes: list[int] | None = None,
        timeout: float = 5.0,
        active: Callable[[], bool] | None = None,
    ) -> OwnerRows | None:
        """Step ``step``'s windows of ``lanes`` (default: all of the owner's), for rank
        ``reader``, which has thereby taken every step before ``step``; None if ``step`` was not
        produced within ``timeout`` seconds on its clock, or once ``active()`` turns false (the
        reader's call ended)."""
        wanted = self.lanes if lanes is None else lanes
        index = [self.lanes.index(lane) for lane in wanted if lane in self.lanes]
        if len(index) != len(wanted):
            raise OwnerError(
                f"{self.name} runs lanes {self.lanes}, not {sorted(set(wanted) - set(self.lanes))}"
            )
        with self._cond:
            self._hold.advance(reader, step)
            self._store.release()
            if step < self._hold.low:
                raise OwnerError(
                    f"step {step} is no longer held: {self._held()}; resume from a checkpoint to go back further"
                )
            made = self._store.wait_for_step(step, timeout, active)
            self._raise_error()
            if not made:
                return None
            held = self._store.get(step)
            windows, layouts = held.windows, held.layouts
        return OwnerRows(
            step,
            tuple(wanted),
            tuple(windows[i] for i in index),
            tuple(layouts[i] for i in index),
        )

    def share(
        self, rs: RankSlice, step: int, timeout: float = 5.0, active: Callable[[], bool] | None = None
    ) -> Batch | None:
        """Rank ``rs``'s rows of step ``step`` that lie on this owner's lanes, assembled as the
        Loader assembles them (``assemble_rows``: padding and ``valid`` for a finite pass); the
        owners' shares, concatenated in lane order, are the rank's batch. None: not produced
        within ``timeout`` seconds, or ``active()`` turned false (as ``rows``)."""
        lanes, rows = share_of(rs, self.lanes)
        if not lanes:
            raise OwnerError(
                f"rank {rs.rank} of {rs.world_size} has no rows on {self.name}'s lanes {self.lanes} "
                f"(its rows are on lanes {list(rs.lane_ids)})"
            )
        got = self.rows(rs.rank, step, lanes, timeout, active)
        if got is None:
            return None
        return assemble_rows(
            step,
            list(got.windows),
            list(zip(got.lanes, got.layouts, strict=True)),
            rows=rows,
            per_lane=self.spec.per_lane,
            finite=self._finite,
            padding=self._padding,
        )

    def shares(self, rs: RankSlice, step: int, count: int, timeout: float = 5.0) -> list[Batch] | None:
        """As ``share``, for a run of steps: rank ``rs``'s rows of ``step`` and the ``count - 1``
        steps after it, in one reply. Waits up to ``timeout`` seconds for ``step`` (None if not
        made by then), then for the rest of the run while production can go on (it cannot while
        a slower reader holds it back, or a mixture change is pending): what is made by then is
        the run. Asking counts ``step`` as asked, as ``share`` does; the steps after it do not
        move the rank's position, so they stay held until the rank asks past them."""
        first = self.share(rs, step, timeout)
        if first is None:
            return None
        lanes, rows = share_of(rs, self.lanes)
        index = [self.lanes.index(lane) for lane in lanes]
        with self._cond:
            self._store.wait_for(
                lambda: (
                    self._hold.produced >= step + count
                    or self._store.ended
                    or self._stop.is_set()
                    or not self._hold.has_room()
                    or self._fenced()
                ),
                timeout,
            )
            made = [
                self._store.get(later) for later in range(step + 1, min(step + count, self._hold.produced))
            ]
        run = [first]
        for later in made:
            run.append(
                assemble_rows(
                    later.step,
                    [later.windows[i] for i in index],
                    [(lane, later.layouts[i]) for lane, i in zip(lanes, index, strict=True)],
                    rows=rows,
                    per_lane=self.spec.per_lane,
                    finite=self._finite,
                    padding=self._padding,
                )
            )
        return run

    def live(self, step: int, timeout: float = 5.0, active: Callable[[], bool] | None = None) -> bool | None:
        """Whether any of its lanes has a real sample at ``step`` (a finite pass goes on while
        some lane has one); None if not known within ``timeout`` seconds on its clock, or once
        ``active()`` turns false."""
        with self._cond:
            if not self._store.wait_for(
                lambda: (
                    self._hold.produced > step
                    or self._store.ended
                    or (self._dead_from is not None and step >= self._dead_from)
                ),
                timeout,
                active,
            ):
                return None
            self._raise_error()
            return self._dead_from is None or step < self._dead_from

    def snapshot(self, step: int, timeout: float = 5.0) -> dict[int, LaneState] | None:
        """Each lane's state from which ``step`` is its next window, with the check of that
        window (waiting up to ``timeout`` seconds for it to be made; without the check past
        that); None if not made yet. A step it has let go (its readers are more than ``keep``
        past it) is an ``OwnerError`` naming the steps it holds: it will not come back."""
        with self._cond:
            self._raise_error()
            snaps = self._store.state(step)
            if snaps is None and step < self._hold.low:
                raise OwnerError(
                    f"no snapshot of step {step}: {self._held()}, its readers are past it; "
                    f"checkpoint a step every rank is at"
                )
            if snaps is None:
                return None
            self._store.wait_for(
                lambda: self._made_at(step) is not None or self._store.ended or self._stop.is_set(), timeout
            )
            made = dict(self._made_at(step) or {})
        return {
            lane: ls if lane not in made else replace(ls, next_window=_check(made[lane]))
            for lane, ls in snaps.items()
        }

    # -- mixture changes while running (the coordinator's two phases) --------------------------
    def _fenced(self) -> bool:
        return self._fence is not None and self._hold.produced >= self._fence

    def hold_mixture(self, step: int) -> int | None:
        """Phase one of a mixture change at ``step``: returns the first step its lanes have
        not begun when that is past ``step`` (refused), else None and production waits before
        ``step`` until ``change_mixture`` or ``release_mixture``."""
        with self._cond:
            if step < self._begun:
                return self._begun
            self._fence = step if self._fence is None else min(self._fence, step)
            return None

    def change_mixture(self, step: int, mix: Any) -> None:
        """Phase two: puts ``mix`` (``checked_mix_change``) in force from ``step`` on, and
        production goes on."""
        with self._cond:
            try:
                apply_mix_change(self._mixture, step, mix)
            finally:
                self._fence = None
                self._cond.notify_all()

    def release_mixture(self) -> None:
        """A change refused by another owner: production goes on, nothing changed."""
        with self._cond:
            self._fence = None
            self._cond.notify_all()

    def mix_history(self) -> list[tuple[int, dict[str, Any]]]:
        """The mixture history its lanes run (``[]`` without a Mix)."""
        with self._cond:
            return [] if self._mixture is None else self._mixture.history()

    def hold_floor(self, step: int) -> None:
        """The run's slowest rank is at ``step`` (the coordinator says so as ranks report):
        steps from there on stay held, so that a checkpoint or snapshot of it can be taken
        even if this owner's own readers are far past it, and production runs at most
        ``FLOOR_REACH`` past ``ahead`` beyond it (and ``replay`` more while the floor is its
        first step: the ranks, which read on, have not reported where they are yet)."""
        reach = self.options.ahead + FLOOR_REACH + (self._replay if step <= self.first_step else 0)
        with self._cond:
            if self._hold.raise_floor(step, reach):
                self._store.release()

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {
                "name": self.name,
                "lanes": list(self.lanes),
                "first_step": self.first_step,  # where it started: a replacement's snapshot step
                "low": self._hold.low,
                "produced": self._hold.produced,
                "floor": self._hold.floor,  # the slowest rank's step the coordinator last told
                "positions": dict(self._hold.positions),
                "expected": dict(self._hold.expected),
                "pid": os.getpid(),
                # What its lanes' sources were built with (records per chunk, chunks in flight).
                "chunk_records": self.options.chunk_records,
                "prefetch_chunks": self.options.prefetch_chunks,
            }

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for runner in self._runners:
            runner.close()
        self._backend.close()


def _check(made: MadeWindow | WindowCheck) -> WindowCheck:
    return made.check() if isinstance(made, MadeWindow) else made


def _ignore_skip(source: int, message: str) -> None:
    """Skipped records are counted in the lanes' cursors; the trainer-side loader reports them."""
