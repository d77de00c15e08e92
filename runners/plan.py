"""The compiled form of a pipeline graph: sources, the stateless front, the ordered back."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from zephon_flow.core.checkpoint.derived_fields import DerivedCodecs
from zephon_flow.core.checkpoint.packed_segments import BUILTIN
from zephon_flow.core.roles import MixOperator
from zephon_flow.core.source import Source
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
    mixer: MixOperator | None
    mix_label: str | None
    common: tuple[StatelessInvoker, ...]
    back: tuple[StatelessInvoker | StatefulInvoker, ...]
    output_label: str
    graph: tuple[tuple[str, str, tuple[str, ...]], ...]  # (label, type, input labels)
    params: tuple[tuple[str, Any], ...]  # (label, operator parameters)

    def for_executor(self) -> Plan:
        """This plan with the executor's own copy of each DoFn that has a lifecycle of its own
        (``start_bundle``, ``finish_bundle``, ``teardown``: see ``runners.dofns.Lifecycle``);
        the rest is shared. A loader runs one and calls ``teardown`` when it closes."""
        return replace(
            self,
            sources=tuple(replace(sp, chain=tuple(s.instance() for s in sp.chain)) for sp in self.sources),
            common=tuple(s.instance() for s in self.common),
            back=tuple(s.instance() for s in self.back),
        )

    def teardown(self) -> None:
        """``teardown()`` of every DoFn of this plan that was set up in this process."""
        for stage in (*(s for sp in self.sources for s in sp.chain), *self.common, *self.back):
            stage.teardown()

    def front_segment(self) -> FrontSegment:
        return FrontSegment(
            [s.source for s in self.sources],
            [list(s.chain) for s in self.sources],
            list(self.common),
        )

    @property
    def derived_codecs(self) -> DerivedCodecs:
        """The codecs of its checkpoints' derived fields: the format's own and those its
        operators declare (a DoFn's ``derived_fields``), in the graph's order."""
        stages = (*(s for sp in self.sources for s in sp.chain), *self.common, *self.back)
        return BUILTIN.with_fields(f for stage in stages for f in getattr(stage.dofn, "derived_fields", ()))

    @property
    def finite(self) -> bool:
        """Whether a lane's input can end (its source has a number of passes, or its Mix says
        it can end): its batches then carry ``valid`` and lanes that end early are padded."""
        finite = [sp.source.epochs is not None for sp in self.sources]
        return finite[0] if self.mixer is None else self.mixer.can_end(finite)

    def padding_sample(self) -> Any:
        """The padding sample an operator declares (``padding_sample()``) at the end of the chain
        after the mix, looking through operators that keep the layout (``keeps_sample_layout``);
        None when there is none (padding then copies the layout of real samples)."""
        for stage in reversed((*self.common, *self.back)):
            make = getattr(stage.dofn, "padding_sample", None)
            if callable(make):
                return make()
            if not getattr(stage.dofn, "keeps_sample_layout", False):
                return None
        return None

    @property
    def stateful(self) -> tuple[StatefulInvoker, ...]:
        return tuple(s for s in self.back if isinstance(s, StatefulInvoker))
