"""A source on Beam: each lane's dealt share read in order, in chunks, then decoded in parallel.

``ReadLane`` reads what ``runners/dealing.py`` deals to one lane, pass by pass, exactly as a
lane of the deterministic runner reads it (``SourceReader``: the same records, the same order,
the same provenance ids), and numbers its chunks. ``DecodeChunk`` runs the stateless front
(decode, the source's own stateless DoFns, the stateless DoFns after the mix) on a chunk; it is
stateless, so Beam may run chunks anywhere and in any order: the mix restores lane order.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import apache_beam as beam

from zephon_flow.core.checkpoint.state import SourceCursor
from zephon_flow.core.markers import DocId
from zephon_flow.core.source import Record, Source
from zephon_flow.runners.beam.pieces import END, TRUNCATED, KeyedChunk, SourceChunk
from zephon_flow.runners.segment import Chunk, Failure, FrontSegment, RecordResult, Skipped
from zephon_flow.runners.streams import CHUNK_BYTES, ReadSkip, SourceReader


class DealtRead(beam.PTransform):  # type: ignore[misc]
    """A source as a Beam ``PTransform``: ``pipeline | DealtRead(...)`` is every lane's dealt
    share, read in order in numbered chunks (``ReadLane``), then spread over the workers
    (``Reshuffle``) for the stateless front (``DecodeChunk``): ``(lane, SourceChunk)`` pairs
    in no particular order, typed so that Beam encodes the lane key deterministically."""

    def __init__(self, read: ReadLane, segment: FrontSegment, *, lanes: int) -> None:
        super().__init__()
        self._read, self._segment, self._lanes = read, segment, lanes

    def expand(self, pbegin: Any) -> Any:
        return (
            pbegin
            | "lanes" >> beam.Create(list(range(self._lanes))).with_output_types(int)
            | "read" >> beam.ParDo(self._read).with_output_types(KeyedChunk)
            | "spread" >> beam.Reshuffle()
            | "front" >> beam.ParDo(DecodeChunk(self._segment)).with_output_types(KeyedChunk)
        )


class ReadLane(beam.DoFn):  # type: ignore[misc]
    """``lane -> (lane, SourceChunk)``: source ``index``'s records for that lane, in order.

    A source with ``epochs=None`` is endless: it is read for ``passes`` passes and its last
    chunk says ``TRUNCATED``; a finite one is read to its end (``END``).
    """

    def __init__(
        self,
        source: Source,
        label: str,
        index: int,
        *,
        lanes: int,
        seed: int,
        passes: int,
        chunk_records: int,
    ) -> None:
        super().__init__()
        self._source, self._label, self._index = source, label, index
        self._lanes, self._seed, self._passes = lanes, seed, passes
        self._chunk_records = chunk_records

    def process(self, lane: int) -> Iterator[tuple[int, SourceChunk]]:
        for chunk in self.chunks(lane):
            yield lane, chunk

    def chunks(self, lane: int) -> Generator[SourceChunk, None, None]:
        """The lane's chunks of this source, read as they are asked for (a caller that stops
        asking stops the read); the last one carries ``END`` or ``TRUNCATED``."""
        reader = SourceReader(
            self._source,
            self._label,
            lane=lane,
            lanes=self._lanes,
            seed=self._seed,
            cursor=SourceCursor.first(),
        )
        endless = self._source.epochs is None
        entries: list[tuple[DocId | None, Any]] = []
        size = 0
        number = 0
        while (got := reader.next()) is not None and not (endless and reader.epoch >= self._passes):
            if isinstance(got, ReadSkip):
                entries.append((None, got.message))
            else:
                entries.append(((self._index, reader.split_index, got.offset), got))
                size += _payload_size(got)
            if len(entries) >= self._chunk_records or size >= CHUNK_BYTES:
                yield SourceChunk(self._index, number, entries, None)
                entries, size, number = [], 0, number + 1
        yield SourceChunk(self._index, number, entries, TRUNCATED if endless else END)


def _payload_size(record: Record) -> int:
    payload = record.payload
    if isinstance(payload, str | bytes):
        return len(payload)
    nbytes = getattr(payload, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else 1024


class DecodeChunk(beam.DoFn):  # type: ignore[misc]
    """``(lane, raw chunk) -> (lane, chunk of outputs)``: the stateless front, one call per chunk
    (so DoFns with zephon-flow's ``process_batch`` see whole chunks), errors named as the
    deterministic runner names them."""

    def __init__(self, segment: FrontSegment) -> None:
        super().__init__()
        self._segment = segment

    def teardown(self) -> None:
        self._segment.teardown()

    def process(self, element: tuple[int, SourceChunk]) -> Iterator[tuple[int, SourceChunk]]:
        lane, chunk = element
        yield lane, decode_chunk(self._segment, chunk)


def decode_chunk(segment: FrontSegment, chunk: SourceChunk) -> SourceChunk:
    """``chunk`` with each record's payload replaced by its outputs through the stateless front
    (a read error its source skips by a ``Skipped`` note)."""
    work: Chunk = [(chunk.source, payload) for doc, payload in chunk.entries if doc is not None]
    results = segment.run_chunk(work) if work else []
    if isinstance(results, Failure):
        results.reraise()
    outputs = iter(results)
    entries: list[tuple[DocId | None, RecordResult]] = [
        (doc, next(outputs) if doc is not None else Skipped(str(payload))) for doc, payload in chunk.entries
    ]
    return chunk._replace(entries=entries)
