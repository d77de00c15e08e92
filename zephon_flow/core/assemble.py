"""Rows of a global batch from its lanes' windows: concatenated in lane order, and, in a finite
pass, padded to full windows with ``valid`` saying which rows are real.

The one assembly of every way of running lanes: the embedded ``Loader`` and ``zephon serve``
(through the engine), a lane owner's share of a rank's rows, and the Beam translation's
``AssembleStep``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon_flow.core.batches import Batch, SampleLayout, stack, with_valid
from zephon_flow.core.errors import StageError


def assemble_rows(
    step: int,
    windows: list[list[Any]],
    layouts: list[tuple[int, SampleLayout | None]],
    *,
    rows: slice,
    per_lane: int,
    finite: bool,
    padding: Any,
) -> Batch:
    """Rows ``rows`` of the concatenated ``windows`` (consecutive lanes, in lane order) of
    global batch ``step``; ``layouts`` are those lanes' ``(lane, first sample's layout)``. A
    finite pass's lanes are padded to full windows (with ``padding``, the pipeline's declared
    padding sample, else zeros laid out like a real sample) and the batch says which rows are
    real (``valid``)."""
    where = f"global batch {step}"
    if not finite:
        return stack([s for w in windows for s in w][rows], where=where)
    samples: list[Any] = []
    valid = np.zeros(per_lane * len(windows), dtype=bool)
    for i, ((lane, layout), window) in enumerate(zip(layouts, windows, strict=True)):
        valid[i * per_lane : i * per_lane + len(window)] = True
        samples += window
        if len(window) < per_lane:
            pad = padding if padding is not None else _pad(lane, layout, windows, where)
            samples += [pad] * (per_lane - len(window))
    return with_valid(stack(samples[rows], where=where), valid[rows], where=where)


def step_exists(windows: Sequence[Sequence[Any]], *, per_lane: int, finite: bool) -> bool:
    """Whether global batch ``step`` exists as far as ``windows`` (its windows of the lanes at
    hand, ``per_lane`` outputs each when whole) tell: a finite pass goes on while some lane has
    a real sample, an endless one while every lane fills its window. The one test of every way
    of running lanes (the Loader, the lane owners, the Beam translation's ``AssembleStep``);
    ranks that do not run every lane agree on a finite pass's end through an ``EndSync``, and
    readers holding assembled rows ask ``core.batches.has_sample``."""
    if finite:
        return any(len(window) for window in windows)
    return all(len(window) == per_lane for window in windows)


def _pad(lane: int, layout: SampleLayout | None, windows: list[list[Any]], where: str) -> Any:
    """Zeros laid out like the lane's first sample, else like any real sample of this batch
    (the rows of one batch share a layout, so the bytes are the same whichever is used)."""
    if layout is None:
        layout = next((ly for w in windows if w for ly in [SampleLayout.of(w[0])] if ly), None)
    if layout is None:
        raise StageError(
            f"{where}: lane {lane} must be padded (its finite input has ended) but no "
            f"sample shows the layout to pad with; give the pipeline's last operator a "
            f"padding_sample() method returning one padding sample"
        )
    return layout.zeros()
