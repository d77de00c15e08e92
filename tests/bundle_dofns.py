"""DoFns that use Beam's bundle lifecycle, for the bundle and conformance tests.

They live at module level so that worker processes, Ray actors and Beam's workers import them
by reference. ``Traced`` writes each lifecycle call to a file of its own per instance, so a
test can read what every worker did after the loader has closed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import BagStateSpec
from apache_beam.transforms.window import GlobalWindows


class BufferedLengths(beam.DoFn):  # type: ignore[misc]
    """The Beam idiom of the issue: ``start_bundle`` makes a buffer, ``process`` buffers each
    text's length and emits three at a time, ``finish_bundle`` flushes the rest."""

    def start_bundle(self) -> None:
        self.buffer: list[int] = []

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        self.buffer.append(len(text))
        if len(self.buffer) == 3:
            yield from self._flush()

    def finish_bundle(self) -> Iterator[Any]:
        for sample in self._flush():
            yield GlobalWindows.windowed_value(sample)

    def _flush(self) -> list[dict[str, Any]]:
        out = [{"length": np.int64(n)} for n in self.buffer]
        self.buffer = []
        return out


class RunningTotal(beam.DoFn):  # type: ignore[misc]
    """A stateful DoFn with bundle methods: each sample gets the running total of the lengths
    so far in its lane (Beam state), and ``finish_bundle`` adds a marker sample after it."""

    SEEN = BagStateSpec("seen", PickleCoder())

    def start_bundle(self) -> None:
        self.made = 0

    def process(
        self, element: tuple[int, dict[str, Any]], seen: Any = beam.DoFn.StateParam(SEEN)
    ) -> Iterator[dict[str, Any]]:
        _, sample = element
        seen.add(int(sample["length"]))
        self.made += 1
        yield {"length": sample["length"], "total": np.int64(sum(seen.read()))}

    def finish_bundle(self) -> Iterator[Any]:
        if self.made:
            yield GlobalWindows.windowed_value({"length": np.int64(-1), "total": np.int64(self.made)})


class Doubled(beam.DoFn):  # type: ignore[misc]
    """A stateless DoFn after a stateful one, with bundle methods: doubles ``total``."""

    def start_bundle(self) -> None:
        self.pending: list[dict[str, Any]] = []

    def process(self, sample: dict[str, Any]) -> None:
        self.pending.append({**sample, "total": sample["total"] * 2})

    def finish_bundle(self) -> Iterator[Any]:
        for sample in self.pending:
            yield GlobalWindows.windowed_value(sample)


class Traced(beam.DoFn):  # type: ignore[misc]
    """Appends each lifecycle call (setup, start, process, finish, teardown) to a file of its
    own instance in ``folder``; passes its input on."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self.path: str | None = None

    def _log(self, event: str) -> None:
        assert self.path is not None, f"{event} before setup"
        with open(self.path, "a") as f:
            f.write(event + "\n")

    def setup(self) -> None:
        assert self.path is None, "setup twice on one instance"
        self.path = str(Path(self.folder) / f"{os.getpid()}-{uuid.uuid4().hex}.log")
        self._log("setup")

    def start_bundle(self) -> None:
        self._log("start")

    def process(self, value: Any) -> Iterator[Any]:
        self._log("process")
        yield value

    def finish_bundle(self) -> None:
        self._log("finish")

    def teardown(self) -> None:
        self._log("teardown")


def traces(folder: str | Path) -> list[list[str]]:
    """The lifecycle calls of each instance that ran, one list per instance (sorted)."""
    return sorted(p.read_text().split() for p in Path(folder).glob("*.log"))


class TracedTotal(Traced):
    """``Traced`` as a stateful DoFn (a bag of what it saw), for the lanes' back."""

    SEEN = BagStateSpec("seen", PickleCoder())

    def process(  # type: ignore[override]
        self, element: tuple[int, Any], seen: Any = beam.DoFn.StateParam(SEEN)
    ) -> Iterator[Any]:
        self._log("process")
        seen.add(1)
        yield element[1]


class EmitsFromStart(beam.DoFn):  # type: ignore[misc]
    """Wrong: ``start_bundle`` yields (Beam refuses it too)."""

    def start_bundle(self) -> Iterator[str]:
        yield "too early"

    def process(self, text: str) -> Iterator[str]:
        yield text


class PlainFinish(beam.DoFn):  # type: ignore[misc]
    """Wrong: ``finish_bundle`` yields a plain value, not a WindowedValue (Beam refuses it too)."""

    def process(self, text: str) -> None:
        pass

    def finish_bundle(self) -> Iterator[dict[str, Any]]:
        yield {"length": np.int64(0)}
