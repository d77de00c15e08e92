"""Recipe state: a buffered sequence stored as where its tokens came from, rebuilt by re-reading.

A packed sequence (or an operator's open, incomplete one) is made of *pieces*: contiguous token
ranges of documents, each document the output of the stateless front for one source record.
In ``state_mode="recipe"`` a checkpoint keeps, per sequence, only

- ``docs``: the id of each piece's record (``(source index, split index, record offset)``, the
  ``zf.ProvenanceParam`` id), ``int64 [k, 3]``;
- ``lengths``: each piece's token count, ``int32 [k]``;
- ``head``: a 32-bit hash of the sequence's first ``HEAD`` tokens, to find a piece that
  neither starts nor ends its document (the middle of a long one: a rolling hash over the
  document finds where it can start) and to pass over wrong placements cheaply;
- ``digest``: an 8-byte digest of the whole value (every field, dtype and shape), so a rebuild
  that is not bit for bit the saved value is refused, never used.

On restore the records are re-read and the front re-run (``engine/recipe.py``); ``rebuild``
then places each piece in its document (at its start, at its end, or where ``head`` matches)
and accepts the first placement whose value has the saved digest.

An operator whose outputs (or open state) can be stored this way implements ``RecipeMaker``
(``Pack``); one that holds its inputs and emits them unchanged (``Shuffle``) names the state
values that hold them in ``recipe_elements``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from zephon_flow.core.errors import CorruptStateError, RecipeMismatchError, RecipeRefusedError, StateError

#: Tokens the ``head`` hash covers (fewer if the value is shorter): 32 make a match in the
#: wrong place unlikely even in code, whose short runs (indentation) repeat everywhere.
HEAD = 32
_MULT_INT = 0x9E3779B97F4A7C15  # odd: the polynomial hash's multiplier (mod 2**64)
_MULT = np.uint64(_MULT_INT)
_MASK = (1 << 64) - 1
#: Bytes of a value's digest: enough that a wrong rebuild passing it is not a practical risk.
DIGEST = 8
#: Placements tried per value before a rebuild gives up (a document of one repeated token can
#: match ``head`` everywhere; each try costs one value's digest).
MAX_TRIES = 4096
#: A document as the front gave it for one record: its outputs, as token arrays.
Outputs = list[np.ndarray]
#: A record id: (source index, split index, record offset).
DocKey = tuple[int, int, int]
#: Window hashes of documents by (id of the token array, window): valid while the arrays live.
WindowCache = dict[tuple[int, int], np.ndarray]
#: Maps one part of a state value (or its recipe) and the part's kind to its replacement.
Leaf = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Pieces:
    """A value laid out as pieces: their record ids, lengths and the concatenated tokens."""

    docs: np.ndarray  # int64 [k, 3]
    lengths: np.ndarray  # int32 [k]
    tokens: np.ndarray  # the value's tokens, pieces concatenated (no padding)


@runtime_checkable
class RecipeMaker(Protocol):
    """An operator whose outputs (``kind="sample"``) and state (other kinds, its own) are made
    of token pieces of documents from the front."""

    #: Names of its own state values made of pieces (e.g. ``("carry",)``), see ``recipe_state``.
    recipe_values: tuple[str, ...]

    def recipe_refusal(self) -> str | None:
        """Why this configuration's values cannot be stored as recipes (None: they can)."""
        ...

    def recipe_state(self, value: Any, leaf: Leaf) -> Any:
        """One of its ``recipe_values`` with every part made of pieces replaced by
        ``leaf(part, kind)``: the parts by their recipes at save, the recipes by the parts at
        restore (the same walk both ways)."""
        ...

    def recipe_pieces(self, value: Mapping[str, Any], kind: str) -> Pieces | None:
        """The pieces of an output sample or a state value; None if it is not one of this
        operator's (then it cannot be stored as a recipe)."""
        ...

    def recipe_value(self, tokens: np.ndarray, lengths: np.ndarray, docs: np.ndarray, kind: str) -> Any:
        """The sample or state value made of these pieces (the inverse of ``recipe_pieces``)."""
        ...


