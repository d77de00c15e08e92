"""The stateless front of a lane's pipeline: decode raw records and run stateless DoFns on them."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from zephon_flow.core.errors import ChunkTimeoutError, DataError, StageError, WorkerLostError, ZephonError
from zephon_flow.core.source import Record, Source
from zephon_flow.runners.dofns import StatelessInvoker, dofn_errors, fuse

#: A unit of work for a backend: (source index, raw record) pairs, in lane order.
Chunk = list[tuple[int, Record]]


@dataclass(frozen=True)
class Skipped:
    """A record dropped because its source has ``on_error="skip"``: the ``DataError``'s message."""

    message: str


#: What one record gives: its outputs, or the note that it was skipped.
RecordResult = list[Any] | Skipped


@dataclass(frozen=True)
class Failure:
    """An exception raised on a worker, carried back with its formatted traceback.

    ``error`` is the class to re-raise when it is more precise than ``DataError``/``StageError``
    (a lost worker, a chunk past its deadline); it must take the message as its one argument.
    ``pid`` is the process it was raised in: its traceback is labelled as the worker's only
    when that is another process (not on the inline or threads backend).
    """

    data_error: bool
    message: str
    worker_traceback: str
    error: type[ZephonError] | None = None
    pid: int = 0

    @classmethod
    def of(cls, exc: BaseException, message: str | None = None) -> Failure:
        # A lost worker or a missed deadline is found by the parent: no worker traceback.
        precise: type[ZephonError] | None = None
        if isinstance(exc, WorkerLostError | ChunkTimeoutError):
            precise = type(exc)
        return cls(
            isinstance(exc, DataError),
            str(exc) if message is None else message,
            "" if precise else "".join(traceback.format_exception(exc)),
            precise,
            os.getpid(),
        )

    def reraise(self) -> NoReturn:
        text = self.message
        if self.worker_traceback:
            where = " on the worker" if self.pid not in (0, os.getpid()) else ""
            text = f"{text}\n\n-- traceback{where} --\n{self.worker_traceback}"
        if self.error is not None:
            raise self.error(text)
        if self.data_error:
            raise DataError(text)
        raise StageError(text)


#: Told where a chunk's run is: (stage, first record, last record) of the chunk. Stage 0 is the
#: sources' decode, stage ``n`` the ``n``-th stateless DoFn (see ``FrontSegment.describe``).
Progress = Callable[[int, int, int], None]


def _no_progress(stage: int, first: int, last: int) -> None:
    pass


