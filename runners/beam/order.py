"""The ordered stages of a translated pipeline: each keyed by lane, each restoring lane order.

Beam delivers elements in no particular order. Every stage here that needs order (the mix, a
user's stateful DoFn, the lane's windows) is a stateful DoFn keyed by lane that first puts what
arrives through a ``Resequencer`` (Beam user state holding the next expected number and what
came early) and works only on the run of elements that is complete. The user's stateful DoFn
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

from zephon_flow.core.errors import DataError, StageError
from zephon_flow.core.markers import DocId
from zephon_flow.core.roles import MixOperator, MixPolicy
from zephon_flow.runners.beam.pieces import END, TRUNCATED, Piece, SourceChunk
from zephon_flow.runners.dofns import DoFnLaneState, StatefulInvoker, StatelessInvoker, dofn_errors
from zephon_flow.runners.segment import Skipped

T = TypeVar("T")


@dataclass
class Resequencer(Generic[T]):
    """Numbered items in, the complete run from ``next`` out; refuses duplicates and late ones."""

    next: int = 0
    held: dict[int, T] = field(default_factory=dict)

    def put(self, seq: int, item: T, *, where: str) -> Iterator[T]:
        if seq < self.next or seq in self.held:
            raise StageError(f"{where}: element {seq} arrived twice (the next expected is {self.next})")
        self.held[seq] = item
        while self.next in self.held:
            ready = self.held.pop(self.next)
            self.next += 1
            yield ready


# -- the mix --------------------------------------------------------------------------


@dataclass
class _SourceQueue:
    """One source's chunks for one lane, and how far the mix has drawn from them."""

    chunks: Resequencer[SourceChunk] = field(default_factory=Resequencer)
    ready: list[SourceChunk] = field(default_factory=list)
    offset: int = 0  # entries of ready[0] already drawn

    def take(self) -> tuple[str, Any]:
        """("entry", (doc, result)), ("wait", None) until the next chunk arrives, or the
        source's stop ("end"/"truncated", None) once it has nothing left."""
        while self.ready:
            chunk = self.ready[0]
            if self.offset < len(chunk.entries):
                self.offset += 1
                return "entry", chunk.entries[self.offset - 1]
            if chunk.stop is not None:
                return chunk.stop, None
            self.ready.pop(0)
            self.offset = 0
        return "wait", None


@dataclass
class _MixLane:
    """A lane's mix: per source queue, the mix position, exhausted sources, pieces emitted."""

    queues: list[_SourceQueue]
    position: int = 0
    exhausted: list[int] = field(default_factory=list)
    emitted: int = 0
    stopped: bool = False


class MixDraw:
    """The mix's draw for one lane, as the deterministic runner's lane feed draws it
    (``MixPolicy.choose`` at the same seed, lane, position and step), over chunks that arrive
    in any order; shared by ``MixStage`` and ``LaneStage``."""

    def __init__(
        self,
        mixer: MixOperator | None,
        *,
        label: str,
        seed: int,
        sources: list[str],
        finite: bool,
        passes: int,
    ) -> None:
        self._mixer, self.label, self._seed, self.sources = mixer, label, seed, sources
        #: Whether the lane's input can end: a truncated endless source is then an error.
        self._finite, self._passes = finite, passes
        self._policy: MixPolicy | None = None

    def setup(self) -> None:
        self._policy = None if self._mixer is None else self._mixer.mixture()

    def fresh(self) -> _MixLane:
        return _MixLane([_SourceQueue() for _ in self.sources])

    def arrive(self, lane: int, st: _MixLane, chunk: SourceChunk) -> None:
        """Files ``chunk`` in its source's queue (its records become drawable once every
        earlier chunk of that source has come)."""
        queue = st.queues[chunk.source]
        where = f"{self.label}: lane {lane}, source {self.sources[chunk.source]!r}"
        queue.ready.extend(queue.chunks.put(chunk.number, chunk, where=where))

    def next(self, lane: int, st: _MixLane, step: int) -> tuple[str, Any]:
        """The lane's next record with outputs: ("record", (doc, outputs)); ("wait", None)
        until the drawn source's next chunk arrives; or how the lane's input stops (``END``,
        ``TRUNCATED``). Skipped records and records without outputs are consumed on the way."""
        policy = self._policy
        while True:
            if policy is None:
                chosen: int | None = 0
            else:
                chosen = policy.choose(self._seed, lane, st.position, step=step, exhausted=st.exhausted)
            if chosen is None:
                return END, None
            what, entry = st.queues[chosen].take()
            if what == "wait":
                return what, None
            if what == TRUNCATED:
                return self._truncated(lane, chosen), None
            if what == END:
                if policy is None or policy.exhausted != "renormalize":
                    return END, None
                st.exhausted = sorted({*st.exhausted, chosen})
                continue
            st.position += 1
            doc, result = entry
            if not isinstance(result, Skipped) and result:
                return "record", (doc, result)

    def _truncated(self, lane: int, source: int) -> str:
        if self._finite:
            raise DataError(
                f"{self.label}: lane {lane} drew past the {self._passes} pass(es) read of the "
                f"endless source {self.sources[source]!r} before its finite input ended; read "
                f"more passes (zephon materialize --passes)"
            )
        return TRUNCATED


class MixStage(beam.DoFn):  # type: ignore[misc]
    """``(lane, SourceChunk) -> (lane, Piece)``: the mix of constant weights, its own stage:
    each arriving chunk lets the lane draw as far as the chunks it has allow."""

    MIX = ReadModifyWriteStateSpec("zephon_mix", PickleCoder())

    def __init__(self, draw: MixDraw) -> None:
        super().__init__()
        self._draw = draw

    def setup(self) -> None:
        self._draw.setup()

    def process(
        self, element: tuple[int, SourceChunk], mix: Any = beam.DoFn.StateParam(MIX)
    ) -> Iterator[tuple[int, Piece]]:
        lane, chunk = element
        st: _MixLane | None = mix.read()
        if st is None:
            st = self._draw.fresh()
        if not st.stopped:  # once stopped, what is left of the other sources is never drawn
            self._draw.arrive(lane, st, chunk)
            items: list[tuple[Any, DocId | None]] = []
            while True:
                what, record = self._draw.next(lane, st, 0)  # constant weights: any step
                if what != "record":
                    break
                doc, outputs = record
                items.extend((value, doc) for value in outputs)
            stop = None if what == "wait" else what
            if items or stop:
                yield lane, Piece(st.emitted, items, stop)
                st.emitted += 1
            mix.write(_MixLane([], stopped=True) if stop else st)


# -- stateless and stateful DoFns -----------------------------------------------------


class StatelessStage(beam.DoFn):  # type: ignore[misc]
    """``(lane, Piece) -> (lane, Piece)``: a stateless DoFn after the first stateful one, on each
    item; keeps the piece's number, so it needs no order and runs anywhere."""

    def __init__(self, invoker: StatelessInvoker) -> None:
        super().__init__()
        self._invoker = invoker

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
