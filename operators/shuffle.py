"""``Shuffle``: a bounded shuffle buffer whose every draw is a function of (seed, lane, position)."""

from __future__ import annotations

from typing import Any

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import (
    ReadModifyWriteStateSpec,
    TimeDomain,
    TimerSpec,
    on_timer,
)
from apache_beam.utils.timestamp import MAX_TIMESTAMP

from zephon_flow.core.errors import SpecError
from zephon_flow.core.markers import SeedParam, resolve_seed
from zephon_flow.core.rng import SHUFFLE_DRAIN, SHUFFLE_SWAP, draw_u64, generator


class Shuffle(beam.DoFn):  # type: ignore[misc]
    """Holds up to ``buffer`` elements per lane; once full, each new element takes the place
    of a randomly chosen one, which is emitted. At the end of a finite input the buffer is
    emitted in a seeded random order. The buffer is the lane state (it is checkpointed).

    ``seed`` is used only where a Beam runner calls this DoFn directly on ``(key, value)``
    pairs (zephon-flow's runners give it the spec's seed mixed with its label, ignoring this)."""

    BUFFER = ReadModifyWriteStateSpec("buffer", PickleCoder())
    DRAIN = TimerSpec("drain", TimeDomain.WATERMARK)
    #: Emits the elements it receives unchanged, so a padding sample declared upstream (e.g. by
    #: ``Pack``) still describes the samples after it.
    keeps_sample_layout = True
    #: State values that hold inputs to emit unchanged: recipe state stores them as their
    #: upstream operator's recipes (``core/recipe.py``).
    recipe_elements = ("buffer",)

    def __init__(self, buffer: int, *, seed: int | None = None) -> None:
        super().__init__()
        if not isinstance(buffer, int) or buffer < 1:
            raise SpecError(f"Shuffle: buffer must be a positive integer, got {buffer!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise SpecError(f"Shuffle: seed must be an integer or None, got {seed!r}")
        self.buffer = buffer
        self.seed = seed

    def params(self) -> dict[str, Any]:
        return {"buffer": self.buffer}

    def process(
        self,
        element: tuple[int, Any],
        position: Any = beam.DoFn.TimestampParam,
        items: Any = beam.DoFn.StateParam(BUFFER),
        drain: Any = beam.DoFn.TimerParam(DRAIN),
        seed: int = SeedParam,
    ) -> Any:
        lane, value = element
        held = items.read()
        if held is None:
            held = []
            drain.set(MAX_TIMESTAMP)
        if len(held) < self.buffer:
            held.append(value)
            items.write(held)
            return
        j = (
            draw_u64(resolve_seed(seed, self), SHUFFLE_SWAP, lane, int(position.micros // 1_000_000))
            % self.buffer
        )
        out, held[j] = held[j], value
        items.write(held)
        yield out

    @on_timer(DRAIN)
    def drain_all(
        self,
        key: Any = beam.DoFn.KeyParam,
        items: Any = beam.DoFn.StateParam(BUFFER),
        seed: int = SeedParam,
    ) -> Any:
        held = items.read() or []
        items.clear()
        for i in generator(resolve_seed(seed, self), SHUFFLE_DRAIN, key).permutation(len(held)):
            yield held[int(i)]
