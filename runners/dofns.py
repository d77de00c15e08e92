"""Calling users' Beam DoFns directly: stateless ones per element, stateful ones per lane with state."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
from apache_beam.transforms import userstate
from apache_beam.transforms.core import get_function_arguments
from apache_beam.utils.timestamp import Timestamp

from zephon_flow.core.errors import DataError, SpecError, StageError, ZephonError
from zephon_flow.core.markers import DocId, _ProvenanceParam, _SeedParam
from zephon_flow.core.rng import stable_hash
from zephon_flow.core.state import StageState
from zephon_flow.runners.userstate import (
    StateValues,
    TimerDeadlines,
    check_specs,
    copy_plain,
    plain_by_construction,
    runtime_state,
    runtime_timer,
    snapshot_value,
)

#: Positions are timestamps in whole seconds (Beam timestamps count microseconds).
_MICROS = 1_000_000


@contextmanager
def dofn_errors(label: str, where: str) -> Iterator[None]:
    """Names the DoFn and the place in the stream in any error it raises.

    Data errors stay ``DataError`` (with the place appended); other exceptions become
    ``StageError``; zephon-flow's own errors pass through unchanged.
    """
    try:
        yield
    except DataError as exc:
        raise DataError(f"{exc} (DoFn {label!r}, {where})") from exc
    except ZephonError:
        raise
    except Exception as exc:
        raise StageError(f"DoFn {label!r} raised {type(exc).__name__}: {exc} ({where})") from exc


def dofn_seed(spec_seed: int, label: str) -> int:
    """The seed a DoFn labelled ``label`` receives: distinct per transform, fixed per spec."""
    return stable_hash(f"{spec_seed}/{label}")


def is_stateful(dofn: beam.DoFn) -> bool:
    return bool(userstate.is_stateful_dofn(dofn))


def _marked(dofn: beam.DoFn, method: str) -> list[tuple[str, Any]]:
    """(name, default) of the method's parameters whose default is a Beam or zephon-flow marker."""
    args, defaults = get_function_arguments(dofn, method)
    names = args[-len(defaults) :] if defaults else []
    return [(n, d) for n, d in zip(names, defaults, strict=True) if _is_marker(d)]


def _is_marker(default: Any) -> bool:
    return isinstance(
        default, beam.DoFn.StateParam | beam.DoFn.TimerParam | _SeedParam | _ProvenanceParam
    ) or any(
        default == p
        for p in (
            beam.DoFn.TimestampParam,
            beam.DoFn.KeyParam,
            beam.DoFn.WindowParam,
            beam.DoFn.PaneInfoParam,
            beam.DoFn.WindowedValueParam,
            beam.DoFn.ElementParam,
            beam.DoFn.SideInputParam,
            beam.DoFn.BundleFinalizerParam,
        )
    )


def _defines(dofn: beam.DoFn, method: str) -> bool:
    """Whether the DoFn overrides ``beam.DoFn.<method>`` (on its class or as an attribute)."""
    impl = getattr(dofn, method)
    return getattr(impl, "__func__", impl) is not getattr(beam.DoFn, method)


