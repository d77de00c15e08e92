"""Phases of the translation of a compiled ``Plan`` into a Beam pipeline that orders itself.

``check_orderable`` refuses, up front and by name, what a Beam pipeline cannot reproduce;
``translate`` lays the plan out on a ``beam.Pipeline``:

    read:      per source, DealtRead: Create(lanes) -> ReadLane (dealt, chunked) -> Reshuffle
               -> DecodeChunk
    mix:       Flatten -> MixStage (keyed by lane, resequencing)
    back:      per stage from the first stateful one: OrderedStage (stateful, resequencing)
               or StatelessStage
    assemble:  LaneWindows (keyed by lane, resequencing) -> GroupByKey(step) -> AssembleStep

and returns the PCollection of ``(step, global batch)``. Every keyed PCollection is typed
``Tuple[int, Any]`` so Beam encodes the lane key deterministically; values go through Beam's
pickling coders.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import apache_beam as beam

from zephon_flow.core.errors import UnsupportedTransformError
from zephon_flow.runners.beam.order import MixDraw, MixStage, OrderedStage, StatelessStage
from zephon_flow.runners.beam.read import DealtRead, ReadLane
from zephon_flow.runners.beam.windows import AssembleStep, LaneWindows
from zephon_flow.runners.dofns import StatefulInvoker, dofn_seed
from zephon_flow.runners.plan import Plan

_Keyed = typing.Tuple[int, typing.Any]  # noqa: UP006 (Beam reads typing's form)


@dataclass(frozen=True, kw_only=True)
class Translation:
    """What the translation needs besides the plan: the spec's geometry, and how far to read.

    ``passes`` bounds the read of sources with ``epochs=None`` (endless): the translated
    pipeline yields the steps that these passes fill completely, bit for bit the first steps
    of the endless stream. ``chunk_records`` is how many records travel together (one Beam
    element) from the read to the mix.
    """

    lanes: int
    seed: int
    per_lane: int
    passes: int = 1
    chunk_records: int = 64


def check_orderable(plan: Plan) -> None:
    """Refuses what a translated pipeline cannot order, naming the transform and why."""
    if plan.mixer is not None and len(plan.mixer.params()["schedule"]) > 1:
        raise UnsupportedTransformError(
            f"transform {plan.mix_label!r} (Mix): a schedule over steps cannot be translated to "
            f"Beam: the lane draws each record at the step its ordered back has reached, a "
            f"feedback from the batches to the mix that Beam stages cannot carry; give constant "
            f"weights=[...], or run it with zf.Loader"
        )


def translate(plan: Plan, pipeline: beam.Pipeline, how: Translation) -> beam.PCollection:
    """Lays ``plan`` out on ``pipeline``; returns the PCollection of ``(step, global batch)``."""
    check_orderable(plan)
    return order_lanes(plan, read_sources(plan, pipeline, how), how)


def read_sources(plan: Plan, pipeline: beam.Pipeline, how: Translation) -> beam.PCollection:
    """Phase *read*: every source's chunks per lane, through the stateless front, as
    ``(lane, SourceChunk)`` in no particular order."""
    segment = plan.front_segment()
    fronts = []
    for i, sp in enumerate(plan.sources):
        read = ReadLane(
            sp.source,
            sp.label,
            i,
            lanes=how.lanes,
            seed=how.seed,
            passes=how.passes,
            chunk_records=how.chunk_records,
        )
        fronts.append(pipeline | f"zephon/{sp.label}" >> DealtRead(read, segment, lanes=how.lanes))
    return fronts[0] if len(fronts) == 1 else tuple(fronts) | "zephon/sources" >> beam.Flatten()


def order_lanes(plan: Plan, chunks: beam.PCollection, how: Translation) -> beam.PCollection:
    """Phases *mix*, *back* and *assemble*: decoded chunks in any order to global batches."""
    mix = MixStage(
        MixDraw(
            plan.mixer,
            label=plan.mix_label or plan.sources[0].label,
            seed=dofn_seed(how.seed, plan.mix_label or ""),
            sources=[sp.label for sp in plan.sources],
            finite=plan.finite,
            passes=how.passes,
        )
    )
    pieces = chunks | "zephon/mix" >> beam.ParDo(mix).with_output_types(_Keyed)
    for stage in plan.back:
        if isinstance(stage, StatefulInvoker):
            dofn: beam.DoFn = OrderedStage(stage.label, stage.dofn, seed=stage.seed)
        else:
            dofn = StatelessStage(stage)
        pieces = pieces | f"zephon/{stage.label}" >> beam.ParDo(dofn).with_output_types(_Keyed)
    padding = plan.padding_sample() if plan.finite else None
    assemble = AssembleStep(lanes=how.lanes, per_lane=how.per_lane, finite=plan.finite, padding=padding)
    return (
        pieces
        | "zephon/windows" >> beam.ParDo(LaneWindows(how.per_lane)).with_output_types(_Keyed)
        | "zephon/by step" >> beam.GroupByKey()
        | "zephon/assemble" >> beam.ParDo(assemble).with_output_types(_Keyed)
    )
