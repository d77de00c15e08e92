"""Balanced rank slices: which rows of a global batch each rank gets, so that a per-row cost is even.

The global batch is not touched: only the choice of rows per rank changes. ``balance_rows``
is the whole algorithm, a pure function of the rows' costs and the world size:

1. order the rows by cost, highest first, ties by row index (lowest first);
2. deal them in that order, each to the rank whose rows cost least so far among the ranks
   that still have room (every rank takes exactly ``B / W`` rows, so tensors stack), ties by
   rank (lowest first): greedy longest-processing-time-first (LPT) with a cardinality bound;
3. then, at most ``2 * W`` times, the costliest rank (the lowest of equals) swaps one of its
   rows with one row of another rank: the swap that gives the lowest larger cost of the two
   ranks (ties: the first by rank, then by its own row, then by the other's row in cost
   order), taken only if that is below the costliest rank's cost; no such swap ends it. This mends LPT where few rows per rank are left to
   even out the last ones (at ``W = 32`` with 16 rows per rank, on the vision-language costs
   of ``bench/rank_balance.py``: max/mean 1.08 after step 2, 1.01 after step 3);
4. each rank's rows are put in ascending order of their global index.

Loads are float64 sums and differences taken in a fixed order, so the result is the same on
every machine and every run. A
cost is declared by the user (``RankBalance``): a named one read from the fields ``Pack`` and
``PackMultimodal`` output, or any function of one row.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from numbers import Real
from typing import Any

import numpy as np

from zephon_flow.core.batches import COUNT_SUFFIX, RAGGED_FIELDS, VALID_FIELD, Batch
from zephon_flow.core.errors import SpecError, StageError
from zephon_flow.core.options import check_int

#: The field a balanced rank's batch gains: the global index of each of its rows (int64).
ROWS_FIELD = "rows"
#: The named costs: real tokens, attention work (sum of squared segment lengths), images.
COSTS = ("tokens", "attention", "images")
#: A cost given as a function: one row (field -> that row's array) to a number >= 0.
RowCost = Callable[[Mapping[str, np.ndarray]], float]
_OPTION = "balance"


def _named_costs() -> str:
    return ", ".join(repr(c) for c in COSTS)


@dataclass(frozen=True, kw_only=True)
class RankBalance:
    """Gives each rank the rows of a global batch that balance ``cost`` across ranks.

    ``cost`` is one of:

    - ``"tokens"``: real tokens per row: ``segment_ids >= 0`` (``Pack``'s and
      ``PackMultimodal``'s padding is -1), else the sum of ``attention_mask``, else the size of
      ``input_ids``;
    - ``"attention"``: the sum, over the runs of equal ``segment_ids`` (the documents, or
      pieces of documents, of a packed row), of their squared lengths, padding excluded: the
      work of attention masked per document;
    - ``"images"``: ``image_count`` (``PackMultimodal``);
    - a function of one row (a mapping of field name to that row's array; ``documents`` holds
      that row's documents) returning a number >= 0.

    Rows of a finite pass's padding (``valid`` false) cost 0. Assignment: ``balance_rows``.
    """

    cost: str | RowCost

    def __post_init__(self) -> None:
        if isinstance(self.cost, str):
            if self.cost not in COSTS:
                raise SpecError(
                    f"{_OPTION} must be one of {_named_costs()} or a function of a row, got {self.cost!r}"
                )
        elif not callable(self.cost):
            raise SpecError(
                f"{_OPTION} must be one of {_named_costs()} or a function of a row, got {self.cost!r}"
            )

    @classmethod
    def of(cls, value: str | RowCost | RankBalance | None) -> RankBalance | None:
        """The balance an option value asks for (``None``: contiguous slices)."""
        if value is None or isinstance(value, RankBalance):
            return value
        return cls(cost=value)

    @property
    def name(self) -> str:
        """The cost's name (a function's qualified name)."""
        return (
            self.cost if isinstance(self.cost, str) else getattr(self.cost, "__qualname__", repr(self.cost))
        )

    def costs(self, batch: Mapping[str, np.ndarray], *, where: str = "the batch") -> np.ndarray:
        """The cost of each row of ``batch`` (float64 ``[B]``)."""
        return row_costs(batch, self.cost, where=where)

    def assign(
        self, batch: Mapping[str, np.ndarray], world_size: int, *, where: str = "the batch"
    ) -> np.ndarray:
        """Every rank's rows of ``batch``: int64 ``[world_size, B / world_size]``."""
        return balance_rows(self.costs(batch, where=where), world_size)

    def select(self, batch: Mapping[str, np.ndarray], rows: np.ndarray, *, where: str = "the batch") -> Batch:
        """``batch``'s rows ``rows`` (one rank's row of ``assign``), with ``rows`` as a field."""
        if ROWS_FIELD in batch:
            raise SpecError(
                f"{_OPTION}={self.name!r}: {where} already has a field {ROWS_FIELD!r}, the field a "
                f"balanced rank's batch gains (its rows' global indices); rename the pipeline's field"
            )
        out = take_rows(batch, rows)
        out[ROWS_FIELD] = np.asarray(rows, dtype=np.int64)
        return out


def balance_rows(costs: Any, world_size: int) -> np.ndarray:
    """Each rank's rows, given the cost of every row of a global batch: int64
    ``[world_size, B / world_size]``, rank ``r``'s rows (global indices, ascending) in row ``r``.

    Greedy LPT with equal row counts (see the module's docstring); a pure function of
    ``costs`` and ``world_size``."""
    values = np.asarray(costs, dtype=np.float64)
    if values.ndim != 1:
        raise SpecError(f"{_OPTION}: costs must be one number per row, got shape {list(values.shape)}")
    check_int(world_size, "world_size", owner=_OPTION)
    n = values.size
    if n % world_size:
        raise SpecError(
            f"{_OPTION}: a global batch of {n} rows cannot be shared by world_size={world_size}: "
            f"every rank must get the same number of rows"
        )
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    if bad.size:
        raise SpecError(
            f"{_OPTION}: row {int(bad[0])} costs {values[bad[0]]!r}; a cost must be finite and >= 0"
        )
    per = n // world_size
    order = np.lexsort((np.arange(n), -values))  # highest cost first, then lowest index
    heap = [(0.0, r) for r in range(world_size)]
    taken = [0] * world_size
    out = np.empty((world_size, per), dtype=np.int64)
    for i in order.tolist():
        load, r = heapq.heappop(heap)
        out[r, taken[r]] = i
        taken[r] += 1
        if taken[r] < per:
            heapq.heappush(heap, (load + float(values[i]), r))
    if world_size > 1:
        _swap_down(values, out, rounds=2 * world_size)
    out.sort(axis=1)
    return out


def _swap_down(values: np.ndarray, out: np.ndarray, *, rounds: int) -> None:
    """Step 3 of the module's algorithm, in place on ``out`` (``[W, B/W]`` row indices).

    For a row ``a`` of the costliest rank and another rank ``r``, the larger new cost
    ``max(top + b - a, load_r - b + a)`` is least for the ``b`` of ``r`` nearest ``a - (top -
    load_r) / 2``: only the two rows of ``r`` around it (in cost order) are looked at, so a
    round takes O(B log B) time and O(B) memory."""
    ranks = np.arange(out.shape[0])
    loads = values[out].sum(axis=1)
    for _ in range(rounds):
        top = int(np.argmax(loads))
        others = ranks[ranks != top]
        mine = values[out[top]]  # [per]
        order = np.argsort(values[out[others]], axis=1, kind="stable")  # [W-1, per]
        theirs = np.take_along_axis(values[out[others]], order, axis=1)  # each rank's, ascending
        target = mine[None, :] - (loads[top] - loads[others])[:, None] / 2  # [W-1, per]
        near = np.stack([np.searchsorted(t, g) for t, g in zip(theirs, target, strict=True)])
        picks = np.stack([near - 1, near], axis=2).clip(0, out.shape[1] - 1)  # [W-1, per, 2]
        b = np.take_along_axis(theirs, picks.reshape(len(others), -1), axis=1).reshape(picks.shape)
        gain = b - mine[None, :, None]
        worst = np.maximum(loads[top] + gain, loads[others][:, None, None] - gain)
        best = int(np.argmin(worst))
        if not worst.flat[best] < loads[top]:
            return
        k, i, side = np.unravel_index(best, worst.shape)
        other = int(others[k])
        j = int(order[k, picks[k, i, side]])
        row_a, row_b = int(out[top, i]), int(out[other, j])
        out[top, i], out[other, j] = row_b, row_a
        loads[top] += values[row_b] - values[row_a]
        loads[other] += values[row_a] - values[row_b]


def contiguous_rows(rows: int, world_size: int) -> np.ndarray:
    """The default slices, as ``balance_rows`` gives its answer: rank ``r`` holds
    ``[r*B/W, (r+1)*B/W)``."""
    return np.arange(rows, dtype=np.int64).reshape(world_size, rows // world_size)


def row_costs(
    batch: Mapping[str, np.ndarray], cost: str | RowCost, *, where: str = "the batch"
) -> np.ndarray:
    """The cost of each row of a stacked ``batch`` (float64 ``[B]``), by ``cost`` as
    ``RankBalance`` reads it; rows with ``valid`` false cost 0."""
    rows = _row_count(batch, where)
    if isinstance(cost, str):
        values = _named_cost(batch, cost, rows, where)
    else:
        values = np.array(
            [_call(cost, row, i, where) for i, row in enumerate(_each_row(batch, rows))], dtype=np.float64
        )
    if VALID_FIELD in batch:
        values = np.where(np.asarray(batch[VALID_FIELD], dtype=bool).reshape(rows), values, 0.0)
    return values


def _row_count(batch: Mapping[str, np.ndarray], where: str) -> int:
    counts = {len(v) for k, v in batch.items() if k not in RAGGED_FIELDS}
    if len(counts) != 1:
        raise SpecError(f"{_OPTION}: {where} has fields of different lengths; cannot tell its rows")
    return counts.pop()


def _named_cost(batch: Mapping[str, np.ndarray], cost: str, rows: int, where: str) -> np.ndarray:
    def missing(wanted: str) -> SpecError:
        return SpecError(
            f"{_OPTION}={cost!r}: {where} has no {wanted} field (it has {', '.join(sorted(batch))}); "
            f"pass {_OPTION}= a function of a row that returns its cost"
        )

    if cost == "images":
        if "image_count" not in batch:
            raise missing("'image_count'")
        return np.asarray(batch["image_count"], dtype=np.float64).reshape(rows)
    if cost == "attention":
        if "segment_ids" not in batch:
            raise missing("'segment_ids'")
        return _attention(np.asarray(batch["segment_ids"]), cost, where)
    real: np.ndarray | None = None
    if "segment_ids" in batch:
        real = np.asarray(batch["segment_ids"]) >= 0
    elif "attention_mask" in batch:
        real = np.asarray(batch["attention_mask"]) != 0
    if real is not None:
        return np.asarray(real.reshape(rows, -1).sum(axis=1, dtype=np.int64), dtype=np.float64)
    if "input_ids" in batch:
        return np.full(rows, np.asarray(batch["input_ids"])[0].size, dtype=np.float64)
    raise missing("'segment_ids', 'attention_mask' or 'input_ids'")


def _attention(seg: np.ndarray, cost: str, where: str) -> np.ndarray:
    """Per row, the sum of the squared lengths of its runs of equal segment id (>= 0)."""
    if seg.ndim != 2:
        raise SpecError(
            f"{_OPTION}={cost!r}: {where}'s 'segment_ids' is {list(seg.shape)}, expected [rows, seq_len]"
        )
    rows, width = seg.shape
    if not width:
        return np.zeros(rows, dtype=np.float64)
    change = np.ones(seg.shape, dtype=bool)
    change[:, 1:] = seg[:, 1:] != seg[:, :-1]
    starts = np.flatnonzero(change)  # every row starts a run, so no run crosses rows
    lengths = np.diff(np.append(starts, seg.size)).astype(np.float64)
    real = seg.ravel()[starts] >= 0
    return np.bincount(starts[real] // width, weights=lengths[real] ** 2, minlength=rows)


def _each_row(batch: Mapping[str, np.ndarray], rows: int) -> Iterator[dict[str, np.ndarray]]:
    """The rows of a stacked batch: each field's row, a ragged field's own rows."""
    ends = {
        key: np.concatenate([[0], np.cumsum(np.asarray(batch[key + COUNT_SUFFIX], dtype=np.int64))])
        for key in RAGGED_FIELDS
        if key in batch
    }
    for i in range(rows):
        row = {k: v[i] for k, v in batch.items() if k not in ends}
        for key, e in ends.items():
            row[key] = batch[key][int(e[i]) : int(e[i + 1])]
        yield row


def _call(cost: RowCost, row: Mapping[str, np.ndarray], i: int, where: str) -> float:
    name = getattr(cost, "__qualname__", repr(cost))
    try:
        value = cost(row)
    except Exception as exc:
        raise StageError(
            f"{_OPTION}={name}: the cost function raised on row {i} of {where}: {exc!r}"
        ) from exc
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise SpecError(
            f"{_OPTION}={name}: the cost function returned {value!r} for row {i} of {where}; "
            f"it must return a finite number >= 0"
        )
    return float(value)


def take_rows(batch: Mapping[str, np.ndarray], rows: np.ndarray) -> Batch:
    """Rows ``rows`` (global indices) of a stacked batch, in that order: every field indexed by
    row, a ragged field (``documents``) by its ``_count`` so each row keeps its own documents."""
    index = np.asarray(rows, dtype=np.int64)
    out = {k: np.asarray(v)[index] for k, v in batch.items() if k not in RAGGED_FIELDS}
    for key in RAGGED_FIELDS:
        if key not in batch:
            continue
        counts = np.asarray(batch[key + COUNT_SUFFIX], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)])[index]
        lengths = counts[index]
        total = int(lengths.sum())
        offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        out[key] = np.asarray(batch[key])[offsets + np.arange(total, dtype=np.int64)]
    return out
