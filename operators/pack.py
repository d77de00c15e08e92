"""``Pack``: token arrays into fixed-length sequences, by concatenation or best-fit bins (stateful)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.coders import PickleCoder
from apache_beam.transforms.userstate import (
    ReadModifyWriteStateSpec,
    TimeDomain,
    TimerSpec,
    on_timer,
)
from apache_beam.utils.timestamp import MAX_TIMESTAMP

from zephon_flow.core import recipe
from zephon_flow.core.checkpoint.packed_segments import IGNORE, PACKED_SEGMENTS
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.markers import ProvenanceParam
from zephon_flow.operators import _best_fit

_EMPTY = np.zeros(0, dtype=np.int32)
_NO_DOC = np.full(3, -1, dtype=np.int64)
_NO_DOCS = np.zeros((0, 3), dtype=np.int64)
STRATEGIES = ("concat", "best_fit")
#: Why a ``(key, value)`` pair is refused (a Beam user's keying before a stateful DoFn).
KEYED = (
    "Pack: an element is a (key, value) pair, not token ids: zephon-flow keys every stateful "
    "DoFn by lane itself (Pack receives (lane, value) and keeps its state per lane), so do not "
    "key its input: give Pack the token arrays themselves"
)
#: The fields of ``concat``'s open sequence (the ``carry`` state), and of its earlier form.
_CARRY_KEYS = {"pieces", "docs"}
_OLD_CARRY_KEYS = {"ids", "pos", "seg", "docs"}


@lru_cache(maxsize=8)
def _counting(width: int) -> tuple[np.ndarray, np.ndarray]:
    """``0..width-1`` and ``width`` zeros (int32), made once per width and read-only: a
    sequence that is one piece takes its ``position_ids`` and ``segment_ids`` as views of them
    (two thirds of the sequences on text whose documents are mostly longer than ``seq_len``),
    and the positions of a sequence of several pieces are joined from slices of the first."""
    pos, seg = np.arange(width, dtype=np.int32), np.zeros(width, dtype=np.int32)
    pos.flags.writeable = seg.flags.writeable = False
    return pos, seg


def _open(held: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``concat``'s open sequence as its pieces and their documents' ids (one ``[3]`` row each).

    The carry holds ``{"pieces", "docs"}`` (``_CARRY_KEYS``). Checkpoints of earlier versions
    hold the sequence's arrays ``{"ids", "pos", "seg", "docs"}`` (``_OLD_CARRY_KEYS``); those are
    cut where the segment changes, so they resume with the same outputs.
    """
    if held is None:
        return [], []
    if "pieces" in held:
        return held["pieces"], held["docs"]
    ids, seg = held["ids"], held["seg"]
    if not ids.size:
        return [], []
    return np.split(ids, np.flatnonzero(np.diff(seg)) + 1), list(held["docs"])


