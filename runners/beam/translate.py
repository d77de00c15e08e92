"""Phases of the translation of a compiled ``Plan`` into a Beam pipeline that orders itself.

What cannot be ordered never reaches a plan: the deterministic runner refuses it when the
spec is compiled, naming the transform and why (``UnsupportedTransformError``), and every plan
it compiles is translated. ``translate`` lays the plan out on a ``beam.Pipeline``:

    read:      per source, DealtRead: Create(lanes) -> ReadLane (dealt, chunked) -> Reshuffle
               -> DecodeChunk
    mix:       Flatten -> MixStage (keyed by lane, resequencing)
    back:      per stage from the first stateful one: OrderedStage (stateful, resequencing)
               or StatelessStage; for a Mix with a schedule over steps, the mix and the back
               are one LaneStage (the draw needs the back's progress)
    assemble:  LaneWindows (keyed by lane, resequencing) -> GroupByKey(step) -> AssembleStep

With ``Translation.steps`` set, only global batches ``0 .. steps-1`` are wanted: read, mix and
back are one ``BoundedLane`` per lane (``Create(lanes) -> Reshuffle -> BoundedLane``), which
reads no further than the lane's windows of those steps need, then the same *assemble*. It
returns the PCollection of ``(step, global batch)``. Every keyed PCollection is typed
``Tuple[int, Any]`` so Beam encodes the lane key deterministically; values go through Beam's
pickling coders.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import apache_beam as beam

from zephon_flow.core.schedule import WindowLengths
from zephon_flow.runners.beam.bounded import BoundedLane
from zephon_flow.runners.beam.fused import BackStage, LaneStage
from zephon_flow.runners.beam.mix import MixDraw, MixStage
from zephon_flow.runners.beam.order import OrderedStage, StatelessStage
from zephon_flow.runners.beam.pieces import KeyedPiece, KeyedWindow
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
    element) from the read to the mix. ``steps``: when set, only global batches
    ``0 .. steps-1`` are made, and each lane reads only what they need (``bounded.py``).
    """

    lanes: int
    seed: int
    #: A lane's window length, or by step under a batch size schedule (``WindowLengths``).
    per_lane: int | WindowLengths
    passes: int = 1
    chunk_records: int = 64
    steps: int | None = None


def draws_at_step(plan: Plan) -> bool:
    """Whether the plan's mix may draw differently at different steps: a schedule of several
    points, or a mix other than ``ops.Mix`` (whose draw the translation cannot inspect)."""
    if plan.mixer is None:
        return False
    schedule = plan.mixer.params().get("schedule")
    return not isinstance(schedule, list) or len(schedule) > 1


def translate(plan: Plan, pipeline: beam.Pipeline, how: Translation) -> beam.PCollection:
    """Lays ``plan`` out on ``pipeline``; returns the PCollection of ``(step, global batch)``."""
    if how.steps is not None:
        return assemble_steps(plan, bounded_lanes(plan, pipeline, how, how.steps), how)
    return order_lanes(plan, read_sources(plan, pipeline, how), how)


def _reads(plan: Plan, how: Translation) -> list[ReadLane]:
    return [
        ReadLane(
            sp.source,
            sp.label,
            i,
            lanes=how.lanes,
            seed=how.seed,
            passes=how.passes,
            chunk_records=how.chunk_records,
        )
        for i, sp in enumerate(plan.sources)
    ]


def _draw(plan: Plan, how: Translation) -> MixDraw:
    return MixDraw(
        plan.mixer,
        label=plan.mix_label or plan.sources[0].label,
        seed=dofn_seed(how.seed, plan.mix_label or ""),
        sources=[sp.label for sp in plan.sources],
        finite=plan.finite,
        passes=how.passes,
    )


def _back(plan: Plan) -> list[BackStage]:
    return [(s.label, s.dofn, s.seed) if isinstance(s, StatefulInvoker) else s for s in plan.back]


def bounded_lanes(plan: Plan, pipeline: beam.Pipeline, how: Translation, steps: int) -> beam.PCollection:
    """Phases *read*, *mix* and *back* for global batches ``0 .. steps-1`` only: each lane's
    pieces, from a ``BoundedLane`` that reads no further than they need."""
    lane = BoundedLane(
        _reads(plan, how),
        plan.front_segment(),
        _draw(plan, how),
        _back(plan),
        per_lane=how.per_lane,
        steps=steps,
    )
    return (
        pipeline
        | "zephon/lanes" >> beam.Create(list(range(how.lanes))).with_output_types(int)
        | "zephon/spread" >> beam.Reshuffle()
        | "zephon/bounded" >> beam.ParDo(lane).with_output_types(KeyedPiece)
    )


def read_sources(plan: Plan, pipeline: beam.Pipeline, how: Translation) -> beam.PCollection:
    """Phase *read*: every source's chunks per lane, through the stateless front, as
    ``(lane, SourceChunk)`` in no particular order."""
    segment = plan.front_segment()
    fronts = [
        pipeline | f"zephon/{sp.label}" >> DealtRead(read, segment, lanes=how.lanes)
        for sp, read in zip(plan.sources, _reads(plan, how), strict=True)
    ]
    return fronts[0] if len(fronts) == 1 else tuple(fronts) | "zephon/sources" >> beam.Flatten()


def order_lanes(plan: Plan, chunks: beam.PCollection, how: Translation) -> beam.PCollection:
    """Phases *mix*, *back* and *assemble*: decoded chunks in any order to global batches."""
    draw = _draw(plan, how)
    if draws_at_step(plan):  # the draw needs the back's progress: one stage for both
        lane_stage = LaneStage(draw, _back(plan), per_lane=how.per_lane)
        pieces = chunks | "zephon/lanes" >> beam.ParDo(lane_stage).with_output_types(KeyedPiece)
    else:
        pieces = chunks | "zephon/mix" >> beam.ParDo(MixStage(draw)).with_output_types(KeyedPiece)
        for stage in plan.back:
            if isinstance(stage, StatefulInvoker):
                dofn: beam.DoFn = OrderedStage(stage.label, stage.dofn, seed=stage.seed)
            else:
                dofn = StatelessStage(stage)
            pieces = pieces | f"zephon/{stage.label}" >> beam.ParDo(dofn).with_output_types(KeyedPiece)
    return assemble_steps(plan, pieces, how)


def assemble_steps(plan: Plan, pieces: beam.PCollection, how: Translation) -> beam.PCollection:
    """Phase *assemble*: each lane's pieces cut into windows, each step's windows in lane order."""
    padding = plan.padding_sample() if plan.finite else None
    assemble = AssembleStep(lanes=how.lanes, per_lane=how.per_lane, finite=plan.finite, padding=padding)
    return (
        pieces
        | "zephon/windows" >> beam.ParDo(LaneWindows(how.per_lane)).with_output_types(KeyedWindow)
        | "zephon/by step" >> beam.GroupByKey()
        | "zephon/assemble" >> beam.ParDo(assemble).with_output_types(_Keyed)
    )
