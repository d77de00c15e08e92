"""``Mix``: interleave several sources by weight or by a schedule over steps, per lane and position."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import apache_beam as beam
import numpy as np

from zephon_flow.core.errors import CorruptStateError, FingerprintMismatchError, SpecError
from zephon_flow.core.rng import MIX_DRAW, draw_unit
from zephon_flow.core.roles import MixOperator

#: How weights between two schedule points are found.
INTERPOLATIONS = ("constant", "linear")
#: What a lane does when a source with finite ``epochs`` runs out.
EXHAUSTED = ("stop", "renormalize")


class Mix(beam.PTransform):  # type: ignore[misc]
    """Mixes a tuple of PCollections: ``(web, code) | "mix" >> Mix(weights=[0.7, 0.3])``.

    In every lane, the source of the record at mix position ``i`` is drawn with a uniform
    ``u`` that is a pure function of (seed, lane, i): the mixture does not depend on timing,
    workers or ranks. Weights are normalised per point.

    **Schedules.** ``Mix(schedule=[(0, [0.7, 0.3]), (1000, [0.5, 0.5])])`` gives the weights
    from global step 0, then from step 1000 (steps strictly increasing, the first one 0).
    With ``interpolation="constant"`` a point's weights hold until the next point; with
    ``"linear"`` the (normalised) weights move linearly between points and hold after the
    last one. *The step is the lane's own*: a record is drawn when the lane's ordered back
    asks for it, and the step used is the window the lane is then filling (windows it has
    closed, plus its pending outputs over the window size). So a lane's mixture follows its
    own windows: a record drawn at step ``s`` enters batch ``s`` or, after buffering by a
    stateful DoFn such as ``Pack`` or ``Shuffle``, a later one.

    **Running out.** A source with finite ``epochs`` runs out in a lane when the draw picks
    it and it has no record left. ``exhausted="stop"`` (the default) then ends the lane's
    stream (and the loader's when the lane is needed). ``exhausted="renormalize"`` drops the
    source from that lane's mix: the same ``u`` is used again with the remaining sources'
    weights renormalised, and from then on that lane never draws the source again (the lane
    state records it). When no remaining source has weight at the lane's step, the lane ends.

    **Changing the mixture on resume.** ``zf.Loader(spec, state=..., allow_mix_change=True)``
    accepts a checkpoint whose pipeline differs only in this Mix's ``weights``, ``schedule``
    or ``interpolation``; the new schedule applies from the checkpoint's step on and the
    change is recorded in the state, so replays from later checkpoints repeat it.

    The inputs must come straight from sources, optionally through stateless DoFns.
    """

    #: How the deterministic runner knows this transform (``zephon_flow.core.roles``).
    zephon_role = "mix"

    def __init__(
        self,
        weights: Sequence[float] | None = None,
        *,
        schedule: Sequence[tuple[int, Sequence[float]]] | None = None,
        interpolation: str = "constant",
        exhausted: str = "stop",
        label: str | None = None,
    ) -> None:
        super().__init__(label)
        if (weights is None) == (schedule is None):
            raise SpecError("Mix: give either weights=[...] or schedule=[(step, weights), ...], not both")
        if interpolation not in INTERPOLATIONS:
            raise SpecError(f"Mix: interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        if exhausted not in EXHAUSTED:
            raise SpecError(f"Mix: exhausted must be one of {EXHAUSTED}, got {exhausted!r}")
        points = [(0, weights)] if weights is not None else _points(schedule)
        steps: list[int] = []
        rows: list[list[float]] = []
        for step, w in points:
            rows.append(_weights(w, "weights" if weights is not None else f"schedule weights at step {step}"))
            steps.append(step)
        if len({len(r) for r in rows}) != 1:
            raise SpecError(
                f"Mix: every schedule point needs as many weights, got lengths {[len(r) for r in rows]}"
            )
        self.steps = steps
        #: The weights as given (first point); kept for ``weights=`` users and error messages.
        self.weights = rows[0]
        self.schedule = [(s, r) for s, r in zip(steps, rows, strict=True)]
        self.interpolation = interpolation
        self.exhausted = exhausted
        self._normalised = np.array([np.asarray(r) / sum(r) for r in rows], dtype=np.float64)
        self._cumulatives = [tuple(float(x) for x in row) for row in np.cumsum(self._normalised, axis=1)]

    @property
    def n_inputs(self) -> int:
        return len(self.weights)

    def params(self) -> dict[str, Any]:
        return {
            "schedule": [[s, list(r)] for s, r in self.schedule],
            "interpolation": self.interpolation,
            "exhausted": self.exhausted,
        }

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Mix:
        """The Mix that ``params()`` describes (for mixture histories stored in checkpoints)."""
        return cls(
            schedule=[(int(s), [float(x) for x in w]) for s, w in params["schedule"]],
            interpolation=str(params["interpolation"]),
            exhausted=str(params["exhausted"]),
        )

    @classmethod
    def starting_at(
        cls,
        step: int,
        points: Sequence[tuple[int, Sequence[float]]],
        *,
        interpolation: str = "constant",
        exhausted: str = "stop",
    ) -> Mix:
        """The Mix an operator puts in force from global ``step`` on (``Mixture.change``):
        ``points`` are ``(step, weights)`` at absolute global steps, the first at ``step``
        (one point: those weights from then on). Between ``step`` and the next point the
        weights are the first point's, or move linearly to the next with ``"linear"``."""
        given = list(points)
        if not given:
            raise SpecError("Mix: a mixture change needs weights (at least one (step, weights) point)")
        first = given[0][0]
        if first != step:
            raise SpecError(
                f"Mix: a mixture change at step {step} starts with weights at that step, got its "
                f"first point at step {first!r}"
            )
        lead = [(0, given[0][1])] if step > 0 else []  # never in force: the change starts at step
        return cls(schedule=lead + given, interpolation=interpolation, exhausted=exhausted)

    def mixture(self) -> Mixture:
        """The mixture of a run that has used this Mix from step 0."""
        return Mixture.of(self)

    def can_end(self, finite: Sequence[bool]) -> bool:
        """Whether a lane's mixed input can end, given which inputs have finite ``epochs``:
        with ``"stop"``, once any finite input is drawn after it ran out; with
        ``"renormalize"``, once only finite inputs are left with weight (all are finite, or
        some schedule point gives every endless input weight 0)."""
        if self.exhausted == "stop":
            return any(finite)
        endless = [i for i, f in enumerate(finite) if not f]
        return not endless or any(all(row[i] == 0 for i in endless) for row in self._normalised)

    def weights_at(self, step: int) -> np.ndarray:
        """The normalised weights at global step ``step`` (a new array)."""
        i = _in_force(self.steps, step)
        if self.interpolation == "linear" and i + 1 < len(self.steps):
            s0, s1 = self.steps[i], self.steps[i + 1]
            t = (step - s0) / (s1 - s0)
            return np.asarray((1.0 - t) * self._normalised[i] + t * self._normalised[i + 1])
        return np.array(self._normalised[i])

    def cumulative_at(self, step: int, exhausted: Sequence[int] = ()) -> tuple[float, ...] | None:
        """Cumulative normalised weights at ``step`` without the ``exhausted`` sources, or None
        when none of the others has weight there."""
        if not exhausted and self.interpolation == "constant":
            return self._cumulatives[_in_force(self.steps, step)]
        w = self.weights_at(step)
        w[list(exhausted)] = 0.0
        total = float(w.sum())
        return None if total <= 0 else tuple(float(x) for x in np.cumsum(w / total))

    def expand(self, pcolls: Any) -> Any:
        inputs = tuple(pcolls)
        if len(inputs) != self.n_inputs:
            given = f"{self.n_inputs} weight{'s' if self.n_inputs != 1 else ''}"
            raise SpecError(
                f"Mix: {given} for {len(inputs)} inputs; give one weight per input, in their order"
            )
        # On Beam's own runners: a plain union (Beam gives no order; zephon-flow's runner does).
        return inputs | "Union" >> beam.Flatten()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["pipeline"] = None
        return state


class Mixture:
    """The one home of a run's mixing: which ``Mix`` applies at each global step, and the draw.

    ``entries`` is ``[(from_step, Mix), ...]`` from step 0: each entry's schedule is read at
    absolute global steps and applies from its ``from_step`` until the next entry's. The lane
    asks ``choose`` for the source of each record; the loader builds it with ``resume`` (fresh
    or from a checkpoint, possibly with a changed mixture), ``change`` puts a new one in force
    from a step on (on resume, or appended while running: ``zephon mix``), and the state stores
    ``history()`` (``LoaderState.mix_history``), whose entries may start after the state's step.
    """

    def __init__(self, entries: Sequence[tuple[int, Mix]]) -> None:
        if not entries or entries[0][0] != 0:
            raise SpecError("a mixture history starts at step 0")
        # (entries, their start steps), replaced whole by ``change``: a lane drawing meanwhile
        # reads one consistent pair.
        self._table: tuple[list[tuple[int, Mix]], list[int]] = (list(entries), [s for s, _ in entries])
        self.exhausted = entries[-1][1].exhausted
        # (step, exhausted sources) -> cumulative weights; lanes draw at few distinct steps.
        self._cumulative: dict[tuple[int, tuple[int, ...]], tuple[float, ...] | None] = {}

    @classmethod
    def of(cls, mix: Mix) -> Mixture:
        """A run that has used ``mix`` from step 0."""
        return cls([(0, mix)])

    @classmethod
    def from_history(cls, history: Sequence[tuple[int, Mapping[str, Any]]]) -> Mixture:
        """The mixture a checkpoint's ``mix_history`` describes; refuses a damaged one."""
        try:
            return cls([(int(step), Mix.from_params(dict(params))) for step, params in history])
        except (SpecError, KeyError, TypeError, ValueError) as exc:
            raise CorruptStateError(
                f"the checkpoint's mix_history {list(history)!r} is not valid: {exc}"
            ) from exc

    @classmethod
    def resume(
        cls, mix: MixOperator, stored: Sequence[tuple[int, Mapping[str, Any]]], step: int, *, changed: bool
    ) -> Mixture:
        """The mixture to continue a checkpoint of ``step`` with: its own history, plus ``mix``
        (the spec's) from ``step`` on when the mixture was changed on this resume."""
        if not stored or stored[0][0] != 0:
            raise CorruptStateError(f"the checkpoint's mix_history {list(stored)!r} does not start at step 0")
        mixture = cls.from_history(stored)  # refuses a damaged history by name
        if changed:
            new = mix.params()
            if mixture.exhausted != new["exhausted"]:
                raise FingerprintMismatchError(
                    f"Mix: exhausted={new['exhausted']!r} differs from the checkpoint's "
                    f"{mixture.exhausted!r}; only weights, schedule and interpolation may change on resume"
                )
            mixture.change(step, Mix.from_params(new))
        return mixture

    @property
    def entries(self) -> list[tuple[int, Mix]]:
        """``[(from_step, Mix), ...]`` in force now (a copy)."""
        return list(self._table[0])

    def change(self, step: int, mix: Mix) -> None:
        """Puts ``mix`` in force from global ``step`` on, in place of whatever was to apply from
        ``step`` on: a change on resume (from the checkpoint's step), or one an operator appends
        to a running loader. Whoever calls it makes sure no lane has drawn at ``step`` or later
        yet (the loader does, ``Loader.change_mixture``); draws at earlier steps, even while it
        runs, are the same before and after (the table is swapped in one assignment)."""
        self.check_change(mix)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise SpecError(f"Mix: a mixture change needs a step >= 0, got {step!r}")
        kept = [(s, m) for s, m in self._table[0] if s < step] + [(step, mix)]
        self._table = (kept, [s for s, _ in kept])

    def check_change(self, mix: Mix) -> None:
        """Refuses, naming why, a ``mix`` that ``change`` cannot put in force: another
        ``exhausted`` or another number of inputs."""
        entries = self._table[0]
        if mix.exhausted != self.exhausted:
            raise SpecError(
                f"Mix: exhausted={mix.exhausted!r} differs from the mixture's {self.exhausted!r}; "
                f"only weights, schedule and interpolation may change"
            )
        if mix.n_inputs != entries[-1][1].n_inputs:
            raise SpecError(
                f"Mix: the new mixture has {mix.n_inputs} weights, the pipeline's Mix has "
                f"{entries[-1][1].n_inputs} inputs; give one weight per input, in their order"
            )

    def history(self) -> list[tuple[int, dict[str, Any]]]:
        """``[(from_step, Mix params), ...]``: what a checkpoint stores."""
        return [(step, mix.params()) for step, mix in self._table[0]]

    def at(self, step: int) -> Mix:
        entries, starts = self._table
        return entries[_in_force(starts, step)][1]

    def choose(
        self, seed: int, lane: int, position: int, *, step: int, exhausted: Sequence[int] = ()
    ) -> int | None:
        """The source of lane ``lane``'s record at mix ``position``, drawn at global ``step``
        without the ``exhausted`` sources; None when none of the others has weight there."""
        key = (step, tuple(exhausted))
        if key not in self._cumulative:
            if len(self._cumulative) > 4096:
                self._cumulative.clear()
            self._cumulative[key] = self.at(step).cumulative_at(step, exhausted)
        cumulative = self._cumulative[key]
        if cumulative is None:
            return None
        return pick(draw_unit(seed, MIX_DRAW, lane, position), cumulative)


def _in_force(starts: Sequence[int], step: int) -> int:
    """The index of the last of ``starts`` (ascending steps, the first 0) at or before ``step``:
    the schedule point, or the mix, in force there."""
    return bisect.bisect_right(starts, step) - 1


def pick(u: float, cumulative: Sequence[float]) -> int:
    """The index whose cumulative-weight interval holds ``u``, never one of weight zero."""
    i = bisect.bisect_right(cumulative, u)
    if i >= len(cumulative):  # rounding: u at or past the last sum; take the last positive weight
        i = len(cumulative) - 1
        while i > 0 and cumulative[i] <= cumulative[i - 1]:
            i -= 1
    return i


def _points(schedule: Any) -> list[tuple[int, Any]]:
    try:
        points = [(step, w) for step, w in schedule]
    except (TypeError, ValueError) as exc:
        raise SpecError(f"Mix: schedule must be a list of (step, weights) pairs, got {schedule!r}") from exc
    if not points:
        raise SpecError("Mix: schedule needs at least one (step, weights) point")
    steps = [s for s, _ in points]
    if any(not isinstance(s, int) or isinstance(s, bool) for s in steps):
        raise SpecError(f"Mix: schedule steps must be integers, got {steps!r}")
    if steps[0] != 0 or any(b <= a for a, b in itertools.pairwise(steps)):
        raise SpecError(f"Mix: schedule steps must start at 0 and strictly increase, got {steps!r}")
    return points


def _weights(weights: Any, what: str) -> list[float]:
    try:
        w = [float(x) for x in weights]
    except (TypeError, ValueError) as exc:
        raise SpecError(f"Mix: {what} must be numbers, got {weights!r}") from exc
    if not w or any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise SpecError(f"Mix: {what} must be non-negative, finite and not all zero, got {list(weights)!r}")
    return w
