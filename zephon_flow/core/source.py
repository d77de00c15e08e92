"""Sources' common contract: splits, records, globs; every record in exactly one split.

A source lists its data as *splits* (a byte range of a file, a run of rows, ...), each with a
cost; ``runners/dealing.py`` deals them to lanes pass by pass. **The contract**: within pass
``e`` of a source, each record is delivered to exactly one lane, once, and a lane starts pass
``e + 1`` only after its own share of pass ``e``. A source keeps its part of it by listing every
record in exactly one split (``make_splits``) and reading a split from any position it handed
out (``read_split``), the same records in the same order every time.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import apache_beam as beam

from zephon_flow.core import files
from zephon_flow.core.errors import DataError, SpecError

#: A position inside one split: an integer whose meaning is the source's (a byte offset, a
#: record number). ``START`` means "at the beginning of the split".
START = -1

#: What a source does with a record it cannot read or decode.
ON_ERROR = ("raise", "skip")


@dataclass(frozen=True)
class Split:
    """One unit of dealing: ``path`` and a source-defined ``[start, stop)`` range inside it.

    ``weight`` is the split's cost in the source's own unit (bytes for byte ranges and
    compressed files, rows for row ranges, samples for tar runs), used to balance the lanes'
    shares of a pass; 0 means ``max(1, stop - start)``.
    """

    path: str
    start: int
    stop: int
    weight: int = 0

    @property
    def cost(self) -> int:
        """The weight the dealing balances (at least 1)."""
        return max(1, self.weight or (self.stop - self.start))


class Record(NamedTuple):
    """One raw record as read by the lane's feed; decoded later by ``Source.decode``. (A named
    tuple: one is made per record and pickled to a worker; it is made in a third of a frozen
    dataclass's time and pickled in half.)"""

    payload: Any
    path: str
    where: str  # human-readable location for errors: "byte 1234", "line 7", "row group 2 row 5"
    #: Where the record is, as the source counts it: the byte offset of a plain JSONL line,
    #: the decompressed byte offset of a compressed one, the file's row for Parquet and Arrow,
    #: the sample number in a tar shard, the file's number in the glob for text files. With the
    #: source and the split index it identifies the document in provenance.
    offset: int


def expand_glob(pattern: str, *, operator: str) -> list[str]:
    """The files matching ``pattern``, sorted (local or remote, see ``files``); refuses a
    pattern that matches nothing."""
    return files.expand_glob(pattern, operator=operator)


def relative_name(path: str, pattern: str) -> str:
    """The path relative to the fixed (non-wildcard) directory prefix of ``pattern``."""
    return files.relative_name(path, pattern)


