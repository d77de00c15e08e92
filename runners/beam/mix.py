"""The mix on Beam: each lane's sources' chunks resequenced, the source of each position drawn.

Chunks of every source arrive in any order; per lane and source a ``Resequencer`` (in Beam
state) puts them back in read order, and ``MixDraw`` draws the source of each mix position as
the deterministic runner's lane feed does (``MixPolicy.choose`` at the same seed, lane,
position and step; a skipped record or one without outputs still takes its position; a source
that runs out stops the lane or, with ``exhausted="renormalize"``, leaves its mix).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

from zephon_flow.core.errors import DataError
from zephon_flow.core.markers import DocId
from zephon_flow.core.roles import MixOperator, MixPolicy
from zephon_flow.runners.beam.order import Resequencer
from zephon_flow.runners.beam.pieces import END, TRUNCATED, Piece, SourceChunk
from zephon_flow.runners.segment import Skipped


@dataclass
class SourceQueue:
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
class MixLane:
    """A lane's mix: per source queue, the mix position, exhausted sources, pieces emitted."""

    queues: list[SourceQueue]
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

    def fresh(self) -> MixLane:
        return MixLane([SourceQueue() for _ in self.sources])

    def arrive(self, lane: int, st: MixLane, chunk: SourceChunk) -> None:
        """Files ``chunk`` in its source's queue (its records become drawable once every
        earlier chunk of that source has come)."""
        queue = st.queues[chunk.source]
        where = f"{self.label}: lane {lane}, source {self.sources[chunk.source]!r}"
        queue.ready.extend(queue.chunks.put(chunk.number, chunk, where=where))

    def next(self, lane: int, st: MixLane, step: int) -> tuple[str, Any]:
        """The lane's next record with outputs: ("record", (doc, outputs)); ("wait", source)
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
                return what, chosen
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
        st: MixLane | None = mix.read()
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
            mix.write(MixLane([], stopped=True) if stop else st)
