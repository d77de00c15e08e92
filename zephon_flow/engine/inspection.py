"""``zephon inspect``: which documents made up the sequences of one step, with text excerpts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_flow.core.batches import COUNT_SUFFIX, Batch, split_ragged
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.errors import SpecError, StateError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.core.options import check_int
from zephon_flow.core.source import relative_name
from zephon_flow.engine.loader import Loader
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.runners.plan import Plan

#: Characters of decoded text shown per document.
EXCERPT_CHARS = 160


@dataclass(frozen=True, kw_only=True)
class DocumentView:
    """One document's part of one sequence."""

    source: str  # the source's label in the pipeline
    file: str  # relative to the source's glob root
    split: int
    offset: int  # the record's place in its split, as the source counts it (see Record.offset)
    tokens: int  # how many of the sequence's tokens are this document's
    excerpt: str


@dataclass(frozen=True, kw_only=True)
class SequenceView:
    row: int  # row in the global batch
    lane: int
    padding: int
    documents: tuple[DocumentView, ...]


def batch_at(
    spec: LoaderSpec,
    step: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    state: Any = None,
    backend: str = "inline",
    workers: int = 1,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> Batch:
    """Rank ``rank``'s slice of global batch ``step``, running from ``state`` when given;
    ``progress`` wraps the iteration over steps (the CLI's progress bar)."""
    check_int(step, "step", low=0)  # never reached: would run forever
    start = 0
    if state is not None:
        state = to_loader_state(state)
        start = state.step
        if start > step:
            raise StateError(
                f"the state resumes at step {start}, after the requested step {step}; use a state "
                f"from step {step} or earlier"
            )
    last = start - 1
    with Loader(spec, rank=rank, world_size=world_size, state=state, backend=backend, workers=workers) as ld:
        for last, batch in ld if progress is None else progress(ld):
            if last == step:
                return batch
    raise SpecError(f"the input ended before step {step} (the last step is {last})")


def inspect_step(
    spec: LoaderSpec,
    step: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    state: Any = None,
    backend: str = "inline",
    workers: int = 1,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
) -> list[SequenceView]:
    """Every sequence of rank ``rank``'s slice of step ``step``, with its documents."""
    batch = batch_at(
        spec,
        step,
        rank=rank,
        world_size=world_size,
        state=state,
        backend=backend,
        workers=workers,
        progress=progress,
    )
    if "documents" not in batch or "documents" + COUNT_SUFFIX not in batch:
        raise SpecError(
            "the pipeline's samples carry no provenance ('documents' field): pack with ops.Pack "
            "(provenance is on by default) or another packer that records documents"
        )
    plan = spec.compile()
    decode = _decoder(plan)
    rows = RankSlice(  # the step's size, under a batch size schedule
        rank=rank, world_size=world_size, lanes=spec.lanes, global_batch_size=spec.batch_size(step)
    )
    ids = batch.get("input_ids")
    segments = batch.get("segment_ids")
    views = []
    for i, docs in enumerate(split_ragged(batch)):
        row = rows.start + i
        seq_ids = None if ids is None else np.asarray(ids[i])
        seq_seg = None if segments is None else np.asarray(segments[i])
        views.append(
            SequenceView(
                row=row,
                lane=row // spec.per_lane_at(step),
                padding=0 if seq_seg is None else int(np.count_nonzero(seq_seg < 0)),
                documents=tuple(_documents(plan, spec.lanes, docs, seq_ids, seq_seg, decode)),
            )
        )
    return views


def _documents(
    plan: Plan,
    lanes: int,
    docs: np.ndarray,
    ids: np.ndarray | None,
    segments: np.ndarray | None,
    decode: Callable[[list[int]], str] | None,
) -> Iterator[DocumentView]:
    for j, (source_index, split_index, offset) in enumerate(docs.tolist()):
        sp = plan.sources[source_index]
        split = sp.source.splits(lanes)[split_index]
        tokens: list[int] = []
        if ids is not None and segments is not None:
            tokens = ids[segments == j].tolist()
        if decode is None:
            excerpt = "(the pipeline has no Tokenize to decode with)"
        elif not tokens:
            excerpt = ""
        else:
            excerpt = decode(tokens)
        yield DocumentView(
            source=sp.label,
            file=relative_name(split.path, sp.source.pattern),
            split=split_index,
            offset=offset,
            tokens=len(tokens),
            excerpt=excerpt,
        )


def _decoder(plan: Plan) -> Callable[[list[int]], str] | None:
    """Decodes ids with the first operator of the pipeline that says how (``token_decoder()``:
    ``ops.Tokenize``, ``ops.TokenizeField``), if any; ids an operator declares as placeholders
    (``placeholder_tokens()``: a multimodal packer's image tokens) are counted, not decoded."""
    stages = [*(s for sp in plan.sources for s in sp.chain), *plan.common, *plan.back]
    dofns = [stage.dofn for stage in stages]
    declared = next((d.token_decoder for d in dofns if callable(getattr(d, "token_decoder", None))), None)
    if declared is None:
        return None
    text_of: Callable[[list[int]], str] = declared()
    placeholders: set[int] = set()
    for d in dofns:
        if callable(getattr(d, "placeholder_tokens", None)):
            placeholders |= d.placeholder_tokens()

    def decode(tokens: list[int]) -> str:
        images = sum(1 for t in tokens if t in placeholders)
        text = text_of([t for t in tokens if t not in placeholders])
        return f"[{images} image tokens] {text}" if images else text

    return decode


def render(views: list[SequenceView], *, step: int, rank: int, world_size: int) -> str:
    """The human-readable report ``zephon inspect`` prints."""
    lines = [f"step {step}, rank {rank} of {world_size}: {len(views)} sequences"]
    for v in views:
        lines.append(
            f"sequence {v.row} (lane {v.lane}): {len(v.documents)} documents, {v.padding} pad tokens"
        )
        for j, d in enumerate(v.documents):
            text = " ".join(d.excerpt.split())
            if len(text) > EXCERPT_CHARS:
                text = text[: EXCERPT_CHARS - 3] + "..."
            lines.append(
                f"  [{j}] {d.source}: {d.file} split {d.split} offset {d.offset}, {d.tokens} tokens: {text!r}"
            )
    return "\n".join(lines)
