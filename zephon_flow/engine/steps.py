"""Producing steps: the one loop that drives lanes, step by step, into what holds the steps.

Every way of running lanes in a process makes its steps here. ``LaneSteps`` makes one step from
a set of lanes (``LaneRunner``s, primed breadth first before the first): each lane's window
and sample layout, each lane's snapshot after it (the state from which the next step is its
next window), the windows as made (which complete the checks of a state taken before the
step) and whether the step exists as far as these lanes tell (``step_exists``). ``produce``
is the loop: while the sink has room for the next step, one more step from the source into
it, until the sink says the sequence ended, the source has no more, or something fails (handed
to the sink). What a sink does with a step is its own:

- the embedded ``Loader`` (``engine/loader.py``) agrees on the end of a finite pass, assembles
  its rank's rows and queues ``prefetch`` batches with their states;
- a lane owner (``cluster/owner.py``) holds each step's windows and snapshots for its readers
  under ``StepHold`` (``engine/hold.py``), waiting while it is ``ahead`` of the slowest;
- ``zephon serve`` (``service/server.py``) feeds its embedded Loader (``Loader.feed``): the
  Loader's sink hands each batch and state straight to ``HeldSteps`` (``service/held.py``),
  waiting for room there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from zephon_flow.core.assemble import step_exists
from zephon_flow.core.batches import SampleLayout
from zephon_flow.core.checkpoint.state import LaneState
from zephon_flow.core.checkpoint.window_check import MadeWindow, WindowCheck
from zephon_flow.runners.lane import LaneRunner, prime_lanes

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class MadeStep:
    """Step ``step`` of some lanes (``lanes``, in lane order): each lane's window and the
    layout of its first sample (for padding a finite pass), each lane's snapshot from which
    ``step + 1`` is its next window, the windows as made (lanes that made none left out), and
    whether the step exists as far as these lanes tell (``step_exists``)."""

    step: int
    lanes: tuple[int, ...]
    windows: tuple[list[Any], ...]
    layouts: tuple[SampleLayout | None, ...]
    snapshots: dict[int, LaneState]
    made: dict[int, MadeWindow | WindowCheck]
    exists: bool

    def lane_layouts(self) -> list[tuple[int, SampleLayout | None]]:
        """``(lane, layout)`` per lane, as ``assemble_rows`` takes them."""
        return list(zip(self.lanes, self.layouts, strict=True))


class LaneSteps:
    """Makes the steps of ``runners`` (in lane order) from ``first_step`` on; a step's windows
    are ``per_lane_at(step)`` outputs long when whole, and ``finite`` says whether a pass ends."""

    def __init__(
        self,
        runners: Sequence[LaneRunner],
        *,
        first_step: int,
        per_lane_at: Callable[[int], int],
        finite: bool,
    ) -> None:
        self._runners = list(runners)
        self._lanes = tuple(runner.lane for runner in self._runners)
        self._per_lane_at, self._finite = per_lane_at, finite
        self._primed = False
        #: The next step ``make`` makes.
        self.step = first_step

    def make(self) -> MadeStep:
        """The next step (the lanes are primed, breadth first, before the first)."""
        if not self._primed:
            prime_lanes(self._runners)
            self._primed = True
        windows = tuple(runner.next_window() for runner in self._runners)
        step, self.step = self.step, self.step + 1
        return MadeStep(
            step=step,
            lanes=self._lanes,
            windows=windows,
            layouts=tuple(runner.layout for runner in self._runners),
            snapshots={runner.lane: runner.snapshot() for runner in self._runners},
            made={runner.lane: runner.made for runner in self._runners if runner.made is not None},
            exists=step_exists(windows, per_lane=self._per_lane_at(step), finite=self._finite),
        )


class StepSource(Protocol[T_co]):
    """What ``produce`` draws steps from: the number of the next one, and the next one (None:
    there are no more)."""

    @property
    def step(self) -> int: ...

    def make(self) -> T_co | None: ...


def produce(
    source: StepSource[T],
    *,
    room: Callable[[int], bool],
    put: Callable[[T], bool],
    fail: Callable[[BaseException], None],
    end: Callable[[], None] | None = None,
) -> None:
    """The one producer loop. ``room(step)`` waits until ``step`` may be made (False: stop
    producing); ``put(made)`` takes the step made (False: the sequence ended there);
    ``end()`` is called when ``source`` has no more steps; ``fail(exc)`` gets anything raised,
    by the source or the sink (it is not raised again: the producer is a thread of its own)."""
    try:
        while room(source.step):
            made = source.make()
            if made is None:
                if end is not None:
                    end()
                return
            if not put(made):
                return
    except BaseException as exc:  # handed to whoever reads the steps, raised there
        fail(exc)
