"""Lane, window and rank-slice arithmetic: which rows of a global batch belong to whom."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from zephon_flow.core.errors import SpecError
from zephon_flow.core.options import check_int, check_rank
from zephon_flow.core.schedule import BatchSchedule


def check_batch_geometry(*, lanes: int, global_batch_size: int) -> None:
    """Refuses a lane count or global batch size that cannot form windows."""
    check_int(lanes, "lanes")
    check_int(global_batch_size, "global_batch_size")
    if global_batch_size % lanes:
        raise SpecError(
            f"global_batch_size={global_batch_size} is not a multiple of lanes={lanes}: "
            f"every lane contributes global_batch_size/lanes samples to each batch; "
            f"choose a batch size such as {lanes * max(1, global_batch_size // lanes)}"
        )


@dataclass(frozen=True, kw_only=True)
class RankSlice:
    """The rows ``[start, stop)`` of every global batch that one rank receives."""

    rank: int
    world_size: int
    lanes: int
    global_batch_size: int

    def __post_init__(self) -> None:
        check_batch_geometry(lanes=self.lanes, global_batch_size=self.global_batch_size)
        check_rank(self.rank, self.world_size)
        if self.global_batch_size % self.world_size:
            raise SpecError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"world_size={self.world_size}: every rank must get the same number of rows"
            )

    @property
    def per_lane(self) -> int:
        """Samples each lane contributes to one global batch (its window length)."""
        return self.global_batch_size // self.lanes

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def start(self) -> int:
        return self.rank * self.per_rank

    @property
    def stop(self) -> int:
        return self.start + self.per_rank

    @property
    def lane_ids(self) -> range:
        """The lanes whose windows intersect this rank's rows."""
        first = self.start // self.per_lane
        last = (self.stop - 1) // self.per_lane
        return range(first, last + 1)

    def rows_of_lanes(self) -> slice:
        """This rank's rows, relative to the concatenated windows of ``lane_ids``."""
        offset = self.lane_ids.start * self.per_lane
        return slice(self.start - offset, self.stop - offset)


def lanes_of_rank(*, rank: int, world_size: int, lanes: int) -> range:
    """The lanes under rank ``rank`` of ``world_size``'s rows, whatever the global batch size
    (any size divisible by ``lanes`` and ``world_size``): ``[floor(r*L/W), ceil((r+1)*L/W))``.
    So a rank runs the same lanes at every step of a batch size schedule."""
    return range(rank * lanes // world_size, -(-(rank + 1) * lanes // world_size))


@dataclass(frozen=True, kw_only=True)
class RankRows:
    """One rank's rows of every global batch under ``schedule``: at each step a ``RankSlice``
    of that step's size (``at(step)``), always on the same lanes (``lane_ids``).

    A fixed size is refused at once as ``RankSlice`` refuses it; for a schedule, the steps a
    rank takes are known once it knows where it starts: ``check_from(step)`` refuses a world
    size that does not divide the size of some step from there on, naming the step and size.
    """

    rank: int
    world_size: int
    lanes: int
    schedule: BatchSchedule

    def __post_init__(self) -> None:
        constant = self.schedule.constant
        if constant is not None:  # a fixed size: refused as it always was
            RankSlice(
                rank=self.rank, world_size=self.world_size, lanes=self.lanes, global_batch_size=constant
            )
        else:
            check_rank(self.rank, self.world_size)

    @property
    def lane_ids(self) -> range:
        """The lanes whose windows meet this rank's rows (the same at every step)."""
        return lanes_of_rank(rank=self.rank, world_size=self.world_size, lanes=self.lanes)

    def check_from(self, step: int) -> None:
        """Refuses a world size that does not divide the size of a step from ``step`` on."""
        self.schedule.check_world_size(self.world_size, from_step=step)

    def at(self, step: int) -> RankSlice:
        """This rank's rows of global batch ``step``."""
        return _slice(self.rank, self.world_size, self.lanes, self.schedule.size(step))


@functools.lru_cache(maxsize=256)
def _slice(rank: int, world_size: int, lanes: int, size: int) -> RankSlice:
    return RankSlice(rank=rank, world_size=world_size, lanes=lanes, global_batch_size=size)
