"""Progress bars whose rate and ETA leave out the start-up (the first step: workers, tokenizer, buffers)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

from tqdm import tqdm

T = TypeVar("T")


class Progress:
    """Wraps an iterable of steps in a tqdm bar that starts counting after the first step.

    The first step of a pipeline pays for starting workers, loading tokenizers and filling
    buffers (seconds, where later steps take milliseconds); a bar timed from the start would
    show a rate and an ETA that only hold for that step. Here the bar appears once the first
    step is in (``initial=1``, so tqdm times the remaining steps only) and ``startup`` holds
    the seconds the first step took. ``tokens_per_step`` adds a tokens/s figure over the same
    steps. ``enabled=None`` shows the bar only when ``file`` is a terminal.
    """

    def __init__(
        self,
        *,
        total: int,
        desc: str,
        unit: str = "step",
        file: IO[str] | None = None,
        enabled: bool | None = None,
        tokens_per_step: int | None = None,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.file = file if file is not None else sys.stderr
        self.enabled = enabled
        self.tokens_per_step = tokens_per_step
        self.startup = 0.0
        self.steady_seconds = 0.0
        self.count = 0

    def __call__(self, items: Iterable[T]) -> Iterator[T]:
        start = time.perf_counter()
        bar: tqdm | None = None
        steady = start
        try:
            for item in items:
                self.count += 1
                if bar is None:
                    self.startup = steady = time.perf_counter()
                    self.startup -= start
                    bar = tqdm(
                        total=self.total,
                        initial=1,
                        desc=self.desc,
                        unit=self.unit,
                        file=self.file,
                        disable=None if self.enabled is None else not self.enabled,
                        dynamic_ncols=True,
                        mininterval=0.5,
                    )
                else:
                    bar.update(1)
                    self.steady_seconds = time.perf_counter() - steady
                    if self.tokens_per_step and self.steady_seconds > 0:
                        rate = (self.count - 1) * self.tokens_per_step / self.steady_seconds
                        bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
                yield item
        finally:
            if bar is not None:
                bar.close()

    @property
    def steps_per_second(self) -> float:
        """Steps after the first, per second of their own time."""
        return (self.count - 1) / self.steady_seconds if self.steady_seconds > 0 else 0.0