class FrontSegment:
    """Sources' decoders, per-source stateless chains, then the chain common to all sources.

    A chunk runs stage by stage: each record's values go through one DoFn, then the next. A
    DoFn that defines zephon-flow's ``process_batch`` (see ``StatelessInvoker``) is called
    once per chunk and stage with the values of all the chunk's records at that stage, and its
    per-element output lists are regrouped by record; others are called per element. Either
    way the result is the outputs of each record, in order, which the lane's cursor needs.
    """

    def __init__(
        self,
        sources: list[Source],
        source_chains: list[list[StatelessInvoker]],
        common: list[StatelessInvoker],
    ) -> None:
        self.sources = sources
        # Neighbours that run faster as one DoFn are fused (dofns.fuse): same outputs.
        self.source_chains = [fuse(chain) for chain in source_chains]
        self.common = fuse(common)
        # Sources are labelled by now (the runner binds labels when it compiles the plan).
        self._names = [s.operator_name for s in sources]
        #: Stages in run order (stage n is ``stages[n - 1]``): per-source chains, then common.
        self.stages = [step for chain in self.source_chains for step in chain] + list(self.common)

    def teardown(self) -> None:
        """``teardown()`` of each stage's DoFn that was set up here (its executor is ending)."""
        for step in self.stages:
            step.teardown()

    def describe(self, chunk: Chunk, stage: int, first: int, last: int) -> str:
        """Names the operator and the record(s) a ``Progress`` report points at, for errors
        about a chunk whose worker died or hung."""
        if not chunk:
            return "before its first record"
        first, last = (min(max(k, 0), len(chunk) - 1) for k in (first, last))
        if stage <= 0 or stage > len(self.stages):
            index, record = chunk[first]
            return f"in {self._names[index]}'s decode of the record at {record.path} {record.where}"
        label = self.stages[stage - 1].label
        if first == last:
            return f"in DoFn {label!r} {self._where(*chunk[first])}"
        a, b = chunk[first][1], chunk[last][1]
        return (
            f"in DoFn {label!r} on a batch of {last - first + 1} records from {a.path} {a.where} "
            f"to {b.path} {b.where}"
        )

    def _where(self, source_index: int, record: Record) -> str:
        return f"on the record at {record.path} {record.where}, via {self._names[source_index]}"

    def run_chunk(self, chunk: Chunk, progress: Progress = _no_progress) -> list[RecordResult] | Failure:
        """Outputs per record, or the first failure (never raises: failures travel as data).

        ``progress`` is told each stage and record before it runs, so a watcher can name the
        DoFn and the record of a call that hangs or kills its process.
        """
        try:
            values: list[RecordResult] = []
            for k, (index, record) in enumerate(chunk):
                progress(0, k, k)
                values.append(self._decode(index, record))
            stage = 0
            for index, chain in enumerate(self.source_chains):
                if chain:
                    members = [k for k, (i, _) in enumerate(chunk) if i == index]
                    for step in chain:
                        stage += 1
                        self._stage(step, stage, chunk, values, members, progress)
            everyone = list(range(len(chunk)))
            for step in self.common:
                stage += 1
                self._stage(step, stage, chunk, values, everyone, progress)
            return values
        except Exception as exc:  # carried back to the consumer with the worker's traceback
            return Failure.of(exc)

    def _decode(self, index: int, record: Record) -> RecordResult:
        try:
            return self.sources[index].decode(record, self._names[index])
        except DataError as exc:
            if self.sources[index].on_error != "skip":
                raise
            return Skipped(str(exc))

    def _guarded(self, step: StatelessInvoker, chunk: Chunk, k: int, run: Any) -> RecordResult:
        """``run()`` for record ``k``, its error named; a data error of a skipping source skips it."""
        try:
            try:
                outputs: list[Any] = run()
                return outputs
            except Exception as exc:
                _rethrow(step.label_of(exc), self._where(*chunk[k]), exc)
        except DataError as named:  # bad data only: any other exception is a bug and still raises
            if self.sources[chunk[k][0]].on_error != "skip":
                raise
            return Skipped(str(named))

    def _stage(
        self,
        step: StatelessInvoker,
        stage: int,
        chunk: Chunk,
        values: list[RecordResult],
        members: list[int],
        progress: Progress,
    ) -> None:
        """Runs one DoFn on the values of the records ``members``, replacing them by its outputs."""
        live = [k for k in members if not isinstance(values[k], Skipped) and values[k]]
        if not live:
            return
        if not step.batched:
            for k in live:
                progress(stage, k, k)
                inputs = values[k]
                assert not isinstance(inputs, Skipped)
                values[k] = self._guarded(step, chunk, k, lambda inputs=inputs: _per_element(step, inputs))
            return
        flat = [v for k in live for v in values[k]]  # type: ignore[union-attr]
        progress(stage, live[0], live[-1])
        try:
            results = step.call_batch(flat)
        except Exception as exc:
            self._per_record(step, stage, chunk, values, live, exc, progress)
            return
        if len(flat) == len(live):  # one value per record, the common case: no regrouping
            for k, outputs in zip(live, results, strict=True):
                values[k] = outputs
            return
        start = 0
        for k in live:
            stop = start + len(values[k])  # type: ignore[arg-type]
            nxt = []
            for outputs in results[start:stop]:
                nxt.extend(outputs)
            values[k] = nxt
            start = stop

    def _per_record(
        self,
        step: StatelessInvoker,
        stage: int,
        chunk: Chunk,
        values: list[RecordResult],
        live: list[int],
        exc: Exception,
        progress: Progress,
    ) -> None:
        """A batched call failed: calls the DoFn again per record, to name the record at fault
        (or skip it, if its source skips bad data)."""
        if isinstance(exc, ZephonError) and not isinstance(exc, DataError):
            first, last = chunk[live[0]][1], chunk[live[-1]][1]
            _rethrow(
                step.label,
                f"in a batch of {len(live)} records from {first.path} {first.where} to {last.path} {last.where}",
                exc,
            )
        for k in live:
            progress(stage, k, k)
            inputs = values[k]
            assert not isinstance(inputs, Skipped)
            values[k] = self._guarded(step, chunk, k, lambda inputs=inputs: _flatten(step.call_batch(inputs)))


def _per_element(step: StatelessInvoker, inputs: list[Any]) -> list[Any]:
    out: list[Any] = []
    for value in inputs:
        out.extend(step(value))
    return out


def _flatten(results: list[list[Any]]) -> list[Any]:
    return [v for outputs in results for v in outputs]


def _rethrow(label: str, where: str, exc: Exception) -> NoReturn:
    """Raises ``exc`` as ``dofn_errors`` names it: with the DoFn's label and the place."""
    with dofn_errors(label, where):
        raise exc
    raise AssertionError("unreachable")  # dofn_errors always re-raises
