"""Beam user state and timers backed by plain data that the lane executor owns and snapshots."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import numpy as np
from apache_beam import coders
from apache_beam.transforms import userstate
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.utils.timestamp import Timestamp

from zephon_flow.core.errors import SpecError, StateError

#: What one stateful DoFn holds for one lane: named state values and timer deadlines (micros).
StateValues = dict[str, Any]
TimerDeadlines = dict[str, int]

_PLAIN_WORDS = "None, bool, int, float, str, bytes, numpy arrays, and lists, tuples and dicts of these"

#: Coders of Python values: the runner keeps such state as the values themselves (plain data,
#: checked when written) and never encodes them with the coder.
_VALUE_CODERS: tuple[type[Any], ...] = (
    coders.PickleCoder,
    coders.CloudpickleCoder,
    coders.DillCoder,
    coders.FastPrimitivesCoder,
    coders.VarIntCoder,
    coders.BigIntegerCoder,
    coders.BooleanCoder,
    coders.ByteCoder,
    coders.BytesCoder,
    coders.FloatCoder,
    coders.SinglePrecisionFloatCoder,
    coders.StrUtf8Coder,
    coders.NullableCoder,
    coders.TupleCoder,
    coders.TupleSequenceCoder,
    coders.ListCoder,
    coders.IterableCoder,
    coders.MapCoder,
)


def _unstorable_coder(coder: Any) -> Any:
    """The first coder in ``coder`` (itself or a component) whose values are not plain data."""
    if not isinstance(coder, _VALUE_CODERS):
        return coder
    for component in coder._get_component_coders() or ():
        bad = _unstorable_coder(component)
        if bad is not None:
            return bad
    return None


def check_specs(label: str, state_specs: Iterable[Any], timer_specs: Iterable[Any]) -> None:
    """Refuses, before any work, the state and timers a stateful DoFn declares that the runner
    cannot honour: timers in processing time, and state coders of values that are not plain data."""
    for timer in sorted(timer_specs, key=lambda t: t.name):
        name = timer.name.removeprefix("ts-")  # Beam prefixes timer names
        if timer.time_domain != TimeDomain.WATERMARK:
            raise SpecError(
                f"stateful DoFn {label!r}: timer {name!r} is in time domain "
                f"{timer.time_domain}; the deterministic runner has no processing time (a "
                f"batch sequence that depended on the clock would not be reproducible). Declare "
                f"it TimerSpec({name!r}, TimeDomain.WATERMARK): it fires when the lane's "
                f"position passes the timestamp it is set to"
            )
    for spec in sorted(state_specs, key=lambda s: s.name):
        coder = getattr(spec, "coder", None)
        bad = None if coder is None else _unstorable_coder(coder)
        if bad is not None:
            raise SpecError(
                f"stateful DoFn {label!r}: state {spec.name!r} is declared with {bad!r}, which "
                f"the deterministic runner cannot store: checkpoints hold state as plain data "
                f"({_PLAIN_WORDS}), not as coder bytes. Declare it with a coder of plain values "
                f"(PickleCoder(), VarIntCoder(), StrUtf8Coder(), BytesCoder(), TupleCoder([...])) "
                f"and store plain values (e.g. a message as its serialised bytes)"
            )


def check_plain(value: Any, where: str) -> None:
    """Raises ``StateError`` naming ``where`` unless ``value`` is plain data the codec stores."""
    found = _not_plain(value)
    if found is None:
        return
    inside, bad = found
    where += inside
    if isinstance(bad, np.ndarray | np.generic):
        raise StateError(
            f"{where} is a {bad.dtype} array; state holds plain numeric, bool, string and "
            f"bytes arrays only (no object or structured dtypes)"
        )
    kind = f"{type(bad).__module__}.{type(bad).__qualname__}".removeprefix("builtins.")
    hint = " (store a sorted list)" if isinstance(bad, set | frozenset) else ""
    raise StateError(f"{where} is of type {kind}; state holds plain data only ({_PLAIN_WORDS}){hint}")


_SCALARS = (bool, int, float, str, bytes)
#: Exact types that are plain as they are (their subclasses take the ``isinstance`` path).
_PLAIN_TYPES = frozenset({type(None), bool, int, float, str, bytes})
#: Array dtypes already found plain: most states hold a few dtypes, looked up by identity.
_PLAIN_DTYPES: set[np.dtype[Any]] = set()


def _bad_dtype(dtype: np.dtype[Any]) -> bool:
    if dtype in _PLAIN_DTYPES:
        return False
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "V":
        return True
    if len(_PLAIN_DTYPES) >= 256:  # e.g. strings of ever new lengths: each is a dtype
        _PLAIN_DTYPES.clear()
    _PLAIN_DTYPES.add(dtype)
    return False


def _not_plain(value: Any) -> tuple[str, Any] | None:
    """The first part of ``value`` that is not plain data, and where it is inside ``value``
    (e.g. ``"['ids'][2]"``); None if all of it is plain. The place is spelled out only for
    a part found, so a state written per element costs no string formatting. The exact
    types states are made of are told by ``type()``, before any ``isinstance``."""
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return None
    if kind is np.ndarray:
        return ("", value) if _bad_dtype(value.dtype) else None
    if kind is list or kind is tuple or isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if type(item) in _PLAIN_TYPES:
                continue
            found = _not_plain(item)
            if found is not None:
                return f"[{i}]{found[0]}", found[1]
        return None
    if kind is dict or isinstance(value, dict):
        for key, item in value.items():
            if type(key) is not str:
                found = _not_plain(key)
                if found is not None:
                    return f" key {key!r}{found[0]}", found[1]
            found = _not_plain(item)
            if found is not None:
                return f"[{key!r}]{found[0]}", found[1]
        return None
    if isinstance(value, _SCALARS):
        return None
    if isinstance(value, np.ndarray | np.generic):
        return ("", value) if _bad_dtype(value.dtype) else None
    return "", value


class _Checked:
    """Checks each value written to one state, so a growing value costs what it grows by:

    - a list re-written after appends (the object the state already holds) only in its new
      items;
    - a dict of lists (e.g. ``Pack``'s open sequence, a new ``{"pieces": [...], "docs": [...]}``
      per document) only in the items of each list past the prefix it shares, item for item
      (``is``), with the list last checked under the same key. Without this, a state of
      ``k`` pieces costs ``k`` checks per write and a sequence of short documents ``k**2``.
    """

    def __init__(self, dofn_label: str, name: str) -> None:
        self._where = f"stateful DoFn {dofn_label!r}: the value written to state {name!r}"
        self._checked = 0  # items of the list the state holds that were checked
        self._lists: dict[str, list[Any]] = {}  # per key of a dict value: the items last checked

    def check(self, value: Any, current: Any = None) -> None:
        kind = type(value)
        if kind is list or isinstance(value, list):
            start = self._checked if value is current else 0
            for i in range(start, len(value)):
                check_plain(value[i], f"{self._where}, at [{i}],")
            self._checked = len(value)
            return
        if kind is dict:
            self._check_dict(value)
            return
        check_plain(value, self._where)

    def _check_dict(self, value: dict[Any, Any]) -> None:
        last, seen = self._lists, {}
        for key, item in value.items():
            if type(key) is not str:
                self._lists = {}
                check_plain(value, self._where)  # the whole dict, its keys named as they are
                return
            if type(item) is not list:
                check_plain(item, f"{self._where}[{key!r}]")
                continue
            before = last.get(key)  # a copy: what was checked, whatever became of that list
            start = 0
            if before is not None and len(before) <= len(item) and all(map(operator.is_, before, item)):
                start = len(before)
            for i in range(start, len(item)):
                check_plain(item[i], f"{self._where}[{key!r}][{i}]")
            seen[key] = list(item)
        self._lists = seen


class _ReadModifyWrite(userstate.ReadModifyWriteRuntimeState):  # type: ignore[misc]
    def __init__(self, store: StateValues, name: str, checked: _Checked) -> None:
        self._store, self._name, self._checked = store, name, checked

    def read(self) -> Any:
        return self._store.get(self._name)

    def write(self, value: Any) -> None:
        self._checked.check(value, self._store.get(self._name))
        self._store[self._name] = value

    def clear(self) -> None:
        self._store.pop(self._name, None)

    def commit(self) -> None:
        pass


class _Bag(userstate.BagRuntimeState):  # type: ignore[misc]
    def __init__(self, store: StateValues, name: str, checked: _Checked) -> None:
        self._store, self._name, self._checked = store, name, checked

    def read(self) -> Iterable[Any]:
        return list(self._store.get(self._name, ()))

    def add(self, value: Any) -> None:
        self._checked.check(value)
        self._store.setdefault(self._name, []).append(value)

    def clear(self) -> None:
        self._store.pop(self._name, None)

    def commit(self) -> None:
        pass


class _Combining(userstate.CombiningValueRuntimeState):  # type: ignore[misc]
    def __init__(self, store: StateValues, name: str, combine_fn: Any, checked: _Checked) -> None:
        self._store, self._name, self._fn, self._checked = store, name, combine_fn, checked

    def _accumulator(self) -> Any:
        if self._name not in self._store:
            return self._fn.create_accumulator()
        return self._store[self._name]

    def read(self) -> Any:
        return self._fn.extract_output(self._accumulator())

    def add(self, value: Any) -> None:
        accumulator = self._fn.add_input(self._accumulator(), value)
        self._checked.check(accumulator)
        self._store[self._name] = accumulator

    def clear(self) -> None:
        self._store.pop(self._name, None)

    def commit(self) -> None:
        pass


class _Timer(userstate.BaseTimer):  # type: ignore[misc]
    def __init__(self, deadlines: TimerDeadlines, name: str) -> None:
        self._deadlines, self._name = deadlines, name

    def set(self, timestamp: Timestamp, dynamic_timer_tag: str = "") -> None:
        if dynamic_timer_tag:
            raise SpecError("dynamic timer tags are not supported by the deterministic runner")
        self._deadlines[self._name] = Timestamp.of(timestamp).micros

    def clear(self, dynamic_timer_tag: str = "") -> None:
        self._deadlines.pop(self._name, None)


class _Unchecked(_Checked):
    """The write check of a DoFn whose state is plain by construction (``plain_by_construction``)."""

    def check(self, value: Any, current: Any = None) -> None:
        pass


def plain_by_construction(dofn: Any) -> bool:
    """Whether ``dofn``'s own class declares ``zephon_state_is_plain = True``: everything it
    writes to state is plain data by construction (arrays, numbers, lists and dicts of them),
    which its tests pin, so the runner skips its write check (``Pack`` writes its open
    sequence once per document: the check was 8 % of the lane thread on short documents). A
    subclass must declare it again; a value that is not plain is still refused when the state
    is saved, with its place."""
    return type(dofn).__dict__.get("zephon_state_is_plain", False) is True


def runtime_state(
    spec: userstate.StateSpec, store: StateValues, *, dofn_label: str, check: bool = True
) -> Any:
    """The runtime state object for ``spec`` over ``store`` (one DoFn, one lane); ``check``
    False skips the check of each value written (``plain_by_construction``)."""
    checked = (_Checked if check else _Unchecked)(dofn_label, spec.name)
    if isinstance(spec, userstate.ReadModifyWriteStateSpec):
        return _ReadModifyWrite(store, spec.name, checked)
    if isinstance(spec, userstate.BagStateSpec):
        return _Bag(store, spec.name, checked)
    if isinstance(spec, userstate.CombiningValueStateSpec):
        return _Combining(store, spec.name, spec.combine_fn, checked)
    raise SpecError(
        f"{dofn_label}: {type(spec).__name__} is not supported by the deterministic runner; "
        f"use ReadModifyWriteStateSpec, BagStateSpec or CombiningValueStateSpec"
    )


def runtime_timer(spec: userstate.TimerSpec, deadlines: TimerDeadlines) -> Any:
    return _Timer(deadlines, spec.name)


def snapshot_value(value: Any) -> Any:
    """Copies the top level of one state value (a list or dict); its contents are shared.

    The contract for stateful DoFns: a list or dict read from state may be changed at its
    top level (append, assign an index or key) before it is written back; anything nested
    in it, and every array, must not be changed in place once stored. So a window-close
    snapshot costs one shallow copy per state value, whatever the state holds.
    """
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def copy_plain(value: Any) -> Any:
    """Copies the containers of a plain-data tree; arrays, bytes and scalars are shared.

    State values are treated as immutable once stored: operators replace arrays, never
    write into them, so a snapshot only needs its own containers.
    """
    if isinstance(value, list):
        return [copy_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: copy_plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(copy_plain(v) for v in value)
    return value