class Source(beam.PTransform):  # type: ignore[misc]
    """Base of zephon-flow's sources; the deterministic runner knows them by their role.

    A subclass implements ``make_splits`` (deterministic order), ``read_split`` (runs in the
    lane's feed thread: raw records, cheap) and ``decode`` (runs on the stateless backend, in
    parallel: parse, validate, extract). Errors name the file, the location and the operator.
    """

    #: How the deterministic runner knows a source (``zephon_flow.core.roles``).
    zephon_role = "source"
    #: Whether ``read_split(split, record.offset)`` yields that record first (a record's offset
    #: is a position to read from). Recipe state (``state_mode="recipe"``) re-reads buffered
    #: documents so and refuses a pipeline with a source that does not declare it.
    rereads_offsets = False

    def __init__(
        self,
        pattern: str,
        *,
        epochs: int | None = None,
        on_error: str = "raise",
        label: str | None = None,
    ) -> None:
        super().__init__(label)
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise SpecError(f"{type(self).__name__}: epochs must be a positive integer or None")
        if on_error not in ON_ERROR:
            raise SpecError(f"{type(self).__name__}: on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.pattern = pattern
        self.epochs = epochs
        #: ``"raise"``: a ``DataError`` in reading or decoding a record stops the lane.
        #: ``"skip"``: the runner drops that record (or, for an error while reading, the rest
        #: of its split), counts it in the lane state and reports it.
        self.on_error = on_error
        self._paths: list[str] | None = None
        self._splits: dict[int, list[Split]] = {}

    # -- what a subclass provides ------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int) -> list[Split]:
        """The source's splits, in a deterministic order, fine enough for ``lanes`` lanes to
        share a pass evenly where the data allows (several splits per lane)."""
        raise NotImplementedError

    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        """Yields ``(position_after, record)`` from ``position`` (or ``START``) to the split's end."""
        raise NotImplementedError

    def decode(self, record: Record, operator: str) -> list[Any]:
        """Turns one raw record into zero or more elements (an empty document gives none)."""
        raise NotImplementedError

    def read_split_in_pass(
        self, split: Split, position: int, pass_index: int
    ) -> Iterator[tuple[int, Record]]:
        """``read_split`` in pass ``pass_index`` of the source (what a lane's feed calls). A
        source whose records depend on the pass (``ReadVideo(window="random")`` draws a new
        clip window per pass) overrides it; the same records for the same arguments, always."""
        return self.read_split(split, position)

    def params(self) -> dict[str, Any]:
        """Parameters that change the data produced (part of the pipeline fingerprint)."""
        return {"pattern": self.pattern, "epochs": self.epochs, "on_error": self.on_error}

    # -- shared ------------------------------------------------------------------------
    @property
    def operator_name(self) -> str:
        """How errors name this source: its class and the label it was applied with."""
        return f"{type(self).__name__}({getattr(self, '_zf_label', None) or self.label!r})"

    def bind_label(self, label: str) -> None:
        """Called by the runner with the label the transform was applied under."""
        self._zf_label = label

    def __getstate__(self) -> dict[str, Any]:
        # Worker processes need the parameters and the split table, never the pipeline.
        state = dict(self.__dict__)
        state["pipeline"] = None
        return state

    def paths(self) -> list[str]:
        if self._paths is None:
            self._paths = expand_glob(self.pattern, operator=self.operator_name)
        return self._paths

    def splits(self, lanes: int = 1) -> list[Split]:
        """The split table for a pipeline of ``lanes`` lanes (listed once per lane count)."""
        table = self._splits.get(lanes)
        if table is None:
            table = self.make_splits(self.paths(), lanes=lanes)
            if not table:
                raise DataError(f"{self.operator_name}: the files of {self.pattern!r} hold no data")
            self._splits = {**self._splits, lanes: table}  # assigned whole: feeds list concurrently
        return table

    def data_files(self) -> list[tuple[str, int]]:
        """(name relative to the glob root, size in bytes) of every file read."""
        return [(relative_name(p, self.pattern), _size(p, self.operator_name)) for p in self.paths()]

    def data_identity(self, lanes: int, dealing_version: int) -> list[Any]:
        """What the fingerprint's data part digests: every file (relative name, size), the
        split plan for ``lanes`` lanes and the dealing rule's version, so a change of the data,
        of how it is split or of how splits are dealt refuses old checkpoints by name."""
        plan = [[relative_name(s.path, self.pattern), s.start, s.stop, s.cost] for s in self.splits(lanes)]
        return [self.data_files(), plan, dealing_version]

    def expand(self, pbegin: Any) -> Any:
        # On Beam's own runners: read every split once, in order (a finite, undealt stream). The
        # output type is given (Any, what Beam infers) so that building the pipeline does not
        # run Beam's bytecode inference over the reader (about 0.1 s of every Loader's start).
        read_all = beam.FlatMap(lambda _: self._read_all()).with_output_types(Any)
        return pbegin | "Impulse" >> beam.Impulse() | "ReadAll" >> read_all

    def _read_all(self) -> Iterator[Any]:
        for split in self.splits():
            for _, record in self.read_split(split, START):
                yield from self.decode(record, self.operator_name)


def _size(path: str, operator: str) -> int:
    return files.size(path, operator=operator)