class StatelessInvoker:
    """Runs one stateless DoFn on single elements or, if it defines ``process_batch``, on lists;
    picklable, set up lazily once per process.

    zephon-flow's ``process_batch(batch)`` contract: called with a list of elements, it returns
    (or yields) one list of outputs per element, in order, so outputs stay attributable to the
    record they came from (a lane's resume cursor counts outputs per record). This differs from
    Beam's ``process_batch``, which yields output batches; a DoFn written for Beam's batched
    path is refused at run time by the length and type checks here.
    """

    def __init__(self, label: str, dofn: beam.DoFn) -> None:
        self.has_process = _defines(dofn, "process")
        self.batched = _defines(dofn, "process_batch")
        if not (self.has_process or self.batched):
            raise SpecError(f"stateless DoFn {label!r} defines neither process() nor process_batch()")
        for method in ("process", "process_batch"):
            if not _defines(dofn, method):
                continue
            extra = [n for n, _ in _marked(dofn, method)]
            if extra:
                raise SpecError(
                    f"stateless DoFn {label!r} asks for {', '.join(extra)} in {method}(); the "
                    f"deterministic runner passes stateless DoFns only the element (or the batch)"
                )
        self.label = label
        self.dofn = dofn
        self._ready = False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ready": False}

    def label_of(self, exc: BaseException) -> str:
        """The label errors raised by this step name (a fused step's: the part that raised)."""
        return self.label

    def _setup(self) -> None:
        self.dofn.setup()
        self._ready = True

    def __call__(self, value: Any) -> list[Any]:
        if not self._ready:
            self._setup()
        if not self.has_process:
            return self.call_batch([value])[0]
        out = self.dofn.process(value)
        return [] if out is None else list(out)

    def call_batch(self, values: list[Any]) -> list[list[Any]]:
        """``process_batch(values)``, checked: one list of outputs per value, in order."""
        if not self._ready:
            self._setup()
        out = self.dofn.process_batch(values)
        results = out if isinstance(out, list) else [] if out is None else list(out)
        if len(results) != len(values):
            raise StageError(
                f"DoFn {self.label!r}: process_batch returned {len(results)} output lists for "
                f"{len(values)} elements; zephon-flow's process_batch must return one list of "
                f"outputs per element, in order"
            )
        if all(type(outputs) is list for outputs in results):
            return results
        for i, outputs in enumerate(results):
            if not isinstance(outputs, list | tuple):
                raise StageError(
                    f"DoFn {self.label!r}: process_batch returned a {type(outputs).__name__} for "
                    f"element {i}; zephon-flow's process_batch must return one list of outputs "
                    f"per element (not Beam-style output batches)"
                )
        return [list(outputs) for outputs in results]


class FusedInvoker(StatelessInvoker):
    """Two adjacent stateless DoFns run as the one DoFn the second returned from ``fuse_after``.

    It counts as one stage of the front; errors name the DoFn they came from (the fused DoFn
    marks the second's with ``zephon_fused_part = 1``), and a worker's death names both."""

    def __init__(self, first: StatelessInvoker, second: StatelessInvoker, fused: beam.DoFn) -> None:
        super().__init__(f"{first.label}+{second.label}", fused)
        self.labels = (first.label, second.label)

    def label_of(self, exc: BaseException) -> str:
        return self.labels[1] if getattr(exc, "zephon_fused_part", 0) == 1 else self.labels[0]


def fuse(chain: Sequence[StatelessInvoker]) -> list[StatelessInvoker]:
    """``chain`` with each pair of neighbours that runs faster as one DoFn fused: the second
    DoFn's ``fuse_after(first)`` returns that DoFn (e.g. ``DecodeImage`` then ``ResizeImage``,
    which then skip a full-size copy of each image). The outputs are the same; a DoFn without
    ``fuse_after``, or whose ``fuse_after`` returns None, runs on its own."""
    out: list[StatelessInvoker] = []
    for step in chain:
        join = getattr(step.dofn, "fuse_after", None)
        previous = out[-1] if out else None
        if previous is not None and not isinstance(previous, FusedInvoker) and callable(join):
            fused = join(previous.dofn)
            if fused is not None:
                out[-1] = FusedInvoker(previous, step, fused)
                continue
        out.append(step)
    return out


@dataclass
class DoFnLaneState:
    """One stateful DoFn's runtime state for one lane: values, timer deadlines, input count."""

    values: StateValues = field(default_factory=dict)
    timers: TimerDeadlines = field(default_factory=dict)
    position: int = 0
    # Runtime state and timer objects bound to ``values``/``timers``, built once per method.
    bound: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)

    def snapshot(self) -> StageState:
        """What a checkpoint keeps of it (copies of the values, never the bound objects)."""
        return StageState(
            values={name: snapshot_value(v) for name, v in self.values.items()},
            timers=dict(self.timers),
            position=self.position,
        )

    @classmethod
    def restore(cls, saved: StageState) -> DoFnLaneState:
        return cls(values=copy_plain(saved.values), timers=dict(saved.timers), position=saved.position)


