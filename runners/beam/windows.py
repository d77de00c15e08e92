"""The end of a translated pipeline: each lane's outputs cut into windows, then global batches.

``LaneWindows`` (keyed by lane, ordered like every stage) numbers the lane's outputs and emits
window ``b`` (outputs ``[b*B/L, (b+1)*B/L)``) keyed by the step ``b``; ``AssembleStep`` gets all
lanes' windows of a step after a ``GroupByKey`` and concatenates them in lane order, as the
embedded ``Loader`` does for a rank holding every lane: an endless pipeline's step exists when
every lane filled its window; a finite one's while any lane has a real sample, the rest padded
and marked in ``valid``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

from zephon_flow.core.assemble import assemble_rows, step_exists
from zephon_flow.core.batches import Batch, SampleLayout, stack
from zephon_flow.core.schedule import WindowLengths, window_length
from zephon_flow.runners.beam.order import Resequencer
from zephon_flow.runners.beam.pieces import END, LaneWindow, Piece


@dataclass
class _WindowLane:
    order: Resequencer[Piece] = field(default_factory=Resequencer)
    step: int = 0
    partial: list[Any] = field(default_factory=list)
    layout: SampleLayout | None = None
    seen: bool = False


class LaneWindows(beam.DoFn):  # type: ignore[misc]
    """``(lane, Piece) -> (step, LaneWindow)``: full windows as they fill; at a finite input's end,
    the last partial one. A truncated lane's partial window is dropped (its step is not whole)."""

    STATE = ReadModifyWriteStateSpec("zephon_windows", PickleCoder())

    def __init__(self, per_lane: int | WindowLengths) -> None:
        super().__init__()
        self._per_lane = per_lane  # a length, or each step's (a batch size schedule)

    def process(
        self, element: tuple[int, Piece], state: Any = beam.DoFn.StateParam(STATE)
    ) -> Iterator[tuple[int, LaneWindow]]:
        lane, piece = element
        st: _WindowLane | None = state.read()
        if st is None:
            st = _WindowLane()
        for ready in st.order.put(piece.seq, piece, where=f"windows: lane {lane}"):
            for value, _ in ready.items:
                if not st.seen:
                    st.layout, st.seen = SampleLayout.of(value), True
                st.partial.append(value)
                if len(st.partial) == window_length(self._per_lane, st.step):
                    yield st.step, LaneWindow(lane, st.partial, st.layout)
                    st.step, st.partial = st.step + 1, []
            if ready.stop == END and st.partial:
                yield st.step, LaneWindow(lane, st.partial, st.layout)
                st.partial = []
        state.write(st)


class AssembleStep(beam.DoFn):  # type: ignore[misc]
    """``(step, windows) -> (step, global batch)``, the lanes' windows in lane order, padded as
    every way of running lanes pads (``core/assemble.py``)."""

    def __init__(self, *, lanes: int, per_lane: int | WindowLengths, finite: bool, padding: Any) -> None:
        super().__init__()
        self._lanes, self._per_lane, self._finite, self._padding = lanes, per_lane, finite, padding

    def process(self, element: tuple[int, Iterable[LaneWindow]]) -> Iterator[tuple[int, Batch]]:
        step, windows = element
        by_lane = {lane: (samples, layout) for lane, samples, layout in windows}
        where = f"global batch {step}"
        per_lane = window_length(self._per_lane, step)
        empty: tuple[list[Any], SampleLayout | None] = ([], None)
        lanes = [by_lane.get(lane, empty) for lane in range(self._lanes)]
        # A lane with no window for the step: endless, past the passes read (the step is not
        # whole, so not made); finite, its input has ended (padded).
        if not step_exists([window for window, _ in lanes], per_lane=per_lane, finite=self._finite):
            return
        if not self._finite:
            yield step, stack([v for window, _ in lanes for v in window], where=where)
            return
        yield (
            step,
            assemble_rows(
                step,
                [window for window, _ in lanes],
                [(lane, layout) for lane, (_, layout) in enumerate(lanes)],
                rows=slice(None),
                per_lane=per_lane,
                finite=True,
                padding=self._padding,
            ),
        )
