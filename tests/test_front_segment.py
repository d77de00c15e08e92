"""Unit tests of the stateless front of a lane (``FrontSegment``): decode, per-source chains, the
common chain, batched DoFns, skips, and failures carried back as data with the worker's traceback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from lane_parts import Lines, Repeat, write_lines

from zephon_flow.core.errors import DataError, StageError
from zephon_flow.core.source import Record
from zephon_flow.runners.dofns import StatelessInvoker
from zephon_flow.runners.segment import Chunk, Failure, FrontSegment, Skipped


class Tag(beam.DoFn):  # type: ignore[misc]
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def process(self, value: Any) -> Iterator[Any]:
        yield (self.tag, value)


class BatchedSquare(beam.DoFn):  # type: ignore[misc]
    """zephon-flow's batched path: one call per chunk and stage, one output list per element."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def process_batch(self, values: list[int]) -> list[list[int]]:
        self.calls.append(len(values))
        if 13 in values:
            raise DataError("thirteen is unlucky")
        return [[v * v] for v in values]


class Square(beam.DoFn):  # type: ignore[misc]
    def process(self, value: int) -> Iterator[int]:
        if value == 13:
            raise DataError("thirteen is unlucky")
        yield value * value


class Crash(beam.DoFn):  # type: ignore[misc]
    def process(self, value: int) -> Iterator[int]:
        if value == 2:
            raise KeyError("no such thing")
        yield value


def _lines(tmp_path: Path, name: str, values: list[object], **kwargs: Any) -> Lines:
    source = Lines(write_lines(tmp_path / f"{name}.txt", values), per_split=100, **kwargs)
    source.bind_label(name)
    return source


def _chunk(*records: tuple[int, Lines, int]) -> Chunk:
    """(source index, source, line) triples as the raw records a lane's feed would send."""
    chunk: Chunk = []
    for index, source, line in records:
        path = source.paths()[0]
        payload = Path(path).read_text(encoding="utf-8").splitlines()[line]
        chunk.append((index, Record(payload, path, f"line {line}", line)))
    return chunk


def test_each_record_gets_its_source_chain_then_the_common_chain(tmp_path: Path) -> None:
    a, b = _lines(tmp_path, "a", [1, 2, 3, 4]), _lines(tmp_path, "b", [5, 6])
    segment = FrontSegment(
        [a, b],
        [[StatelessInvoker("rep", Repeat())], [StatelessInvoker("tag b", Tag("b"))]],
        [StatelessInvoker("tag all", Tag("all"))],
    )
    result = segment.run_chunk(_chunk((0, a, 0), (1, b, 0), (0, a, 2), (0, a, 1), (1, b, 1)))
    assert result == [
        [("all", (1, 0))],  # 1 % 3 == 1 output
        [("all", ("b", 5))],  # source b's chain only
        [],  # 3 % 3 == 0 outputs: nothing reaches the common chain
        [("all", (2, 0)), ("all", (2, 1))],
        [("all", ("b", 6))],
    ]


def test_a_batched_dofn_runs_once_per_chunk_and_stage_with_the_same_outputs(tmp_path: Path) -> None:
    source = _lines(tmp_path, "n", list(range(8)))
    batched = BatchedSquare()
    chunk = _chunk(*((0, source, i) for i in range(8)))
    per_element = FrontSegment([source], [[]], [StatelessInvoker("sq", Square())]).run_chunk(chunk)
    at_once = FrontSegment([source], [[]], [StatelessInvoker("sq", batched)]).run_chunk(chunk)
    assert at_once == per_element == [[i * i] for i in range(8)]
    assert batched.calls == [8]


