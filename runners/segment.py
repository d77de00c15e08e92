"""The stateless front of a lane's pipeline: decode raw records and run stateless DoFns on them."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, NoReturn

from zephon_flow.errors import DataError, StageError, ZephonError
from zephon_flow.operators.splits import Record, Source
from zephon_flow.runners.dofns import StatelessInvoker, dofn_errors

#: A unit of work for a backend: (source index, raw record) pairs, in lane order.
Chunk = list[tuple[int, Record]]


@dataclass(frozen=True)
class Failure:
    """An exception raised on a worker, carried back with its formatted traceback."""

    data_error: bool
    message: str
    worker_traceback: str

    @classmethod
    def of(cls, exc: BaseException, message: str | None = None) -> Failure:
        return cls(
            isinstance(exc, DataError),
            str(exc) if message is None else message,
            "".join(traceback.format_exception(exc)),
        )

    def reraise(self) -> None:
        text = f"{self.message}\n\n-- traceback on the worker --\n{self.worker_traceback}"
        if self.data_error:
            raise DataError(text)
        raise StageError(text)


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
        self.source_chains = source_chains
        self.common = common
        # Sources are labelled by now (the runner binds labels when it compiles the plan).
        self._names = [s.operator_name for s in sources]

    def _where(self, source_index: int, record: Record) -> str:
        return f"on the record at {record.path} {record.where}, via {self._names[source_index]}"

    def run_chunk(self, chunk: Chunk) -> list[list[Any]] | Failure:
        """Outputs per record, or the first failure (never raises: failures travel as data)."""
        try:
            sources, names = self.sources, self._names
            values = [sources[index].decode(record, names[index]) for index, record in chunk]
            for index, chain in enumerate(self.source_chains):
                if chain:
                    members = [k for k, (i, _) in enumerate(chunk) if i == index]
                    for step in chain:
                        self._stage(step, chunk, values, members)
            everyone = list(range(len(chunk)))
            for step in self.common:
                self._stage(step, chunk, values, everyone)
            return values
        except Exception as exc:  # carried back to the consumer with the worker's traceback
            return Failure.of(exc)

    def _stage(
        self, step: StatelessInvoker, chunk: Chunk, values: list[list[Any]], members: list[int]
    ) -> None:
        """Runs one DoFn on the values of the records ``members``, replacing them by its outputs."""
        live = [k for k in members if values[k]]
        if not live:
            return
        if not step.batched:
            for k in live:
                nxt: list[Any] = []
                try:
                    for value in values[k]:
                        nxt.extend(step(value))
                except Exception as exc:
                    _rethrow(step.label, self._where(*chunk[k]), exc)
                values[k] = nxt
            return
        flat = [v for k in live for v in values[k]]
        try:
            results = step.call_batch(flat)
        except Exception as exc:
            self._blame_record(step, chunk, values, live, exc)
        start = 0
        for k in live:
            stop = start + len(values[k])
            nxt = []
            for outputs in results[start:stop]:
                nxt.extend(outputs)
            values[k] = nxt
            start = stop

    def _blame_record(
        self, step: StatelessInvoker, chunk: Chunk, values: list[list[Any]], live: list[int], exc: Exception
    ) -> NoReturn:
        """A batched call failed: calls the DoFn again per record to name the record at fault."""
        if not isinstance(exc, ZephonError) or isinstance(exc, DataError):
            for k in live:
                try:
                    step.call_batch(values[k])
                except Exception as per_record:
                    _rethrow(step.label, self._where(*chunk[k]), per_record)
        first, last = chunk[live[0]][1], chunk[live[-1]][1]
        _rethrow(
            step.label,
            f"in a batch of {len(live)} records from {first.path} {first.where} to {last.path} {last.where}",
            exc,
        )


def _rethrow(label: str, where: str, exc: Exception) -> NoReturn:
    """Raises ``exc`` as ``dofn_errors`` names it: with the DoFn's label and the place."""
    with dofn_errors(label, where):
        raise exc
    raise AssertionError("unreachable")  # dofn_errors always re-raises
