"""What the runner cannot honour of Beam's state and timers is refused up front; state values
are checked when written, not when a checkpoint is saved."""

from __future__ import annotations

import collections
import enum
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.coders import Coder, PickleCoder, VarIntCoder
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import (
    BagStateSpec,
    ReadModifyWriteStateSpec,
    TimerSpec,
    on_timer,
)
from helpers import chain_spec, write_jsonl

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import SpecError, StateError
from zephon_flow.runners.userstate import _Checked, check_plain, plain_by_construction


class WallClock(beam.DoFn):  # type: ignore[misc]
    TICK = TimerSpec("tick", TimeDomain.REAL_TIME)

    def process(self, element: Any, tick: Any = beam.DoFn.TimerParam(TICK)) -> Any:
        yield element[1]

    @on_timer(TICK)
    def ticked(self) -> Any:
        return []


class PointCoder(Coder):  # type: ignore[misc]
    """A user's coder of a user's type: what it encodes is not plain data."""

    def encode(self, value: Any) -> bytes:
        return f"{value[0]},{value[1]}".encode()

    def decode(self, data: bytes) -> Any:
        return tuple(int(v) for v in data.split(b","))


class RowState(beam.DoFn):  # type: ignore[misc]
    LAST = ReadModifyWriteStateSpec("last", PointCoder())

    def process(self, element: Any, last: Any = beam.DoFn.StateParam(LAST)) -> Any:
        yield element[1]


class SeenWords(beam.DoFn):  # type: ignore[misc]
    """Legal in Beam with a PickleCoder: a set in state."""

    SEEN = ReadModifyWriteStateSpec("seen", PickleCoder())

    def process(self, element: Any, seen: Any = beam.DoFn.StateParam(SEEN)) -> Any:
        words = seen.read() or set()
        words.update(element[1].split())
        seen.write(words)
        yield len(words)


class Buffered(beam.DoFn):  # type: ignore[misc]
    """Appends to a list held in state; element 5 appends an object."""

    HELD = ReadModifyWriteStateSpec("held", PickleCoder())
    COUNT = BagStateSpec("count", VarIntCoder())

    def process(
        self,
        element: Any,
        held: Any = beam.DoFn.StateParam(HELD),
        count: Any = beam.DoFn.StateParam(COUNT),
    ) -> Any:
        items = held.read() or []
        items.append(object() if element[1].endswith(" 5") else element[1])
        held.write(items)
        count.add(1)
        yield len(items)


@pytest.fixture
def jsonl(tmp_path: Path) -> str:
    return write_jsonl(tmp_path / "docs.jsonl", [f"doc {i}" for i in range(10)])


def test_a_processing_time_timer_is_refused_at_construction(jsonl: str) -> None:
    spec = chain_spec(jsonl, ("clock", WallClock()))
    with pytest.raises(SpecError) as err:
        spec.compile()
    assert str(err.value).startswith(
        "stateful DoFn 'clock': timer 'tick' is in time domain REAL_TIME; the deterministic runner "
        "has no processing time"
    )
    assert "TimerSpec('tick', TimeDomain.WATERMARK)" in str(err.value)


def test_a_state_coder_of_objects_is_refused_at_construction(jsonl: str) -> None:
    spec = chain_spec(jsonl, ("rows", RowState()))
    with pytest.raises(SpecError) as err:
        spec.compile()
    message = str(err.value)
    assert message.startswith("stateful DoFn 'rows': state 'last' is declared with PointCoder")
    assert "cannot store" in message and "PickleCoder()" in message


def test_a_set_in_state_is_refused_when_written(jsonl: str) -> None:
    with zf.Loader(chain_spec(jsonl, ("seen", SeenWords()))) as loader, pytest.raises(StateError) as err:
        next(iter(loader))
    assert str(err.value).startswith(
        "stateful DoFn 'seen': the value written to state 'seen' is of type set;"
    )
    assert str(err.value).endswith("(store a sorted list)")


def test_an_appended_object_is_refused_when_written(jsonl: str) -> None:
    with zf.Loader(chain_spec(jsonl, ("buf", Buffered()))) as loader:
        steps = []
        with pytest.raises(StateError) as err:
            for step, _ in loader:
                steps.append(step)
    assert steps == [0, 1, 2, 3, 4]  # the record "doc 5" is the one that writes the object
    assert "stateful DoFn 'buf': the value written to state 'held', at [5], is of type object;" in str(
        err.value
    )


