"""The parameter markers a DoFn declares to receive what the runner owns (its seed, provenance).

They live below both operators and runners: an operator declares ``seed=zf.SeedParam`` without
importing the runner, and the runner recognises the markers when it binds a DoFn's arguments.
"""

from __future__ import annotations

from typing import Any

from zephon_flow.core.errors import SpecError


class _SeedParam:
    """Default-value marker: the runner passes the DoFn's seed (spec seed mixed with its label)."""

    def __repr__(self) -> str:
        return "zephon_flow.SeedParam"


#: Declare ``seed=zf.SeedParam`` in a stateful DoFn's ``process`` to receive its seed.
SeedParam: Any = _SeedParam()


def resolve_seed(seed: Any, dofn: Any) -> int:
    """The seed a DoFn that declared ``seed=zf.SeedParam`` was given, on any runner.

    zephon-flow's runner and its Beam translation pass an int (the spec's seed mixed with the
    transform's label). A Beam runner calling the DoFn directly passes the marker itself,
    which resolves to the DoFn's own ``seed`` attribute (``Shuffle(buffer, seed=7)``); without
    one it is refused, naming the DoFn and both ways out.
    """
    if not isinstance(seed, _SeedParam):
        return int(seed)
    own = getattr(dofn, "seed", None)
    if isinstance(own, int) and not isinstance(own, bool):
        return own
    raise SpecError(
        f"{type(dofn).__name__}: zf.SeedParam has no seed on this runner (a Beam runner calling "
        f"the DoFn directly); construct it with seed=<int>, or run the pipeline through "
        f"zephon materialize / GlobalBatches, which give every stateful DoFn its seed"
    )


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
