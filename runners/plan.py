"""The compiled form of a pipeline graph: sources, the stateless front, the ordered back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zephon_flow.operators.mix import Mix
from zephon_flow.operators.splits import Source
from zephon_flow.runners.dofns import StatefulInvoker, StatelessInvoker
from zephon_flow.runners.segment import FrontSegment


@dataclass(frozen=True)
class SourcePlan:
    label: str
    source: Source
    chain: tuple[StatelessInvoker, ...]  # stateless DoFns between this source and the mix


@dataclass(frozen=True)
class Plan:
    """What one lane runs, in three phases.

    1. *feed*: records from ``sources``, each read ahead in chunks, interleaved by ``mixer``
       (drawn as the back consumes them);
    2. *front*: decode + stateless DoFns (``FrontSegment``), in parallel on a backend;
    3. *back*: ``back`` in order on the lane's thread, stateful DoFns seeing elements in
       sequence order, stateless ones between them run inline.
    """

    sources: tuple[SourcePlan, ...]
    mixer: Mix | None
    mix_label: str | None
    common: tuple[StatelessInvoker, ...]
    back: tuple[StatelessInvoker | StatefulInvoker, ...]
    output_label: str
    graph: tuple[tuple[str, str, tuple[str, ...]], ...]  # (label, type, input labels)
    params: tuple[tuple[str, Any], ...]  # (label, operator parameters)

    def front_segment(self) -> FrontSegment:
        return FrontSegment(
            [s.source for s in self.sources],
            [list(s.chain) for s in self.sources],
            list(self.common),
        )

    @property
    def stateful(self) -> tuple[StatefulInvoker, ...]:
        return tuple(s for s in self.back if isinstance(s, StatefulInvoker))