def digest(value: Any) -> np.ndarray:
    """The first ``DIGEST`` bytes of a sha256 over a value's fields (sorted), each with its
    dtype, shape and bytes (sha256: CPUs hash it in hardware, several times blake2b's speed,
    and every sequence in flight is hashed at each cold save and each restore)."""
    h = hashlib.sha256()
    if not isinstance(value, Mapping):
        raise StateError(f"a recipe value must be a mapping of arrays, found {type(value).__name__}")
    for key in sorted(value):
        array = np.ascontiguousarray(value[key])
        h.update(f"{key}|{array.dtype.str}|{array.shape}|".encode())
        h.update(array.reshape(-1).view(np.uint8).data)
    return np.frombuffer(h.digest()[:DIGEST], dtype=np.uint8).copy()


def encode(maker: RecipeMaker, value: Any, kind: str, where: str) -> dict[str, np.ndarray]:
    """The recipe of one sample or state value; refuses a value that is not made of pieces."""
    pieces = maker.recipe_pieces(value, kind) if isinstance(value, Mapping) else None
    if pieces is None:
        raise RecipeRefusedError(
            f"{where}: the value is not a sequence of document pieces as {type(maker).__name__} "
            f"makes them (an operator between changed it?), so it cannot be stored as a recipe; "
            f"use state_mode='compact'"
        )
    docs = np.asarray(pieces.docs, dtype=np.int64).reshape(-1, 3)
    if (docs < 0).any():
        raise RecipeRefusedError(
            f"{where}: a piece has no provenance (document id -1: made by a timer or an operator "
            f"that does not pass zf.ProvenanceParam), so it cannot be re-read; use "
            f"state_mode='compact'"
        )
    head = np.asarray(head_hash(np.asarray(pieces.tokens)), dtype=np.uint32)
    return {
        "docs": docs,
        "lengths": np.asarray(pieces.lengths, dtype=np.int32),
        "head": head,
        "digest": digest(value),
    }


def doc_keys(recipe: Mapping[str, Any], where: str) -> list[DocKey]:
    """The record ids a recipe needs, checked for form."""
    docs, lengths = _field(recipe, "docs", where), _field(recipe, "lengths", where)
    if docs.ndim != 2 or docs.shape[1] != 3 or lengths.shape != (docs.shape[0],):
        raise CorruptStateError(f"{where}: a recipe's docs {docs.shape} and lengths {lengths.shape} disagree")
    if (docs < 0).any() or (lengths < 1).any():
        raise CorruptStateError(f"{where}: a recipe names document -1 or a piece of no tokens")
    return [(int(a), int(b), int(c)) for a, b, c in docs.tolist()]


def _field(recipe: Mapping[str, Any], key: str, where: str) -> np.ndarray:
    if not isinstance(recipe, Mapping) or key not in recipe:
        raise CorruptStateError(f"{where}: a recipe is missing {key!r}: the checkpoint is corrupt")
    value = recipe[key]
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu":
        raise CorruptStateError(f"{where}: a recipe's {key!r} is not an integer array")
    return value


def rebuild(
    maker: RecipeMaker,
    recipe: Mapping[str, Any],
    kind: str,
    documents: Mapping[DocKey, Outputs],
    where: str,
    hashes: WindowCache | None = None,
    places: Mapping[DocKey, str] | None = None,
) -> Any:
    """The value a recipe describes, from its documents' front outputs; refuses (naming the
    documents, by ``places`` where given: file and offset) if no placement of its pieces gives
    the saved digest. ``hashes`` keeps the documents' window hashes between calls (many pieces
    of a long document are searched)."""
    keys = doc_keys(recipe, where)
    lengths = _field(recipe, "lengths", where).astype(np.int64)
    head = _field(recipe, "head", where)
    saved = _field(recipe, "digest", where)
    docs = _field(recipe, "docs", where).astype(np.int64)
    if head.shape != ():
        raise CorruptStateError(f"{where}: a recipe's head should be one hash, found shape {head.shape}")
    saved_head = int(head)
    count = len(keys)
    if count == 1:  # a lone piece: candidates one by one (the search only if the ends fail)
        placements: Iterator[tuple[tuple[int, int], ...]] = (
            (p,) for p in _lone(documents[keys[0]], int(lengths[0]), saved_head, hashes)
        )
    else:
        choices = [
            _placements(documents[key], int(n), i, count)
            for i, (key, n) in enumerate(zip(keys, lengths, strict=True))
        ]
        placements = itertools.product(*choices)
    for placement in itertools.islice(placements, MAX_TRIES):
        parts = [
            documents[key][j][s : s + n] for key, (j, s), n in zip(keys, placement, lengths, strict=True)
        ]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        if head_hash(tokens) != saved_head:
            continue  # cheap: most wrong placements differ at the start
        value = maker.recipe_value(tokens, lengths.astype(np.int32), docs, kind)
        if np.array_equal(digest(value), saved):
            return value
    places = places or {}
    named = ", ".join(f"{places[k]} {k}" if k in places else f"{k}" for k in dict.fromkeys(keys)) or "none"
    raise RecipeMismatchError(
        f"{where}: re-reading the documents {named} (ids: source index, split, offset) and re-running the "
        f"front does not give the saved value: the data files, the tokenizer or a stateless DoFn "
        f"changed since the checkpoint, or the front is not a pure function of the record. Resume "
        f"from a checkpoint written with state_mode='compact' (the default)"
    )


