"""Beam user state and timers backed by plain data that the lane executor owns and snapshots."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from apache_beam.transforms import userstate
from apache_beam.utils.timestamp import Timestamp

from zephon_flow.errors import SpecError

#: What one stateful DoFn holds for one lane: named state values and timer deadlines (micros).
StateValues = dict[str, Any]
TimerDeadlines = dict[str, int]


class _ReadModifyWrite(userstate.ReadModifyWriteRuntimeState):  # type: ignore[misc]
    def __init__(self, store: StateValues, name: str) -> None:
        self._store, self._name = store, name

    def read(self) -> Any:
        return self._store.get(self._name)

    def write(self, value: Any) -> None:
        self._store[self._name] = value

    def clear(self) -> None:
        self._store.pop(self._name, None)

    def commit(self) -> None:
        pass


class _Bag(userstate.BagRuntimeState):  # type: ignore[misc]
    def __init__(self, store: StateValues, name: str) -> None:
        self._store, self._name = store, name

    def read(self) -> Iterable[Any]:
        return list(self._store.get(self._name, ()))

    def add(self, value: Any) -> None:
        self._store.setdefault(self._name, []).append(value)

    def clear(self) -> None:
        self._store.pop(self._name, None)

    def commit(self) -> None:
        pass


class _Combining(userstate.CombiningValueRuntimeState):  # type: ignore[misc]
    def __init__(self, store: StateValues, name: str, combine_fn: Any) -> None:
        self._store, self._name, self._fn = store, name, combine_fn

    def _accumulator(self) -> Any:
        if self._name not in self._store:
            return self._fn.create_accumulator()
        return self._store[self._name]

    def read(self) -> Any:
        return self._fn.extract_output(self._accumulator())

    def add(self, value: Any) -> None:
        self._store[self._name] = self._fn.add_input(self._accumulator(), value)

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


def runtime_state(spec: userstate.StateSpec, store: StateValues, *, dofn_label: str) -> Any:
    """The runtime state object for ``spec`` over ``store`` (one DoFn, one lane)."""
    if isinstance(spec, userstate.ReadModifyWriteStateSpec):
        return _ReadModifyWrite(store, spec.name)
    if isinstance(spec, userstate.BagStateSpec):
        return _Bag(store, spec.name)
    if isinstance(spec, userstate.CombiningValueStateSpec):
        return _Combining(store, spec.name, spec.combine_fn)
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
