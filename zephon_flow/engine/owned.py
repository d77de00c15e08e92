"""Reading lane owners: the one loop by which a rank turns its owners' shares into its batches.

A rank whose lanes run on lane owners (``cluster/``) takes, for each step, its share of the
step's rows from each owner of its lanes, in lane order, and joins them. What carries the
shares is the reader's own: ``OwnedLoader`` asks the owners' Ray actors for runs of steps, and
``zf.Client(lane_owners=True)`` (``service/fanin.py``) keeps one gRPC stream per owner. Both are
a ``Carrier``; this module is what they share:

- the order: owners in lane order, steps one after the other from ``start``;
- the end of a finite pass (``OwnersEndSync``): a rank whose own rows have a real sample goes
  on, else it asks the owners whether any lane has one;
- the join of the shares (fields in the owners' order, which is the ``Loader``'s);
- telling the carrier each step taken, so that it reports the rank's progress (the owners'
  coordinator gathers snapshots from it, and the owners hold the run's slowest step).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np

from zephon_flow.core.batches import Batch, has_sample
from zephon_flow.engine.endsync import OwnersEndSync

#: How often (in steps) a reader of lane owners reports its step: the coordinator gathers the
#: owners' snapshots from the reports, and tells the owners the run's slowest step from them.
PROGRESS_EVERY = 8


class Carrier(Protocol):
    """How a rank's shares come from its lane owners."""

    def share(self, owner: int, step: int) -> Batch:
        """This rank's rows of ``step`` from owner ``owner`` (an owner lost on the way is
        replaced and asked again; what cannot be recovered is raised by name)."""
        ...

    def lives(self, step: int) -> Iterable[bool]:
        """Each owner's answer to whether its lanes have a real sample at ``step``, asked in
        turn (only while the ones before said no)."""
        ...

    def taken(self, step: int) -> None:
        """The rank has taken every step before ``step`` (reported as the carrier sees fit)."""
        ...


def join_shares(parts: Sequence[Batch]) -> Batch:
    """The rank's batch from its owners' shares, in lane order (fields in the first's order)."""
    if len(parts) == 1:
        return parts[0]
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def owned_batches(
    carrier: Carrier,
    owners: Sequence[int],
    start: int,
    *,
    finite: bool,
    stopped: threading.Event | None = None,
) -> Iterator[tuple[int, Batch]]:
    """``(step, batch)`` from ``start`` on, each batch joined from the shares of ``owners``
    (the owners of the rank's lanes, in lane order); ends where a finite pass ends."""
    end = OwnersEndSync(carrier.lives)
    stop = threading.Event() if stopped is None else stopped
    step = start
    while True:
        parts = [carrier.share(owner, step) for owner in owners]
        if finite and not end.any_rank(step, has_sample(parts), stop):
            return
        batch = join_shares(parts)
        step += 1
        carrier.taken(step)
        yield step - 1, batch