def test_a_value_deep_inside_state_is_named_by_its_place() -> None:
    plain = {"pieces": [np.arange(3), np.zeros(2)], "docs": [(1, 2, 3)], "n": 4, "s": "x", "b": b"y"}
    check_plain(plain, "state 'carry'")  # nothing raised
    cases = [
        (
            {"pieces": [np.arange(3), np.array([object()])]},
            r"state 'carry'\['pieces'\]\[1\] is a object array",
        ),
        (
            {"a": [{"b": ({1, 2},)}]},
            r"state 'carry'\['a'\]\[0\]\['b'\]\[0\] is of type set; .*\(store a sorted list\)$",
        ),
        ({(1, object()): 2}, r"state 'carry' key \(1, <object object at .*>\)\[1\] is of type object;"),
        (np.zeros(2, dtype=[("x", "i4")]), r"^state 'carry' is a \[\('x', '<i4'\)\] array;"),
    ]
    for value, message in cases:
        with pytest.raises(StateError, match=message):
            check_plain(value, "state 'carry'")


class Colour(enum.IntEnum):
    RED = 1


class Name(str):
    pass


Pair = collections.namedtuple("Pair", "a b")


def test_subclasses_and_numpy_scalars_are_judged_as_their_base_types() -> None:
    plain = [
        Colour.RED,
        Name("x"),
        collections.OrderedDict(a=np.arange(2)),
        Pair(1, [np.float32(2.0), np.int64(3)]),
        np.arange(4).view(np.matrix),
        {Name("key"): 1, 2: "two", (3, "t"): None},
    ]
    for value in plain:
        check_plain(value, "state 'x'")  # nothing raised
    # The dtypes found plain above are remembered; arrays of other dtypes are still judged.
    bad = [
        (Pair(1, {2}), r"state 'x'\[1\] is of type set"),
        (collections.OrderedDict(a=np.array([None])), r"state 'x'\['a'\] is a object array"),
        (np.zeros(1, dtype=[("x", "i4")])[0], r"state 'x' is a \[\('x', '<i4'\)\] array"),
        (np.array([None]).view(np.matrix), r"state 'x' is a object array"),
        ({Colour.RED: object()}, r"state 'x'\[<Colour.RED: 1>\] is of type object"),
    ]
    for value, message in bad:
        with pytest.raises(StateError, match=message):
            check_plain(value, "state 'x'")


def test_a_dict_of_growing_lists_is_checked_in_what_it_adds() -> None:
    # Pack writes a new {"pieces": [...], "docs": [...]} per document: each write checks only
    # the items past the prefix it shares with the last one checked, and still finds a bad one
    # wherever it is, also in a list changed in place after its check.
    checked = _Checked("pack", "carry")
    a, b = np.arange(3), np.arange(4)
    checked.check({"pieces": [a], "n": 1})
    checked.check({"pieces": [a, b], "n": 2})
    held: list[Any] = [a, b]
    checked.check({"pieces": held})
    held[0] = object()
    with pytest.raises(
        StateError,
        match=r"^stateful DoFn 'pack': the value written to state 'carry'\['pieces'\]\[0\] is of type object;",
    ):
        checked.check({"pieces": held})
    with pytest.raises(StateError, match=r"'carry'\['pieces'\]\[2\] is of type set;"):
        checked.check({"pieces": [a, b, {1}]})
    with pytest.raises(StateError, match=r"'carry'\['n'\] is of type object;"):
        checked.check({"pieces": [a], "n": object()})
    with pytest.raises(StateError, match=r"'carry'\[1\] is of type object;"):
        checked.check({"pieces": [a], 1: object()})


def test_only_a_class_that_declares_its_state_plain_skips_the_write_check() -> None:
    class MyPack(ops.Pack):  # a user's subclass may write anything: checked again
        pass

    assert plain_by_construction(ops.Pack(seq_len=8))
    assert not plain_by_construction(MyPack(seq_len=8))
    assert not plain_by_construction(ops.Shuffle(buffer=4))  # holds whatever flows into it
