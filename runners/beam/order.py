"""The back of a translated pipeline: a resequencer, and the stages after the mix, keyed by lane.

Beam delivers elements in no particular order. Every stage that needs order (the mix in
``mix.py``, a user's stateful DoFn here, the lane's windows in ``windows.py``) is a stateful
DoFn keyed by lane that first puts what arrives through a ``Resequencer`` (Beam user state
holding the next expected number and what came early) and works only on the run of elements
that is complete. Stateless DoFns after the first stateful one keep each piece's number and
run anywhere. The user's stateful DoFn
is driven by the deterministic runner's own ``StatefulInvoker`` with its state kept in Beam
state, so its timers, positions, seed and provenance mean exactly what they mean there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

from zephon_flow.core.errors import StageError
from zephon_flow.core.markers import DocId
from zephon_flow.runners.beam.pieces import END, Piece
from zephon_flow.runners.dofns import DoFnLaneState, StatefulInvoker, StatelessInvoker, dofn_errors

T = TypeVar("T")


@dataclass
class Resequencer(Generic[T]):
    """Numbered items in, the complete run from ``next`` out; refuses duplicates and late ones."""

    next: int = 0
    held: dict[int, T] = field(default_factory=dict)

    def put(self, seq: int, item: T, *, where: str) -> list[T]:
        """Holds ``item`` as number ``seq``; returns the run now complete (maybe empty)."""
        if seq < self.next or seq in self.held:
            raise StageError(f"{where}: element {seq} arrived twice (the next expected is {self.next})")
        self.held[seq] = item
        ready = []
        while self.next in self.held:
            ready.append(self.held.pop(self.next))
            self.next += 1
        return ready


# -- stateless and stateful DoFns -----------------------------------------------------


class StatelessStage(beam.DoFn):  # type: ignore[misc]
    """``(lane, Piece) -> (lane, Piece)``: a stateless DoFn after the first stateful one, on each
    item; keeps the piece's number, so it needs no order and runs anywhere."""

    def __init__(self, invoker: StatelessInvoker) -> None:
        super().__init__()
        self._invoker = invoker

    def teardown(self) -> None:
        self._invoker.teardown()

    def process(self, element: tuple[int, Piece]) -> Iterator[tuple[int, Piece]]:
        lane, piece = element
        out: list[tuple[Any, DocId | None]] = []
        with dofn_errors(self._invoker.label, f"lane {lane}, piece {piece.seq}"):
            for value, doc in piece.items:
                out.extend((o, doc) for o in self._invoker(value))
        yield lane, piece._replace(items=out)


@dataclass
class _UserLane:
    """A user's stateful DoFn's state for one lane, and the lane's pieces not yet in order."""

    order: Resequencer[Piece] = field(default_factory=Resequencer)
    values: dict[str, Any] = field(default_factory=dict)
    timers: dict[str, int] = field(default_factory=dict)
    position: int = 0


class OrderedStage(beam.DoFn):  # type: ignore[misc]
    """``(lane, Piece) -> (lane, Piece)``: a user's stateful DoFn fed its lane's elements in
    order; piece ``seq`` in gives piece ``seq`` out. On the piece that ends a finite input, the
    DoFn's timers fire as at the end of a lane's input in the deterministic runner."""

    STATE = ReadModifyWriteStateSpec("zephon_stage", PickleCoder())

    def __init__(self, label: str, dofn: beam.DoFn, *, seed: int) -> None:
        super().__init__()
        self._label, self._dofn, self._seed = label, dofn, seed
        self._invoker: StatefulInvoker | None = None

    def setup(self) -> None:
        self._invoker = StatefulInvoker(self._label, self._dofn, seed=self._seed)

    def teardown(self) -> None:
        if self._invoker is not None:
            self._invoker.teardown()

    def process(
        self, element: tuple[int, Piece], state: Any = beam.DoFn.StateParam(STATE)
    ) -> Iterator[tuple[int, Piece]]:
        lane, piece = element
        invoker = self._invoker
        assert invoker is not None
        st: _UserLane | None = state.read()
        if st is None:
            st = _UserLane()
        user = DoFnLaneState(values=st.values, timers=st.timers, position=st.position)
        for ready in st.order.put(piece.seq, piece, where=f"DoFn {self._label!r}: lane {lane}"):
            out: list[tuple[Any, DocId | None]] = []
            for value, doc in ready.items:
                with dofn_errors(self._label, f"lane {lane}, element {user.position}"):
                    out.extend((o, doc) for o in invoker.process(lane, value, user, doc))
            if ready.stop == END:
                with dofn_errors(self._label, f"lane {lane}, in a timer at the end of its input"):
                    out.extend((o, None) for o in invoker.fire_timers(lane, user, None))
            yield lane, ready._replace(items=out)
        st.values, st.timers, st.position = user.values, user.timers, user.position
        state.write(st)
