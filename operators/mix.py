"""``Mix``: interleave several sources by weight, deterministically per lane and position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import apache_beam as beam
import numpy as np

from zephon_flow.errors import SpecError
from zephon_flow.rng import draw_unit


class Mix(beam.PTransform):  # type: ignore[misc]
    """Mixes a tuple of PCollections: ``(web, code) | "mix" >> Mix(weights=[0.7, 0.3])``.

    In every lane, the source of the record at mix position ``i`` is drawn from the weights
    with randomness that is a pure function of (seed, lane, i): the mixture does not depend
    on timing, workers or ranks. Weights are normalised; when any source runs out of data
    (only with finite ``epochs``), the lane's stream ends. The inputs must come straight from
    sources, optionally through stateless DoFns.
    """

    def __init__(self, weights: Sequence[float], label: str | None = None) -> None:
        super().__init__(label)
        try:
            w = [float(x) for x in weights]
        except (TypeError, ValueError) as exc:
            raise SpecError(f"Mix: weights must be numbers, got {weights!r}") from exc
        if not w or any(not np.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
            raise SpecError(
                f"Mix: weights must be non-negative, finite and not all zero, got {list(weights)!r}"
            )
        self.weights = w
        total = sum(w)
        self._cumulative = np.cumsum([x / total for x in w])

    def params(self) -> dict[str, Any]:
        return {"weights": self.weights}

    def choose(self, seed: int, lane: int, position: int) -> int:
        u = draw_unit(seed, 0, lane, position)
        return min(int(np.searchsorted(self._cumulative, u, side="right")), len(self.weights) - 1)

    def expand(self, pcolls: Any) -> Any:
        inputs = tuple(pcolls)
        if len(inputs) != len(self.weights):
            raise SpecError(f"Mix: {len(self.weights)} weights for {len(inputs)} inputs")
        # On Beam's own runners: a plain union (Beam gives no order; zephon-flow's runner does).
        return inputs | "Union" >> beam.Flatten()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["pipeline"] = None
        return state
