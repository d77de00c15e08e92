"""A tiny line-numbered source and small DoFns for the unit tests of a lane's parts.

``Lines`` reads a text file of one value per line, dealt in splits of ``per_split`` lines; a
line ``unreadable`` fails while reading (the rest of its split is lost with ``on_error="skip"``)
and a line ``bad`` fails while decoding (only that record is lost).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

from zephon_flow.core.errors import DataError
from zephon_flow.core.source import START, Record, Source, Split


def write_lines(path: Path, values: Sequence[object]) -> str:
    path.write_text("".join(f"{v}\n" for v in values), encoding="utf-8")
    return str(path)


class Lines(Source):
    """One record per line of a text file: payload the line, ``offset`` its line number."""

    def __init__(self, pattern: str, *, per_split: int, **kwargs: Any) -> None:
        super().__init__(pattern, **kwargs)
        self.per_split = per_split

    def _lines(self, path: str) -> list[str]:
        return Path(path).read_text(encoding="utf-8").splitlines()

    def make_splits(self, paths: Sequence[str], *, lanes: int) -> list[Split]:
        return [
            Split(path, start, min(start + self.per_split, len(self._lines(path))))
            for path in paths
            for start in range(0, len(self._lines(path)), self.per_split)
        ]

    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        lines = self._lines(split.path)
        for line in range(split.start if position == START else position, split.stop):
            if lines[line] == "unreadable":
                raise DataError(f"{self.operator_name}: {split.path} line {line}: cannot be read")
            yield line + 1, Record(lines[line], split.path, f"line {line}", line)

    def decode(self, record: Record, operator: str) -> list[Any]:
        if record.payload == "bad":
            raise DataError(f"{operator}: {record.path} {record.where}: not a number")
        return [int(record.payload)]


class Repeat(beam.DoFn):  # type: ignore[misc]
    """Stateless: ``n`` gives ``n % 3`` outputs ``(n, 0), (n, 1), ...`` (none for multiples of 3)."""

    def process(self, n: int) -> Iterator[tuple[int, int]]:
        for k in range(n % 3):
            yield (n, k)


class RunningCount(beam.DoFn):  # type: ignore[misc]
    """Stateful: tags each element with how many the lane's instance has seen before it."""

    SEEN = ReadModifyWriteStateSpec("seen", PickleCoder())

    def process(self, element: tuple[int, Any], seen: Any = beam.DoFn.StateParam(SEEN)) -> Iterator[Any]:
        _, value = element
        count = seen.read() or 0
        seen.write(count + 1)
        yield (count, value)
