"""One lane's mix and whole ordered back in a single stateful DoFn, for mixes with a schedule.

A ``Mix`` whose weights follow a schedule over steps draws each record at the step its lane
has reached: the deterministic runner's lane draws record ``k + 1`` after pushing record ``k``'s
outputs through the back, at step ``floor(outputs so far / (B/L))``. That is a feedback from
the end of the back to the mix, which separate Beam stages cannot carry, so the translation
runs the mix and every stage after it in this one DoFn, keyed by lane (chunks still arrive in
any order and are resequenced per source, as in ``MixStage``); the stages run through the
deterministic runner's own invokers, with their state in Beam state.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

from zephon_flow.core.markers import DocId
from zephon_flow.core.schedule import WindowLengths, window_step
from zephon_flow.runners.beam.mix import MixDraw, MixLane
from zephon_flow.runners.beam.pieces import END, Piece, SourceChunk
from zephon_flow.runners.dofns import DoFnLaneState, StatefulInvoker, StatelessInvoker, dofn_errors

#: A stage of the back as the DoFn is built with it: a stateless invoker, or what makes a
#: stateful one (label, DoFn, seed: invokers of stateful DoFns are made on the worker).
BackStage = StatelessInvoker | tuple[str, beam.DoFn, int]


@dataclass
class _Lane:
    mix: MixLane
    stages: dict[str, tuple[dict[str, Any], dict[str, int], int]] = field(default_factory=dict)
    outputs: int = 0  # the back's outputs so far: the lane's step is outputs // (B/L)
    emitted: int = 0


class LaneBack:
    """The back of one lane run in place, stage after stage, through the deterministic
    runner's invokers (the lane's state passed in): shared by ``LaneStage`` and
    ``BoundedLane``."""

    def __init__(self, back: list[BackStage]) -> None:
        self._back = back
        self._stages: list[StatelessInvoker | StatefulInvoker] = []

    def setup(self) -> None:
        self._stages = [
            s if isinstance(s, StatelessInvoker) else StatefulInvoker(s[0], s[1], seed=s[2])
            for s in self._back
        ]

    def teardown(self) -> None:
        for stage in self._stages:
            stage.teardown()

    def users(self, saved: dict[str, tuple[dict[str, Any], dict[str, int], int]]) -> dict[str, DoFnLaneState]:
        """Each stateful stage's state for the lane, from what ``saved`` holds (fresh if nothing)."""
        return {
            s.label: DoFnLaneState(*saved.get(s.label, ({}, {}, 0)))
            for s in self._stages
            if isinstance(s, StatefulInvoker)
        }

    def push(
        self,
        where: str,
        lane: int,
        index: int,
        value: Any,
        doc: DocId | None,
        users: dict[str, DoFnLaneState],
        out: list[tuple[Any, DocId | None]],
    ) -> int:
        """Pushes ``value`` through the back from stage ``index``; the outputs it made."""
        if index == len(self._stages):
            out.append((value, doc))
            return 1
        stage = self._stages[index]
        with dofn_errors(stage.label, where):
            if isinstance(stage, StatefulInvoker):
                results = stage.process(lane, value, users[stage.label], doc)
            else:
                results = stage(value)
        return sum(self.push(where, lane, index + 1, r, doc, users, out) for r in results)

    def end(self, lane: int, users: dict[str, DoFnLaneState], out: list[tuple[Any, DocId | None]]) -> int:
        """The end of the lane's input: each stateful stage's timers fire, in stage order, their
        outputs pushed through the stages after it; the outputs this made."""
        made = 0
        for i, stage in enumerate(self._stages):
            if isinstance(stage, StatefulInvoker):
                with dofn_errors(stage.label, f"lane {lane}, in a timer at the end of its input"):
                    fired = stage.fire_timers(lane, users[stage.label], None)
                for value in fired:
                    made += self.push(
                        f"lane {lane}, after the end of its input", lane, i + 1, value, None, users, out
                    )
        return made


class LaneStage(beam.DoFn):  # type: ignore[misc]
    """``(lane, SourceChunk) -> (lane, Piece)``: the mix and the whole back of one lane, each
    record drawn at the lane's step, as ``runners/lane.py`` draws it."""

    STATE = ReadModifyWriteStateSpec("zephon_lane", PickleCoder())

    def __init__(self, draw: MixDraw, back: list[BackStage], *, per_lane: int | WindowLengths) -> None:
        super().__init__()
        self._draw, self._back, self._per_lane = draw, LaneBack(back), per_lane

    def setup(self) -> None:
        self._draw.setup()
        self._back.setup()

    def teardown(self) -> None:
        self._back.teardown()

    def process(
        self, element: tuple[int, SourceChunk], state: Any = beam.DoFn.StateParam(STATE)
    ) -> Iterator[tuple[int, Piece]]:
        lane, chunk = element
        st: _Lane | None = state.read()
        if st is None:
            st = _Lane(self._draw.fresh())
        if not st.mix.stopped:  # once stopped, what is left of the other sources is never drawn
            self._draw.arrive(lane, st.mix, chunk)
            users = self._back.users(st.stages)
            out: list[tuple[Any, DocId | None]] = []
            while True:
                what, record = self._draw.next(lane, st.mix, window_step(self._per_lane, st.outputs))
                if what != "record":
                    break
                doc, values = record
                where = f"lane {lane}, mix position {st.mix.position - 1}"
                for value in values:
                    st.outputs += self._back.push(where, lane, 0, value, doc, users, out)
            stop = None if what == "wait" else what
            if stop == END:
                st.outputs += self._back.end(lane, users, out)
            if out or stop:
                yield lane, Piece(st.emitted, out, stop)
                st.emitted += 1
            st.stages = {label: (u.values, u.timers, u.position) for label, u in users.items()}
            state.write(_Lane(MixLane([], stopped=True)) if stop else st)