def _joined(pieces: list[np.ndarray], docs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An open sequence's pieces as one sequence: its documents' ids ``[k, 3]``, the pieces'
    lengths (int32) and their ids in one new array (a copy even of one piece: never the
    state's own)."""
    table = np.array(docs, dtype=np.int64) if docs else _NO_DOCS  # np.stack is slower
    lens = np.array([p.size for p in pieces], dtype=np.int32)
    return table, lens, np.concatenate(pieces) if pieces else _EMPTY


class Pack(beam.DoFn):  # type: ignore[misc]
    """Packs documents (int arrays of ids) into sequences of exactly ``seq_len`` tokens.

    Each output is ``{"input_ids", "position_ids", "segment_ids"}`` (int32, length ``seq_len``).
    ``position_ids`` restart at 0 at each document and at the start of each piece of a document
    that was cut; ``segment_ids`` number the pieces inside a sequence from 0, so trainers can
    mask attention across documents. Padding is ``pad_id`` with position 0 and segment id -1, so
    the padding of any batch is ``(batch["segment_ids"] == -1).sum()``. Like every Beam
    element, an output must not be changed in place: the ``position_ids`` and ``segment_ids``
    of a sequence that is a single piece are read-only views of arrays all such sequences share
    (copy one to change it; batches are always new arrays).

    ``strategy="concat"`` (the default) cuts the stream of documents every ``seq_len`` tokens:
    no padding except the last sequence of a finite input, but documents are cut at sequence
    boundaries and continue in the next sequence. The carry (an incomplete sequence) is the
    lane state.

    ``strategy="best_fit"`` cuts a document only when it is longer than ``seq_len`` (into full
    sequences and a remainder) and packs the rest whole, best-fit-decreasing, and pads: up to
    ``buffer`` documents wait; when one more comes, all are placed, longest first, each in the
    open sequence with the least room that fits it; a sequence is emitted when exactly full or
    when more than ``open_bins`` are open (the fullest first). Waiting documents and open sequences are the
    lane state. See ``operators/_best_fit.py`` for the exact rules.

    ``labels=True`` adds ``labels`` (int32 [seq_len]): ``input_ids`` with every position that
    starts a piece (``position_ids == 0``, padding included) set to -100. It follows the Hugging
    Face convention that the model shifts labels itself: label ``t`` is the target predicted
    from positions before ``t``, so a masked piece start means no token is ever predicted
    across a document boundary, and padding is never a target.

    ``provenance=True`` (the default) adds ``documents`` (int64 [k, 3]): one row per segment,
    in segment order, the id ``(source index, split index, record offset)`` of the record the
    document came from (``zf.ProvenanceParam``; -1s where the runner gives none). A document
    continued from the previous sequence appears in both; ``batches.stack`` treats the field as
    ragged.
    """

    CARRY = ReadModifyWriteStateSpec("carry", PickleCoder())
    #: Its state is int arrays it makes itself, in lists and dicts: the runner need not check
    #: each write (``runners/userstate.py``: ``plain_by_construction``).
    zephon_state_is_plain = True
    #: The checkpoint codecs of its outputs' derived fields (the plan collects them).
    derived_fields = (PACKED_SEGMENTS,)
    FLUSH = TimerSpec("flush", TimeDomain.WATERMARK)

    def __init__(
        self,
        seq_len: int,
        *,
        pad_id: int = 0,
        strategy: str = "concat",
        buffer: int | None = None,
        open_bins: int | None = None,
        labels: bool = False,
        provenance: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(seq_len, int) or seq_len < 1:
            raise SpecError(f"Pack: seq_len must be a positive integer, got {seq_len!r}")
        if strategy not in STRATEGIES:
            raise SpecError(f"Pack: strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if strategy == "concat" and (buffer is not None or open_bins is not None):
            raise SpecError("Pack: buffer and open_bins apply only to strategy='best_fit'")
        buffer = 64 if buffer is None else buffer
        open_bins = 16 if open_bins is None else open_bins
        if not isinstance(buffer, int) or isinstance(buffer, bool) or buffer < 0:
            raise SpecError(f"Pack: buffer must be a non-negative integer, got {buffer!r}")
        if not isinstance(open_bins, int) or isinstance(open_bins, bool) or open_bins < 1:
            raise SpecError(f"Pack: open_bins must be a positive integer, got {open_bins!r}")
        if not isinstance(labels, bool):
            raise SpecError(f"Pack: labels must be True or False, got {labels!r}")
        if not isinstance(provenance, bool):
            raise SpecError(f"Pack: provenance must be True or False, got {provenance!r}")
        self.seq_len = seq_len
        self.pad_id = int(pad_id)
        self.strategy = strategy
        self.buffer = buffer
        self.open_bins = open_bins
        self.labels = labels
        self.provenance = provenance

    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq_len": self.seq_len, "pad_id": self.pad_id, "strategy": self.strategy}
        if self.strategy == "best_fit":
            out.update(buffer=self.buffer, open_bins=self.open_bins)
        return {**out, "labels": self.labels, "provenance": self.provenance}

    # -- recipe state (``state_mode="recipe"``, see ``core/recipe.py``) --------------------
    #: The state value made of document pieces: the open sequence (``concat``), or the waiting
    #: pieces and open bins (``best_fit``).
    recipe_values = ("carry",)

    def recipe_refusal(self) -> str | None:
        """Why this Pack's outputs or state cannot be stored as recipes (None: they can)."""
        if not self.provenance:
            return "it has provenance=False, so its sequences do not say which documents they hold"
        return None

    def recipe_state(self, value: Any, leaf: recipe.Leaf) -> Any:
        """``value`` (the carry) with each part made of pieces replaced by ``leaf(part, kind)``."""
        if self.strategy == "concat":
            return leaf(value, "carry")
        return {
            "pending": [leaf(p, "piece") for p in value["pending"]],
            "bins": [leaf(b, "bin") for b in value["bins"]],
        }

    def recipe_pieces(self, value: Mapping[str, Any], kind: str) -> recipe.Pieces | None:
        """The pieces of an output ``"sample"``, of the open sequence (``"carry"``), of a
        waiting ``"piece"`` or of an open ``"bin"`` (``best_fit``)."""
        keys = set(value)
        if kind == "piece" and keys == {"ids", "doc"}:
            ids, doc = value["ids"], value["doc"]
            return recipe.Pieces(np.reshape(doc, (1, 3)), np.asarray([ids.size], np.int32), ids)
        if kind == "bin" and keys == {"ids", "lens", "docs"}:
            ids, lens = value["ids"], value["lens"]
            return recipe.Pieces(value["docs"], lens, ids) if int(np.sum(lens)) == ids.size else None
        if kind == "carry" and keys == _CARRY_KEYS:
            pieces, docs = value["pieces"], value["docs"]
            if not all(isinstance(a, np.ndarray) and a.ndim == 1 and a.size for a in pieces):
                return None
            if len(docs) != len(pieces) or not all(np.shape(d) == (3,) for d in docs):
                return None
            return recipe.Pieces(*_joined(pieces, docs))
        names = ("input_ids", "segment_ids", "documents") if kind == "sample" else ("ids", "seg", "docs")
        expected = self._output_keys() if kind == "sample" else _OLD_CARRY_KEYS
        if kind not in ("sample", "carry") or keys != expected:
            return None
        ids, seg, docs = (value[k] for k in names)
        if not all(isinstance(a, np.ndarray) for a in (ids, seg, docs)) or seg.ndim != 1:
            return None
        valid = int((seg >= 0).sum())
        lengths = np.bincount(seg[:valid]).astype(np.int32) if valid else np.zeros(0, dtype=np.int32)
        if docs.shape != (lengths.size, 3) or (lengths < 1).any():
            return None
        return recipe.Pieces(docs, lengths, ids[:valid])

    def _output_keys(self) -> set[str]:
        """The fields of an output sample (what ``_output`` makes)."""
        keys = {"input_ids", "position_ids", "segment_ids"}
        return keys | {k for k, on in (("labels", self.labels), ("documents", self.provenance)) if on}

    def recipe_value(self, tokens: np.ndarray, lengths: np.ndarray, docs: np.ndarray, kind: str) -> Any:
        """The sample or state part made of these pieces, as ``process`` makes it (positions
        restart at each piece, segments number them)."""
        ids = tokens.astype(np.int32, copy=True)
        docs = docs.astype(np.int64).reshape(-1, 3)
        if kind == "piece":
            return {"ids": ids, "doc": docs[0].copy()}
        if kind == "bin":
            return {"ids": ids, "lens": lengths.astype(np.int32, copy=True), "docs": docs}
        if kind == "carry":
            ends = np.cumsum(lengths)[:-1]
            return {"pieces": np.split(ids, ends) if ids.size else [], "docs": list(docs)}
        return self._segments_output(ids, lengths.astype(np.int32), docs)

    def padding_sample(self) -> dict[str, np.ndarray]:
        """The sample that fills a lane's rows after its finite input ended: a sequence of
        padding only (``pad_id``, position 0, segment -1, no documents)."""
        return self._output(_EMPTY, _EMPTY, _EMPTY, _NO_DOCS)

    def process(
        self,
        element: tuple[int, Any],
        carry: Any = beam.DoFn.StateParam(CARRY),
        flush: Any = beam.DoFn.TimerParam(FLUSH),
        doc: Any = ProvenanceParam,
    ) -> Any:
        _lane, tokens = element
        if isinstance(tokens, tuple) and len(tokens) == 2 and not np.isscalar(tokens[1]):
            raise SpecError(KEYED)
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DataError(
                f"Pack: expected a 1-d integer array of token ids, got {ids.dtype}{list(ids.shape)}"
            )
        if ids.size == 0:
            return
        held = carry.read()
        if held is None:
            flush.set(MAX_TIMESTAMP)
        ids = ids.astype(np.int32, copy=False)
        doc_id = np.asarray(doc, dtype=np.int64) if isinstance(doc, tuple) else _NO_DOC
        if self.strategy == "best_fit":
            state, done = _best_fit.add(
                _best_fit.fresh() if held is None else held,
                ids,
                doc_id,
                seq_len=self.seq_len,
                buffer=self.buffer,
                open_bins=self.open_bins,
            )
            carry.write(state)
            for packed in done:
                yield self._bin_output(packed)
            return
        yield from self._concat(ids, doc_id, held, carry)

    def _concat(self, ids: np.ndarray, doc_id: np.ndarray, held: Any, carry: Any) -> Any:
        # The open sequence is kept as its pieces (``_open``): a document adds one piece, and
        # the sequence's arrays are built once, when it is full.
        pieces, docs = _open(held)
        # The part of the document that fits continues the open sequence (its next segment);
        # every later piece starts a sequence of its own, at position 0 and segment 0, and
        # holds only this document.
        n, width = ids.size, self.seq_len
        room = width - sum(map(len, pieces))  # 1-d pieces
        head = min(n, room)
        # The carry may hold views of the input: Beam elements are never changed once emitted,
        # and every output below is an array of its own.
        pieces, docs = [*pieces, ids[:head]], [*docs, doc_id]
        if n < room:  # the open sequence is still not full
            carry.write({"pieces": pieces, "docs": docs})
            return
        yield self._pieces_output(pieces, docs)
        alone = doc_id.reshape(1, 3)
        start = room
        whole = np.array([width], dtype=np.int32)
        while n - start >= width:
            yield self._segments_output(ids[start : start + width].copy(), whole, alone)
            start += width
        rest = ids[start:]
        carry.write({"pieces": [rest] if rest.size else [], "docs": [doc_id] if rest.size else []})

    def _pieces_output(self, pieces: list[np.ndarray], docs: list[np.ndarray]) -> dict[str, np.ndarray]:
        """The output of an open sequence given as pieces (one per segment, in order)."""
        table, lens, ids = _joined(pieces, docs)
        return self._segments_output(ids, lens, table)

    @on_timer(FLUSH)
    def flush_tail(self, carry: Any = beam.DoFn.StateParam(CARRY)) -> Any:
        held = carry.read()
        carry.clear()
        if held is None:
            return
        if self.strategy == "best_fit":
            for packed in _best_fit.drain(held, seq_len=self.seq_len):
                yield self._bin_output(packed)
            return
        pieces, docs = _open(held)
        if pieces:
            yield self._pieces_output(pieces, docs)

    def _bin_output(self, packed: _best_fit.Packed) -> dict[str, np.ndarray]:
        ids, lens, docs = packed
        return self._segments_output(ids.copy(), lens, docs)  # never hand out the input or state

    def _segments_output(self, ids: np.ndarray, lens: np.ndarray, docs: np.ndarray) -> dict[str, np.ndarray]:
        """The output of a sequence of ``ids`` (its own array) made of pieces of ``lens`` tokens."""
        counting, zeros = _counting(self.seq_len)
        if lens.size == 1:  # a piece of a long document, or a lone document
            pos, seg = counting[: ids.size], zeros[: ids.size]
        else:  # each piece counts from 0
            pos = np.concatenate([counting[:n] for n in lens.tolist()])
            seg = np.repeat(np.arange(lens.size, dtype=np.int32), lens)
        return self._output(ids, pos, seg, docs)

    def _output(
        self, ids: np.ndarray, pos: np.ndarray, seg: np.ndarray, docs: np.ndarray
    ) -> dict[str, np.ndarray]:
        """The output dict of one sequence, padded to ``seq_len`` if shorter."""
        pad = self.seq_len - ids.size
        if pad:
            ids = np.concatenate([ids, np.full(pad, self.pad_id, dtype=np.int32)])
            pos = np.concatenate([pos, np.zeros(pad, dtype=np.int32)])
            seg = np.concatenate([seg, np.full(pad, -1, dtype=np.int32)])
        out = {"input_ids": ids, "position_ids": pos, "segment_ids": seg}
        if self.labels:
            out["labels"] = np.where(pos == 0, np.int32(IGNORE), ids).astype(np.int32, copy=False)
        if self.provenance:
            out["documents"] = docs.copy()
        return out
