"""The stateless front of a lane's pipeline: decode raw records and run stateless DoFns on them."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

from zephon_flow.errors import DataError, StageError
from zephon_flow.operators.splits import Record, Source
from zephon_flow.runners.dofns import StatelessInvoker, dofn_errors

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
    """Sources' decoders, per-source stateless chains, then the chain common to all sources."""

    def __init__(
        self,
        sources: list[Source],
        source_chains: list[list[StatelessInvoker]],
        common: list[StatelessInvoker],
    ) -> None:
        self.sources = sources
        # Each source's full stateless chain, built once rather than per record.
        self.chains = [[*chain, *common] for chain in source_chains]

    def run_record(self, source_index: int, record: Record) -> list[Any]:
        source = self.sources[source_index]
        values = source.decode(record, source.operator_name)
        for step in self.chains[source_index]:
            if not values:
                break
            nxt: list[Any] = []
            where = f"on the record at {record.path} {record.where}, via {source.operator_name}"
            for value in values:
                with dofn_errors(step.label, where):
                    nxt.extend(step(value))
            values = nxt
        return values

    def run_chunk(self, chunk: Chunk) -> list[RecordResult] | Failure:
        """Outputs per record, or the first failure (never raises: failures travel as data)."""
        try:
            return [self._run_or_skip(i, rec) for i, rec in chunk]
        except Exception as exc:  # carried back to the consumer with the worker's traceback
            return Failure.of(exc)

    def _run_or_skip(self, source_index: int, record: Record) -> RecordResult:
        if self.sources[source_index].on_error != "skip":
            return self.run_record(source_index, record)
        try:
            return self.run_record(source_index, record)
        except DataError as exc:  # bad data only: any other exception is a bug and still raises
            return Skipped(str(exc))
