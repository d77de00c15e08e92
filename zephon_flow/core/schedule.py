"""Global batch size schedules: the size of global batch ``step``, and each lane's share of it."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zephon_flow.core.errors import SpecError
from zephon_flow.core.options import check_int


def _positive(name: str, value: object) -> int:
    check_int(value, name)
    assert isinstance(value, int)
    return value


@dataclass(frozen=True, kw_only=True)
class Ramp:
    """A linear ramp of the global batch size from ``start`` to ``stop`` over ``steps`` steps.

    The size moves in steps of ``increment`` (default ``start``, so that every size is a
    multiple of ``start``: whatever lane count and world size divide ``start`` divide every
    size): step ``s < steps`` has ``start + increment * floor(s * n / steps)`` rows, where
    ``n = (stop - start) / increment``, and every step from ``steps`` on has ``stop``. So
    ``Ramp(start=64, stop=1024, steps=2000)`` grows by 64 rows every 133 or 134 steps and
    reaches 1,024 at step 2,000. Placed in a ``BatchSchedule`` at step ``k``, it starts there.
    """

    start: int
    stop: int
    steps: int
    increment: int | None = None

    def __post_init__(self) -> None:
        start, stop = _positive("Ramp start", self.start), _positive("Ramp stop", self.stop)
        _positive("Ramp steps", self.steps)
        increment = _positive("Ramp increment", start if self.increment is None else self.increment)
        if stop < start:
            raise SpecError(
                f"Ramp(start={start}, stop={stop}): a ramp grows; for a smaller size later, give the "
                f"sizes step by step: zf.BatchSchedule({{0: {start}, STEP: {stop}}})"
            )
        if (stop - start) % increment:
            raise SpecError(
                f"Ramp(start={start}, stop={stop}, increment={increment}): stop - start = {stop - start} "
                f"is not a multiple of the increment"
            )

    def changes(self) -> list[tuple[int, int]]:
        """``(step, size)`` where the size changes, from the ramp's own step 0."""
        increment = self.start if self.increment is None else self.increment
        n = (self.stop - self.start) // increment
        if n == 0:
            return [(0, self.start)]
        # Level k starts at the first step s with floor(s * n / steps) == k: ceil(k * steps / n).
        at: dict[int, int] = {}
        for k in range(n + 1):
            at[-(-k * self.steps // n)] = self.start + k * increment  # a later level wins a step
        return sorted(at.items())


Piece = int | Ramp


@dataclass(frozen=True, init=False)
class BatchSchedule:
    """The global batch size by step: ``pieces`` maps a step to the size (an int, or a ``Ramp``
    that starts there) used from that step until the next piece's step.

    ``BatchSchedule({0: 64, 500: 128, 2000: 256})``, ``BatchSchedule(Ramp(start=64, stop=1024,
    steps=2000))``, or both: ``BatchSchedule({0: Ramp(...), 5000: 2048})``. The first piece
    is at step 0. A frozen value: ``LoaderSpec(global_batch_size=...)`` takes it (or a
    ``Ramp``, or an int), checks that every size is a multiple of the lanes, and its
    fingerprint covers the sizes (``to_plain``), not how they were written.
    """

    pieces: tuple[tuple[int, Piece], ...]
    _changes: tuple[tuple[int, int], ...] = field(compare=False, repr=False)
    _starts: tuple[int, ...] = field(compare=False, repr=False)

    def __init__(self, pieces: Mapping[int, Piece] | Piece) -> None:
        given = {0: pieces} if isinstance(pieces, int | Ramp) else pieces
        if not isinstance(given, Mapping) or not given:
            raise SpecError(
                f"BatchSchedule takes a mapping step -> size (or Ramp), a Ramp or an int, got {pieces!r}"
            )
        items: list[tuple[int, Piece]] = []
        for step, piece in sorted(given.items(), key=lambda kv: kv[0] if isinstance(kv[0], int) else -1):
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise SpecError(f"BatchSchedule: a step must be a non-negative integer, got {step!r}")
            if not isinstance(piece, Ramp):
                _positive(f"BatchSchedule: the size at step {step}", piece)
            items.append((step, piece))
        if items[0][0] != 0:
            raise SpecError(
                f"BatchSchedule: the first size must be at step 0, the first given is at step {items[0][0]}"
            )
        changes: list[tuple[int, int]] = []
        for i, (step, piece) in enumerate(items):
            end = items[i + 1][0] if i + 1 < len(items) else None
            for rel, size in [(0, piece)] if isinstance(piece, int) else piece.changes():
                inside = end is None or step + rel < end
                if inside and (not changes or changes[-1][1] != size):
                    changes.append((step + rel, size))
        object.__setattr__(self, "pieces", tuple(items))
        object.__setattr__(self, "_changes", tuple(changes))
        object.__setattr__(self, "_starts", tuple(s for s, _ in changes))

    @property
    def changes(self) -> tuple[tuple[int, int], ...]:
        """``(step, size)`` at step 0 and at every step where the size changes."""
        return self._changes

    @property
    def constant(self) -> int | None:
        """The size if it never changes, else None."""
        return self._changes[0][1] if len(self._changes) == 1 else None

    def size(self, step: int) -> int:
        """The number of rows of global batch ``step``."""
        return self._changes[bisect.bisect_right(self._starts, step) - 1][1]

    def sizes_from(self, step: int) -> list[tuple[int, int]]:
        """``(step, size)`` at ``step`` and at every later change."""
        i = bisect.bisect_right(self._starts, step)
        return [(step, self._changes[i - 1][1]), *self._changes[i:]]

    def rows_before(self, step: int) -> int:
        """Rows of the global batches before ``step`` (a lane made ``rows_before(step) / lanes``
        outputs before its window ``step``)."""
        total, i = 0, 0
        while i < len(self._changes) and self._changes[i][0] < step:
            end = self._changes[i + 1][0] if i + 1 < len(self._changes) else step
            total += (min(end, step) - self._changes[i][0]) * self._changes[i][1]
            i += 1
        return total

    def check_lanes(self, lanes: int) -> None:
        """Refuses a size that is not a multiple of ``lanes``, naming its step."""
        for step, size in self._changes:
            if size % lanes:
                raise SpecError(
                    f"global_batch_size: the size at step {step} is {size}, not a multiple of "
                    f"lanes={lanes}: every lane contributes size/lanes samples to each batch; "
                    f"choose a size such as {lanes * max(1, size // lanes)} there"
                )

    def check_world_size(self, world_size: int, *, from_step: int = 0) -> None:
        """Refuses a world size that does not divide the size of some step from ``from_step``
        on (the steps a rank takes), naming the first such step and its size."""
        for step, size in self.sizes_from(from_step):
            if size % world_size:
                raise SpecError(
                    f"world_size={world_size} does not divide the global batch size {size} of step "
                    f"{step} (global_batch_size={self!r}): every rank must get the same number of "
                    f"rows at every step it takes; choose a world size that divides every size from "
                    f"step {from_step} on"
                )

    def to_plain(self) -> int | list[list[int]]:
        """Plain data for the fingerprint: the size if constant (the same as an int
        ``global_batch_size``, whose stream it is), else ``[[step, size], ...]`` at every change."""
        constant = self.constant
        return constant if constant is not None else [[s, n] for s, n in self._changes]

    def __repr__(self) -> str:
        if len(self.pieces) == 1:
            return f"BatchSchedule({self.pieces[0][1]!r})"
        return f"BatchSchedule({dict(self.pieces)!r})"


def as_schedule(value: Any) -> BatchSchedule:
    """``global_batch_size`` as a ``BatchSchedule`` (an int is the constant schedule)."""
    if isinstance(value, BatchSchedule):
        return value
    if isinstance(value, bool) or not isinstance(value, int | Ramp | Mapping):
        raise SpecError(
            f"global_batch_size must be a positive integer, a zf.Ramp or a zf.BatchSchedule, got {value!r}"
        )
    if isinstance(value, int) and value < 1:
        raise SpecError(f"global_batch_size must be a positive integer, got {value!r}")
    return BatchSchedule(value)


@dataclass(frozen=True)
class WindowLengths:
    """Each lane's window length by step under ``schedule`` with ``lanes`` lanes (a picklable
    callable, for runners that cut a lane's outputs into windows): ``self(step)`` is
    ``size(step) / lanes``; ``step_of(n)`` is the step whose window holds the lane's output
    ``n`` (counted from 0)."""

    schedule: BatchSchedule
    lanes: int
    _outputs: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        changes, before, outputs = self.schedule.changes, 0, []
        for i, (step, size) in enumerate(changes):  # a lane's outputs before each change
            outputs.append(before)
            if i + 1 < len(changes):
                before += (changes[i + 1][0] - step) * (size // self.lanes)
        object.__setattr__(self, "_outputs", tuple(outputs))

    def __call__(self, step: int) -> int:
        return self.schedule.size(step) // self.lanes

    def step_of(self, n: int) -> int:
        i = bisect.bisect_right(self._outputs, n) - 1
        step, size = self.schedule.changes[i]
        return step + (n - self._outputs[i]) // (size // self.lanes)


def window_length(per_lane: int | WindowLengths, step: int) -> int:
    """A lane's window length at ``step``: ``per_lane`` itself for a fixed size."""
    return per_lane if isinstance(per_lane, int) else per_lane(step)


def window_step(per_lane: int | WindowLengths, n: int) -> int:
    """The step whose window holds a lane's output ``n``: ``n // per_lane`` for a fixed size."""
    return n // per_lane if isinstance(per_lane, int) else per_lane.step_of(n)