class BatchedCode(beam.DoFn):  # type: ignore[misc]
    """Batched: ``(n, k)`` becomes ``10 * n + k``, and ``(n, 1)`` also gives ``-n``."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def process_batch(self, values: list[tuple[int, int]]) -> list[list[int]]:
        self.calls.append(len(values))
        return [[10 * n + k] + ([-n] if k == 1 else []) for n, k in values]


def test_a_batched_dofn_after_a_fan_out_regroups_its_outputs_by_record(tmp_path: Path) -> None:
    source = _lines(tmp_path, "n", [1, 2, 3, 5])
    batched = BatchedCode()
    segment = FrontSegment(
        [source], [[StatelessInvoker("rep", Repeat())]], [StatelessInvoker("code", batched)]
    )
    result = segment.run_chunk(_chunk(*((0, source, i) for i in range(4))))
    assert result == [[10], [20, 21, -2], [], [50, 51, -5]]
    assert batched.calls == [5]  # the 5 values of the 3 records with any, in one call


def test_a_failed_batch_is_retried_per_record_and_a_skipping_source_drops_only_the_bad_one(
    tmp_path: Path,
) -> None:
    source = _lines(tmp_path, "n", [12, 13, 14], on_error="skip")
    batched = BatchedSquare()
    segment = FrontSegment([source], [[]], [StatelessInvoker("sq", batched)])
    result = segment.run_chunk(_chunk((0, source, 0), (0, source, 1), (0, source, 2)))
    assert result == [
        [144],
        Skipped(
            f"thirteen is unlucky (DoFn 'sq', on the record at {tmp_path / 'n.txt'} line 1, via Lines('n'))"
        ),
        [196],
    ]
    assert batched.calls == [3, 1, 1, 1]  # the batch, then each record alone


def test_a_data_error_of_a_raising_source_comes_back_as_a_failure_naming_the_record(tmp_path: Path) -> None:
    source = _lines(tmp_path, "n", [12, 13, 14])
    segment = FrontSegment([source], [[]], [StatelessInvoker("sq", Square())])
    result = segment.run_chunk(_chunk((0, source, 0), (0, source, 1)))
    assert isinstance(result, Failure) and result.data_error
    assert result.message == (
        f"thirteen is unlucky (DoFn 'sq', on the record at {tmp_path / 'n.txt'} line 1, via Lines('n'))"
    )
    with pytest.raises(DataError) as info:
        result.reraise()
    assert str(info.value).startswith(result.message + "\n\n-- traceback --\n")  # raised in this process
    assert 'raise DataError("thirteen is unlucky")' in str(info.value)


def test_a_decode_error_skips_or_fails_by_the_source_setting(tmp_path: Path) -> None:
    values: list[object] = [1, "bad", 3]
    skipping = _lines(tmp_path, "skip", values, on_error="skip")
    raising = _lines(tmp_path, "raise", values)
    chain = [StatelessInvoker("tag", Tag("t"))]
    got = FrontSegment([skipping], [[]], chain).run_chunk(_chunk(*((0, skipping, i) for i in range(3))))
    bad = f"Lines('skip'): {tmp_path / 'skip.txt'} line 1: not a number"
    assert got == [[("t", 1)], Skipped(bad), [("t", 3)]]
    failed = FrontSegment([raising], [[]], chain).run_chunk(_chunk(*((0, raising, i) for i in range(3))))
    assert isinstance(failed, Failure) and failed.data_error
    assert failed.message == f"Lines('raise'): {tmp_path / 'raise.txt'} line 1: not a number"


def test_a_bug_in_a_dofn_is_a_stage_error_even_for_a_skipping_source(tmp_path: Path) -> None:
    source = _lines(tmp_path, "n", [1, 2, 3], on_error="skip")
    result = FrontSegment([source], [[]], [StatelessInvoker("crash", Crash())]).run_chunk(
        _chunk(*((0, source, i) for i in range(3)))
    )
    assert isinstance(result, Failure) and not result.data_error
    assert result.message.startswith("DoFn 'crash' raised KeyError: 'no such thing'")
    assert f"{tmp_path / 'n.txt'} line 1" in result.message
    with pytest.raises(StageError, match="-- traceback --"):
        result.reraise()
    assert "in process" in result.worker_traceback and "KeyError" in result.worker_traceback