def _placements(outputs: Outputs, n: int, index: int, count: int) -> list[tuple[int, int]]:
    """Where piece ``index`` of ``count > 1`` (``n`` tokens) may lie in its record's outputs,
    ``(output, start)``: a piece other than the last ends its document (it would have gone on
    otherwise); the last one starts its document or ends it."""
    found: list[tuple[int, int]] = []
    for j, tokens in enumerate(outputs):
        if tokens.size < n:
            continue
        ends = (j, tokens.size - n)
        found.extend([ends] if index < count - 1 else dict.fromkeys([(j, 0), ends]))
    return found


def _lone(outputs: Outputs, n: int, head: int, hashes: WindowCache | None) -> Iterator[tuple[int, int]]:
    """Where a value's only piece may lie: at the start or the end of an output, else inside
    one, where the ``head`` hash matches (the middle of a long document)."""
    ends = _placements(outputs, n, 0, 1)
    yield from ends
    for j, tokens in enumerate(outputs):
        yield from (p for p in _search(tokens, n, head, j, hashes) if p not in ends)


def head_hash(tokens: np.ndarray) -> int:
    """The 32-bit hash of the first ``HEAD`` tokens (all of them if fewer): the value
    ``_window_hashes`` gives for a window at 0, computed on Python ints (one short window)."""
    h = 0
    for t in tokens[:HEAD].astype(np.uint64).tolist():
        h = (h * _MULT_INT + t) & _MASK
    return h >> 32


def _window_hashes(tokens: np.ndarray, width: int) -> np.ndarray:
    """The hash of ``tokens[s:s+width]`` for every start ``s`` (a polynomial over the tokens,
    mod 2**64, its high 32 bits), all starts at once."""
    count = tokens.size - width + 1
    values = tokens.astype(np.uint64)
    h = np.zeros(count, dtype=np.uint64)
    for i in range(width):
        h *= _MULT
        h += values[i : i + count]
    out: np.ndarray = (h >> np.uint64(32)).astype(np.uint32)
    return out


def _search(
    tokens: np.ndarray, n: int, head: int, j: int, hashes: WindowCache | None
) -> Iterator[tuple[int, int]]:
    """Starts ``s`` where ``n`` tokens fit and the first ``HEAD`` of them have the ``head`` hash."""
    last = tokens.size - n
    if last < 0:
        return
    width = min(HEAD, n)
    key = (id(tokens), width)
    every = None if hashes is None else hashes.get(key)
    if every is None:
        every = _window_hashes(tokens, width)
        if hashes is not None:
            hashes[key] = every
    found = np.flatnonzero(every[: last + 1] == head)
    for s in found[:MAX_TRIES].tolist():
        yield (j, int(s))


def needed(recipes: Sequence[Mapping[str, Any]], where: str) -> set[DocKey]:
    """Every record id the recipes name."""
    out: set[DocKey] = set()
    for i, r in enumerate(recipes):
        out.update(doc_keys(r, f"{where}[{i}]"))
    return out
