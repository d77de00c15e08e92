"""The contract by which an operator says which fields of its outputs a checkpoint can rebuild.

A checkpoint stores lists of like elements (a shuffle buffer of packed sequences, an open
window) as columns: one array per field, rows stacked. An operator whose outputs carry fields
that follow from others (``Pack``'s ``position_ids`` and ``segment_ids`` follow from where its
documents start) declares a ``DerivedFields`` (its DoFn's ``derived_fields``); the runner's
plan collects the declarations of a pipeline's operators (``Plan.derived_codecs``) and hands
them to the codec, with the format's own (``packed_segments.BUILTIN``). When a checkpoint is written, each
codec is offered the columns; one that recognises them returns the small per-row facts it
needs (``reduce``), the codec stores those instead of the derived fields, and on load the
same declaration, found by its name, rebuilds them (``rebuild``). ``reduce`` must only accept
columns that ``rebuild`` restores bit for bit (check it: the codec trusts the answer).

Nothing is registered at import: a reader is handed the codecs it may meet. The name is
written into checkpoints; renaming a declaration, or changing what ``rebuild`` computes, needs
a new name so older checkpoints keep their meaning.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Ragged:
    """A per-row column of varying length: ``values`` of all rows concatenated on axis 0, and
    ``lengths[i]`` the number of entries of row ``i``."""

    values: np.ndarray
    lengths: np.ndarray


#: A column: ``[rows, ...]`` stacked (every row the same shape), or ragged.
Column = np.ndarray | Ragged


@dataclass(frozen=True)
class Reduced:
    """What ``reduce`` keeps: per-row ``stored`` columns and the names of the fields dropped."""

    stored: dict[str, Column]
    derived: tuple[str, ...]


class DerivedFields(Protocol):
    """An operator's declaration of output fields that can be rebuilt from stored ones."""

    #: Stable name recorded in checkpoints (e.g. ``"pack.segments/1"``).
    name: str

    def reduce(self, columns: Mapping[str, Column]) -> Reduced | None:
        """The per-row facts from which ``rebuild`` recomputes some of ``columns`` bit for bit,
        or None when these columns are not this operator's outputs (or do not follow its rule)."""
        ...

    def rebuild(
        self, columns: Mapping[str, Column], stored: Mapping[str, Column], names: tuple[str, ...]
    ) -> dict[str, Column]:
        """The derived columns ``names`` (as ``reduce`` listed them), from the kept ``columns``
        and the ``stored`` facts; raises ``ValueError`` if the facts do not fit the columns."""
        ...


@dataclass(frozen=True)
class DerivedCodecs:
    """The derived-field codecs a checkpoint is written or read with, in the order they are
    offered the columns; at most one per name."""

    fields: tuple[DerivedFields, ...] = ()

    def __post_init__(self) -> None:
        seen: dict[str, DerivedFields] = {}
        for f in self.fields:
            if seen.get(f.name, f) is not f:
                raise ValueError(f"derived fields {f.name!r} are declared twice, by different objects")
            seen[f.name] = f

    def lookup(self, name: str) -> DerivedFields | None:
        return next((f for f in self.fields if f.name == name), None)

    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def with_fields(self, more: Iterable[DerivedFields]) -> DerivedCodecs:
        """These codecs and ``more`` (after them; one already here is not repeated)."""
        extra = [f for f in more if self.lookup(f.name) is not f]
        return DerivedCodecs((*self.fields, *extra)) if extra else self
