"""The parameter markers a DoFn declares to receive what the runner owns (its seed, provenance).

They live below both operators and runners: an operator declares ``seed=zf.SeedParam`` without
importing the runner, and the runner recognises the markers when it binds a DoFn's arguments.
"""

from __future__ import annotations

from typing import Any


class _SeedParam:
    """Default-value marker: the runner passes the DoFn's seed (spec seed mixed with its label)."""

    def __repr__(self) -> str:
        return "zephon_flow.SeedParam"


#: Declare ``seed=zf.SeedParam`` in a stateful DoFn's ``process`` to receive its seed.
SeedParam: Any = _SeedParam()


class _ProvenanceParam:
    """Default-value marker: the runner passes the id of the source record the element came from."""

    def __repr__(self) -> str:
        return "zephon_flow.ProvenanceParam"


#: Declare ``doc=zf.ProvenanceParam`` in a stateful DoFn's ``process`` to receive the id of the
#: source record its element came from: ``(source index, split index, record offset)``, where the
#: source index counts the pipeline's sources in the order the runner lists them, the split index
#: is the source's split table entry and the offset is ``Record.offset``. Elements made by an
#: earlier stateful DoFn carry the id of the record whose arrival produced them; outputs of timers
#: carry none (``None``).
ProvenanceParam: Any = _ProvenanceParam()

#: The id ``ProvenanceParam`` passes: (source index, split index, record offset).
DocId = tuple[int, int, int]