class _Binding:
    """How to fill one DoFn method's marked parameters."""

    def __init__(self, label: str, dofn: beam.DoFn, method: str) -> None:
        marked = _marked(dofn, method)
        self.method = getattr(dofn, method)
        self.check = not plain_by_construction(dofn)  # check what it writes to state
        self.states = {n: d.state_spec for n, d in marked if isinstance(d, beam.DoFn.StateParam)}
        self.timers = {n: d.timer_spec for n, d in marked if isinstance(d, beam.DoFn.TimerParam)}
        self.timestamp = next((n for n, d in marked if d == beam.DoFn.TimestampParam), None)
        self.key = next((n for n, d in marked if d == beam.DoFn.KeyParam), None)
        self.seed = [n for n, d in marked if isinstance(d, _SeedParam)]
        self.doc = next((n for n, d in marked if isinstance(d, _ProvenanceParam)), None)
        known = set(self.states) | set(self.timers) | set(self.seed) | {self.timestamp, self.key, self.doc}
        unknown = [n for n, _ in marked if n not in known]
        if unknown:
            raise SpecError(
                f"stateful DoFn {label!r}: parameter(s) {', '.join(unknown)} of {method}() are not "
                f"supported; the runner provides StateParam, TimerParam, TimestampParam, KeyParam "
                f"zephon_flow.SeedParam and zephon_flow.ProvenanceParam"
            )

    def kwargs(
        self, label: str, lane: int, seed: int, st: DoFnLaneState, micros: int, doc: DocId | None = None
    ) -> dict[str, Any]:
        kw = st.bound.get(id(self))
        if kw is None:
            kw = {
                n: runtime_state(s, st.values, dofn_label=label, check=self.check)
                for n, s in self.states.items()
            }
            kw.update({n: runtime_timer(t, st.timers) for n, t in self.timers.items()})
            kw.update({n: seed for n in self.seed})
            if self.key:
                kw[self.key] = lane
            st.bound[id(self)] = kw
        # Set in place: the call unpacks ``kw`` at once, and the next call sets them again.
        if self.timestamp:
            kw[self.timestamp] = Timestamp(micros=micros)
        if self.doc:
            kw[self.doc] = doc
        return kw


class StatefulInvoker:
    """Runs one stateful DoFn for the lanes of a loader; the state lives in ``DoFnLaneState``."""

    def __init__(self, label: str, dofn: beam.DoFn, *, seed: int) -> None:
        try:
            userstate.validate_stateful_dofn(dofn)
        except ValueError as exc:
            raise SpecError(f"stateful DoFn {label!r} is invalid: {exc}") from exc
        self.label = label
        self.dofn = dofn
        self.seed = seed
        self._process = _Binding(label, dofn, "process")
        state_specs, timer_specs = userstate.get_dofn_specs(dofn)
        check_specs(label, state_specs, timer_specs)
        self._on_timer = {
            spec.name: _Binding(label, dofn, spec._attached_callback.__name__)
            for spec in sorted(timer_specs, key=lambda s: s.name)
        }
        dofn.setup()

    def process(self, lane: int, value: Any, st: DoFnLaneState, doc: DocId | None = None) -> list[Any]:
        """Feeds the element at ``st.position``; returns outputs, then fires timers now due."""
        kw = self._process.kwargs(self.label, lane, self.seed, st, st.position * _MICROS, doc)
        out = self._process.method((lane, value), **kw)
        results = [] if out is None else list(out)
        st.position += 1
        # The watermark is now ``st.position``: timers strictly below it fire, in deadline order.
        if st.timers and min(st.timers.values()) < st.position * _MICROS:
            results.extend(self.fire_timers(lane, st, st.position * _MICROS))
        return results

    def fire_timers(self, lane: int, st: DoFnLaneState, watermark_micros: int | None) -> list[Any]:
        """Fires every timer whose deadline is below the watermark (``None``: end of input)."""
        results: list[Any] = []
        while True:
            due = [
                (deadline, name)
                for name, deadline in st.timers.items()
                if watermark_micros is None or deadline < watermark_micros
            ]
            if not due:
                return results
            deadline, name = min(due)
            del st.timers[name]
            binding = self._on_timer[name]
            out = binding.method(**binding.kwargs(self.label, lane, self.seed, st, deadline))
            results.extend([] if out is None else list(out))
