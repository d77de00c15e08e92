"""How fine a source's splits are: sized from the data's total and the lane count, cut at units."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

#: Bumped whenever the way sources cut their data changes; part of every source's ``params()``,
#: so a checkpoint written under another plan is refused by name.
PLAN_VERSION = 2
#: Splits per lane a plan aims for when the data is big enough: fine enough that dealing them
#: by weight gives every lane about the same share of a pass.
SPLITS_PER_LANE = 8


def target(total: int, lanes: int, minimum: int) -> int:
    """The size to aim for: the total shared by ``SPLITS_PER_LANE`` splits per lane, never less
    than ``minimum`` (splits smaller than that cost more in opening than they balance)."""
    per = max(1, lanes) * SPLITS_PER_LANE
    return max(minimum, 1, -(-total // per))


def ranges(bounds: Sequence[int], size: int, *, refine: bool) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges covering ``bounds[0]..bounds[-1]`` of about ``size`` each.

    ``bounds`` are the places a range may end (row-group or batch starts, seek points). With
    ``refine`` a unit longer than ``size`` is cut into equal pieces too (rows can be entered
    anywhere); without, it stays whole. Each range ends at the allowed place closest to
    ``size`` from its start.
    """
    cuts = list(bounds)
    if refine:
        cuts = [bounds[0]]
        for a, b in itertools.pairwise(bounds):
            k = max(1, -(-(b - a) // size))
            cuts.extend(a + i * (b - a) // k for i in range(1, k))
            cuts.append(b)
    out: list[tuple[int, int]] = []
    start, prev = cuts[0], cuts[0]
    for b in cuts[1:]:
        if b - start >= size:
            if prev > start and size - (prev - start) <= (b - start) - size:
                out.append((start, prev))
                start = prev
            if b - start >= size:
                out.append((start, b))
                start = b
        prev = b
    if start < cuts[-1]:
        if out and cuts[-1] - out[-1][0] <= size * 5 // 4:
            out[-1] = (out[-1][0], cuts[-1])
        else:
            out.append((start, cuts[-1]))
    return out
