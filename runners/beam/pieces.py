"""What flows between the stages of a translated pipeline: source chunks and lane pieces.

Every element is ``(lane, value)``. A source's read for one lane is cut into ``SourceChunk``s
numbered 0, 1, 2, ... in the lane's read order; from the mix on, a lane's stream is a run of
``Piece``s numbered by ``seq``, each stage turning piece ``seq`` of its input into piece ``seq``
of its output (possibly with no items), so numbers never have gaps and every ordered stage can
restore lane order with nothing but the next expected number. The last chunk and the last
piece of a lane carry how the lane's input stopped: ``END`` (its finite input ended: timers
that wait for the end fire) or ``TRUNCATED`` (an endless source was read for a bounded number
of passes: the stream is a prefix, and nothing that waits for an end may fire).
"""

from __future__ import annotations

import typing
from typing import Any, NamedTuple

from apache_beam import coders

from zephon_flow.core.markers import DocId

#: How a lane's stream stopped (on its last chunk or piece; None on every other one).
END = "end"
TRUNCATED = "truncated"


class SourceChunk(NamedTuple):
    """Chunk ``number`` of one source's records as one lane reads them (chunks numbered from 0).

    ``entries`` are ``(doc, payload)``: before the stateless front the payload is the raw
    ``Record`` (or, with ``doc`` None, the message of a read error its source skips); after it,
    the record's outputs (a list) or a ``Skipped`` note.
    """

    source: int
    number: int
    entries: list[tuple[DocId | None, Any]]
    stop: str | None


class Piece(NamedTuple):
    """Piece ``seq`` of a lane's stream: ``(value, doc)`` items in order (``doc`` None for
    outputs of timers), and on the lane's last piece how its input stopped."""

    seq: int
    items: list[tuple[Any, DocId | None]]
    stop: str | None


class LaneWindow(NamedTuple):
    """Lane ``lane``'s window of one step: its samples, and the layout of its first sample."""

    lane: int
    samples: list[Any]
    layout: Any  # SampleLayout | None


# Each travels as one pickle (protocol 5: numpy buffers copied whole), not field by field: Beam's
# default coder for ``Any`` would pickle every numpy array of every sample on its own.
for _kind in (SourceChunk, Piece, LaneWindow):
    coders.registry.register_coder(_kind, coders.PickleCoder)

#: The element types, ``(key, value)``, in the form Beam reads (``typing.Tuple``): the key, a
#: lane or a step, is an int, encoded deterministically.
KeyedChunk = typing.Tuple[int, SourceChunk]  # noqa: UP006
KeyedPiece = typing.Tuple[int, Piece]  # noqa: UP006
KeyedWindow = typing.Tuple[int, LaneWindow]  # noqa: UP006
