"""The contract by which an operator says which fields of its outputs a checkpoint can rebuild.

A checkpoint stores lists of like elements (a shuffle buffer of packed sequences, an open
window) as columns: one array per field, rows stacked. An operator whose outputs carry fields
that follow from others (``Pack``'s ``position_ids`` and ``segment_ids`` follow from where its
documents start) declares a ``DerivedFields`` and registers it here. When a checkpoint is
written, each registered declaration is offered the columns; one that recognises them returns
the small per-row facts it needs (``reduce``), the codec stores those instead of the derived
fields, and on load the same declaration rebuilds them (``rebuild``). ``reduce`` must only
accept columns that ``rebuild`` restores bit for bit (check it: the codec trusts the answer).

The registry is keyed by a stable name written into checkpoints; renaming a declaration, or
changing what ``rebuild`` computes, needs a new name so older checkpoints keep their meaning.
"""

from __future__ import annotations

from collections.abc import Mapping
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


_REGISTRY: dict[str, DerivedFields] = {}


def register(fields: DerivedFields) -> DerivedFields:
    """Registers a declaration (once per name; registering the same object again is a no-op)."""
    known = _REGISTRY.get(fields.name)
    if known is not None and known is not fields:
        raise ValueError(f"derived fields {fields.name!r} are registered twice, by different objects")
    _REGISTRY[fields.name] = fields
    return fields


def registered() -> list[DerivedFields]:
    """Every declaration, in registration order."""
    return list(_REGISTRY.values())


def lookup(name: str) -> DerivedFields | None:
    return _REGISTRY.get(name)
