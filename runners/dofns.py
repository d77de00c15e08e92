"""Calling users' Beam DoFns directly: stateless ones per element, stateful ones per lane with state."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
from apache_beam.internal import pickler
from apache_beam.transforms import userstate
from apache_beam.transforms.core import get_function_arguments
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from zephon_flow.core.checkpoint.state import StageState
from zephon_flow.core.errors import DataError, SpecError, StageError, ZephonError
from zephon_flow.core.markers import DocId, _ProvenanceParam, _SeedParam
from zephon_flow.core.rng import stable_hash
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

_log = logging.getLogger("zephon_flow")

#: Seconds a teardown waits for a call still running on the same instance (a stuck thread).
TEARDOWN_WAIT = 1.0


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


#: The lifecycle methods, besides ``setup`` and ``process``, that a DoFn may override.
LIFECYCLE = ("start_bundle", "finish_bundle", "teardown")


class Lifecycle:
    """Beam's DoFn lifecycle on one DoFn instance, made deterministic (see docs/beam.md).

    - ``setup`` runs once per instance, before its first element, in the process that runs it.
    - A **bundle is one element at the DoFn's stage**: ``start_bundle``, ``process`` (for a
      stateful DoFn, with the timers that element makes due), ``finish_bundle``, whose outputs
      follow the element's own. The timers fired at the end of a lane's input are one more
      bundle. A bundle thus depends on nothing but the element: not on chunks, workers,
      backends or resume points, and none is open at a checkpoint.
    - ``teardown`` runs once, when the executor that owns the instance ends (``Loader.close``,
      a worker process's or Ray actor's normal exit, Beam's teardown of the translation's DoFn).

    A DoFn that overrides ``start_bundle``, ``finish_bundle`` or ``teardown`` keeps something
    on its instance, so every executor runs its own copy (``instance()``, made with Beam's
    pickler from the definition as compiled), used by one thread at a time. Others are shared.
    """

    label: str
    dofn: beam.DoFn

    def _init_lifecycle(self, label: str, dofn: beam.DoFn, template: bytes | None) -> None:
        self.label, self.dofn = label, dofn
        self.starts = _defines(dofn, "start_bundle")
        self.finishes = _defines(dofn, "finish_bundle")
        self.bundles = self.starts or self.finishes
        overridden = [m for m in LIFECYCLE if _defines(dofn, m)]
        self.owned = bool(overridden)
        self._template = template
        if self.owned and template is None:
            try:
                self._template = pickler.dumps(dofn)
            except Exception as exc:
                raise SpecError(
                    f"DoFn {label!r} defines {', '.join(m + '()' for m in overridden)}, so each loader "
                    f"and worker runs its own copy of it, made with Beam's pickler; copying it failed "
                    f"({type(exc).__name__}: {exc}). Create what cannot be pickled in setup(), not in "
                    f"__init__"
                ) from exc
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._ready = False
        self._torn = False

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_template")}
        return {**state, "_ready": False, "_torn": False}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._template = None
        self._lock = threading.Lock()

    def _fresh_dofn(self) -> beam.DoFn:
        template = self._template if self._template is not None else pickler.dumps(self.dofn)
        return pickler.loads(template)

    def _setup(self) -> None:
        """``setup()``, once per instance (threads may race to the first element)."""
        with self._lock:
            if self._torn:
                raise StageError(
                    f"DoFn {self.label!r} was called after its teardown(): the loader or worker "
                    f"that owns it has closed"
                )
            if not self._ready:
                self.dofn.setup()
                self._ready = True

    def _bundle(self, work: Callable[[], list[Any]]) -> list[Any]:
        """``work()`` as one bundle: ``start_bundle()`` before it, ``finish_bundle()``'s
        outputs after its own; the instance is held by this thread until it is done."""
        with self._lock:
            if self.starts:
                started = self.dofn.start_bundle()
                if started is not None:
                    raise StageError(
                        f"DoFn {self.label!r}: start_bundle() returned {type(started).__name__}; it "
                        f"may only prepare the bundle (Beam refuses output from it too): emit from "
                        f"process() or finish_bundle()"
                    )
            out = work()
            if self.finishes:
                out.extend(self._finished(self.dofn.finish_bundle()))
            return out

    def _finished(self, results: Any) -> list[Any]:
        """The values of ``finish_bundle()``'s outputs: WindowedValues, as Beam requires
        (their timestamp and windows are replaced by the element's place, as all outputs'
        are here)."""
        if results is None:
            return []
        out = []
        for result in results:
            if not isinstance(result, WindowedValue):
                raise StageError(
                    f"DoFn {self.label!r}: finish_bundle() yielded a {type(result).__name__}; as on "
                    f"Beam, it must yield WindowedValue objects, e.g. "
                    f"GlobalWindows.windowed_value(value) (from apache_beam.transforms.window)"
                )
            out.append(result.value)
        return out

    def teardown(self) -> None:
        """``teardown()`` of an instance that was set up, once; an error in it, or a call still
        running on the instance after ``TEARDOWN_WAIT`` seconds, is logged, never raised (the
        loader or worker is closing)."""
        if self._torn or not self.owned:  # a shared instance defines no teardown: it stays
            return
        if not (self._ready and _defines(self.dofn, "teardown")):
            self._torn, self._ready = True, False
            return
        if not self._lock.acquire(timeout=TEARDOWN_WAIT):
            _log.warning("DoFn %r: teardown() not called: a call on it is still running", self.label)
            return
        try:
            self._torn, self._ready = True, False
            self.dofn.teardown()
        except Exception as exc:
            _log.warning("DoFn %r: teardown() raised %s: %s", self.label, type(exc).__name__, exc)
        finally:
            self._lock.release()


class StatelessInvoker(Lifecycle):
    """Runs one stateless DoFn on single elements or, if it defines ``process_batch``, on lists;
    picklable, set up lazily once per process (per instance: see ``Lifecycle``).

    zephon-flow's ``process_batch(batch)`` contract: called with a list of elements, it returns
    (or yields) one list of outputs per element, in order, so outputs stay attributable to the
    record they came from (a lane's resume cursor counts outputs per record). This differs from
    Beam's ``process_batch``, which yields output batches; a DoFn written for Beam's batched
    path is refused at run time by the length and type checks here. A DoFn with bundle methods
    gets each element in a bundle of its own, so its ``process_batch`` is called per element.
    """

    def __init__(self, label: str, dofn: beam.DoFn, *, template: bytes | None = None) -> None:
        self.has_process = _defines(dofn, "process")
        if not (self.has_process or _defines(dofn, "process_batch")):
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
        self._init_lifecycle(label, dofn, template)
        #: Whether the front calls ``call_batch`` on a chunk's values at once.
        self.batched = _defines(dofn, "process_batch") and not self.bundles

    def instance(self) -> StatelessInvoker:
        """The invoker an executor runs: this one, or one on its own copy of the DoFn."""
        if not self.owned:
            return self
        return type(self)(self.label, self._fresh_dofn(), template=self._template)

    def label_of(self, exc: BaseException) -> str:
        """The label errors raised by this step name (a fused step's: the part that raised)."""
        return self.label

    def __call__(self, value: Any) -> list[Any]:
        if not self._ready:
            self._setup()
        if self.bundles:
            return self._bundle(lambda: self._one(value))
        if self.owned:
            with self._lock:
                return self._one(value)
        return self._one(value)

    def _one(self, value: Any) -> list[Any]:
        if not self.has_process:
            return self._batch([value])[0]
        out = self.dofn.process(value)
        return [] if out is None else list(out)

    def call_batch(self, values: list[Any]) -> list[list[Any]]:
        """``process_batch(values)``, checked: one list of outputs per value, in order."""
        if not self._ready:
            self._setup()
        if self.bundles:
            return [self(value) for value in values]
        if self.owned:
            with self._lock:
                return self._batch(values)
        return self._batch(values)

    def _batch(self, values: list[Any]) -> list[list[Any]]:
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
        # A DoFn with its own lifecycle (bundles, teardown) runs as itself, never fused.
        alone = step.owned or (previous is not None and previous.owned)
        if previous is not None and not isinstance(previous, FusedInvoker) and callable(join) and not alone:
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


class StatefulInvoker(Lifecycle):
    """Runs one stateful DoFn for the lanes of a loader; the state lives in ``DoFnLaneState``.

    Each element is a bundle of its own, with the timers it makes due; so are the timers
    fired at the end of a lane's input (see ``Lifecycle``)."""

    def __init__(self, label: str, dofn: beam.DoFn, *, seed: int, template: bytes | None = None) -> None:
        try:
            userstate.validate_stateful_dofn(dofn)
        except ValueError as exc:
            raise SpecError(f"stateful DoFn {label!r} is invalid: {exc}") from exc
        self.seed = seed
        self._process = _Binding(label, dofn, "process")
        state_specs, timer_specs = userstate.get_dofn_specs(dofn)
        check_specs(label, state_specs, timer_specs)
        self._on_timer = {
            spec.name: _Binding(label, dofn, spec._attached_callback.__name__)
            for spec in sorted(timer_specs, key=lambda s: s.name)
        }
        self._init_lifecycle(label, dofn, template)

    def instance(self) -> StatefulInvoker:
        """The invoker an executor runs: this one, or one on its own copy of the DoFn."""
        if not self.owned:
            return self
        return type(self)(self.label, self._fresh_dofn(), seed=self.seed, template=self._template)

    def process(self, lane: int, value: Any, st: DoFnLaneState, doc: DocId | None = None) -> list[Any]:
        """Feeds the element at ``st.position``; returns outputs, then fires timers now due."""
        if not self._ready:
            self._setup()
        if self.owned:
            return self._bundle(lambda: self._element(lane, value, st, doc))
        return self._element(lane, value, st, doc)

    def _element(self, lane: int, value: Any, st: DoFnLaneState, doc: DocId | None) -> list[Any]:
        kw = self._process.kwargs(self.label, lane, self.seed, st, st.position * _MICROS, doc)
        out = self._process.method((lane, value), **kw)
        results = [] if out is None else list(out)
        st.position += 1
        # The watermark is now ``st.position``: timers strictly below it fire, in deadline order.
        if st.timers and min(st.timers.values()) < st.position * _MICROS:
            results.extend(self._fire(lane, st, st.position * _MICROS))
        return results

    def fire_timers(self, lane: int, st: DoFnLaneState, watermark_micros: int | None) -> list[Any]:
        """Fires every timer whose deadline is below the watermark (``None``: end of input),
        as one bundle."""
        if not self._ready:
            self._setup()
        if self.owned:
            return self._bundle(lambda: self._fire(lane, st, watermark_micros))
        return self._fire(lane, st, watermark_micros)

    def _fire(self, lane: int, st: DoFnLaneState, watermark_micros: int | None) -> list[Any]:
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
