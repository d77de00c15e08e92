"""A lane's whole chain in one call, reading only what its windows of the first steps need.

Lane ``l``'s window ``b`` is a fixed range of the lane's outputs (``[b*B/L, (b+1)*B/L)``, or
under a batch size schedule ``rows_before(b)/L`` on), so global batches ``0 .. N-1`` need from
each lane only its first ``rows_before(N)/L`` outputs. ``BoundedLane`` runs one lane's read, its
stateless front, the mix and the back in one call, in the lane's order, as the deterministic
runner's lane does; it reads a source's next chunk only when the mix draws a record from it
that has not been read, and stops drawing (hence reading) as soon as the lane has made those
outputs. Outputs past them are dropped, and the lane's last piece says ``TRUNCATED``: nothing
that waits for the end of the input fires, and no window past step ``N-1`` is made. A lane
whose input ends first ends as it does in the full translation (``END``: the end-of-input
timers fire; its last window is partial and padded at assembly).

What came before a stop is exactly what the unbounded run computes up to that point, so the
windows of steps ``< N`` are its windows, bit for bit: stateful DoFns (``Pack``, ``Shuffle``)
see the same inputs in the same order, and never the end of an input that did not end. What
is given up is parallelism inside a lane: Beam runs the lanes in parallel, but one lane's
records are decoded one chunk after another (``translate.py`` spreads chunks over workers when
every step of the passes is wanted).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import apache_beam as beam

from zephon_flow.core.markers import DocId
from zephon_flow.core.schedule import WindowLengths, window_step
from zephon_flow.runners.beam.fused import BackStage, LaneBack
from zephon_flow.runners.beam.mix import MixDraw
from zephon_flow.runners.beam.pieces import END, TRUNCATED, Piece
from zephon_flow.runners.beam.read import ReadLane, decode_chunk
from zephon_flow.runners.segment import FrontSegment


def outputs_before(per_lane: int | WindowLengths, step: int) -> int:
    """How many outputs a lane makes before its window ``step``."""
    if isinstance(per_lane, int):
        return per_lane * step
    return per_lane.schedule.rows_before(step) // per_lane.lanes


class BoundedLane(beam.DoFn):  # type: ignore[misc]
    """``lane -> (lane, Piece)``: the lane's outputs for global batches ``0 .. steps-1``, read,
    decoded, mixed and pushed through the back in one call, reading no further than they need."""

    def __init__(
        self,
        reads: list[ReadLane],
        segment: FrontSegment,
        draw: MixDraw,
        back: list[BackStage],
        *,
        per_lane: int | WindowLengths,
        steps: int,
    ) -> None:
        super().__init__()
        self._reads, self._segment, self._draw = reads, segment, draw
        self._back, self._per_lane = LaneBack(back), per_lane
        self._need = outputs_before(per_lane, steps)

    def setup(self) -> None:
        self._draw.setup()
        self._back.setup()

    def teardown(self) -> None:
        self._back.teardown()
        self._segment.teardown()

    def process(self, lane: int) -> Iterator[tuple[int, Piece]]:
        feeds = [read.chunks(lane) for read in self._reads]
        mix, users = self._draw.fresh(), self._back.users({})
        out: list[tuple[Any, DocId | None]] = []
        made, seq, stop = 0, 0, TRUNCATED  # TRUNCATED: stopped at the need, not at an end
        try:
            while made < self._need:
                what, got = self._draw.next(lane, mix, window_step(self._per_lane, made))
                if what == "wait":  # the drawn source's next chunk: read it only now
                    if out:
                        yield lane, Piece(seq, out, None)
                        seq, out = seq + 1, []
                    self._draw.arrive(lane, mix, decode_chunk(self._segment, next(feeds[got])))
                    continue
                if what != "record":
                    stop = what
                    break
                doc, values = got
                where = f"lane {lane}, mix position {mix.position - 1}"
                for value in values:
                    made += self._back.push(where, lane, 0, value, doc, users, out)
            if stop == END:
                made += self._back.end(lane, users, out)
        finally:
            for feed in feeds:
                feed.close()
        # Outputs past the need (a record or a timer that made several) are for later steps;
        # all of them are still in ``out``: a piece is sent only while ``made < need``.
        past = max(0, made - self._need)
        yield lane, Piece(seq, out[: len(out) - past], stop)
