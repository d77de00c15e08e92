"""Lane, window and rank-slice arithmetic: which rows of a global batch belong to whom."""

from __future__ import annotations

from dataclasses import dataclass

from zephon_flow.core.errors import SpecError


def check_batch_geometry(*, lanes: int, global_batch_size: int) -> None:
    """Refuses a lane count or global batch size that cannot form windows."""
    if not isinstance(lanes, int) or lanes < 1:
        raise SpecError(f"lanes must be a positive integer, got {lanes!r}")
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise SpecError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
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
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise SpecError(f"world_size must be a positive integer, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise SpecError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
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
