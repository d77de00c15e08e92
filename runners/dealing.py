"""Dealing a source's splits to lanes, pass by pass: each record to exactly one lane, balanced.

For pass ``e`` the splits are permuted by a generator keyed by (seed, source, e) and laid end to
end on a line of length ``T`` (the sum of their costs). Lane ``l`` owns the stretch
``[l*T/L, (l+1)*T/L)`` and its midpoint ``(l + 1/2) * T/L``:

- a split that contains one or more lanes' midpoints goes to those lanes; when it holds more
  than one, they **share it by stride**: the ``j``-th of ``k`` sharing lanes keeps the records
  ``i`` of the split with ``i % k == j`` (the cost of sharing: each of them reads the whole
  split);
- a split that contains no midpoint goes to the lane whose stretch holds its own midpoint.

So within a pass every record reaches exactly one lane, once; every lane has at least one
share (its midpoint lies in some split); and a lane's load differs from ``T/L`` by at most
about the largest split's cost, so splits a few times finer than ``T/L`` keep the lanes within
a few tens of percent of the mean. A lane works through its shares of pass ``e`` in permuted
order and starts pass ``e + 1`` only after them. Everything is a pure function of the split
table's costs, the lane count, the seed and the source's label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from zephon_flow.core.rng import generator, stable_hash

#: Changes whenever the dealing rule changes: it is part of every source's fingerprint, so a
#: checkpoint written under another rule is refused by name.
DEALING_VERSION = 2


@dataclass(frozen=True)
class Share:
    """A lane's part of one split in one pass: split ``split``, records ``i % of == part``."""

    split: int
    of: int = 1
    part: int = 0

    def keeps(self, count: int) -> bool:
        """Whether the record numbered ``count`` (from 0) inside the split is this lane's."""
        return self.of == 1 or count % self.of == self.part


class Dealing:
    """The deal of one source's split table to ``lanes`` lanes, for every pass."""

    def __init__(self, costs: Sequence[int], *, lanes: int, seed: int, source: str) -> None:
        if not costs:
            raise ValueError("a dealing needs at least one split")
        if any(c < 1 for c in costs):
            raise ValueError("split costs must be positive")
        self._costs = np.asarray(costs, dtype=np.int64)
        self.lanes = lanes
        self._seed, self._salt = seed, stable_hash(source)

    @property
    def n_splits(self) -> int:
        return len(self._costs)

    def shares(self, lane: int, epoch: int) -> tuple[Share, ...]:
        """Lane ``lane``'s shares of pass ``epoch``, in the order it reads them."""
        return self._table(epoch)[lane]

    def lane_costs(self, epoch: int) -> list[float]:
        """Each lane's cost in pass ``epoch`` (a shared split counts ``cost / k`` per lane)."""
        costs = self._costs
        return [sum(costs[s.split] / s.of for s in shares) for shares in self._table(epoch)]

    def _table(self, epoch: int) -> tuple[tuple[Share, ...], ...]:
        return _deal(self._costs.tobytes(), self.lanes, self._seed, self._salt, epoch)


@lru_cache(maxsize=256)
def _deal(costs_bytes: bytes, lanes: int, seed: int, salt: int, epoch: int) -> tuple[tuple[Share, ...], ...]:
    costs = np.frombuffer(costs_bytes, dtype=np.int64)
    order = generator(seed, salt, epoch).permutation(len(costs))
    ends = np.cumsum(costs[order])  # split order[i] covers [ends[i] - cost, ends[i])
    starts = ends - costs[order]
    total = int(ends[-1])
    # Exact integer arithmetic on the line scaled by 2L: lane l's midpoint is (2l + 1) * T.
    mids = (2 * np.arange(lanes, dtype=np.int64) + 1) * total
    # The split holding each midpoint: the first whose scaled end lies beyond it.
    holder = np.searchsorted(2 * lanes * ends, mids, side="right")
    # Lanes whose midpoints each split holds: [first[i], first[i] + count[i]).
    first = np.searchsorted(holder, np.arange(len(costs)), side="left")
    count = np.searchsorted(holder, np.arange(len(costs)), side="right") - first
    # A split holding no midpoint goes to the lane whose stretch holds its own midpoint.
    own = np.minimum((starts + ends) * lanes // (2 * total), lanes - 1)
    table: list[list[Share]] = [[] for _ in range(lanes)]
    for i in range(len(costs)):
        split = int(order[i])
        k = int(count[i])
        if k == 0:
            table[int(own[i])].append(Share(split))
        else:
            for j in range(k):
                table[int(first[i]) + j].append(Share(split, k, j))
    return tuple(tuple(shares) for shares in table)
