"""Bounded-buffer best-fit-decreasing bin packing of documents into sequences (``Pack``'s ``best_fit``).

The state is plain data and is replaced, never changed in place, so the lane executor's shallow
snapshots stay valid::

    {"pending": [piece, ...],        # documents waiting to be placed, in arrival order
     "bins": [bin, ...]}             # open sequences, in the order they were opened
    piece = {"ids": int32[n], "doc": int64[3]}
    bin   = {"ids": int32[fill], "lens": int32[k], "docs": int64[k, 3]}

The rules, all deterministic:

1. A document of ``n >= seq_len`` tokens is cut into ``n // seq_len`` full pieces, each emitted at
   once as a sequence of its own, and a remainder (``n % seq_len`` tokens, if any) that is packed
   like a document. No other document is ever split.
2. A piece waits in ``pending``. When more than ``buffer`` pieces wait, all of them are placed,
   longest first (ties: the earliest arrival), each into the open bin with the least room that
   still fits it (ties: the oldest bin), else into a new bin. (Placing the whole buffer, not
   only its longest piece, matters: the short pieces are the fillers of the long ones' bins;
   a buffer that kept them would pad more the larger it is.)
3. A bin that is exactly full is emitted at once. Then, while more than ``open_bins`` bins are
   open, the fullest (ties: the oldest) is emitted.
4. At the end of a finite input every pending piece is placed the same way, and then every open
   bin is emitted, oldest first.

Each emitted sequence is ``(ids, lens, docs)``: its tokens (at most ``seq_len``), the length of
each piece in it, and each piece's document id; ``Pack`` pads it and adds the other fields.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: One emitted sequence before padding: (token ids, piece lengths, piece document ids [k, 3]).
Packed = tuple[np.ndarray, np.ndarray, np.ndarray]


def fresh() -> dict[str, Any]:
    """The state of a lane that has seen no document."""
    return {"pending": [], "bins": []}


def add(
    state: dict[str, Any], ids: np.ndarray, doc: np.ndarray, *, seq_len: int, buffer: int, open_bins: int
) -> tuple[dict[str, Any], list[Packed]]:
    """Takes one document (non-empty int32 ids, its int64[3] id); returns the new state and the
    sequences completed by it, in emission order."""
    out: list[Packed] = []
    full = ids.size // seq_len * seq_len
    one = np.asarray([seq_len], dtype=np.int32)
    for start in range(0, full, seq_len):
        out.append((ids[start : start + seq_len], one, doc.reshape(1, 3)))
    pending: list[dict[str, Any]] = list(state["pending"])
    bins: list[dict[str, Any]] = list(state["bins"])
    if full < ids.size:
        pending.append({"ids": ids[full:].copy(), "doc": doc})
    if len(pending) > buffer:
        _place_all(pending, bins, out, seq_len=seq_len)
        pending = []
        _bound(bins, out, open_bins=open_bins)
    return {"pending": pending, "bins": bins}, out


def drain(state: dict[str, Any], *, seq_len: int) -> list[Packed]:
    """Everything the state still holds, as sequences: the end of a finite input."""
    pending: list[dict[str, Any]] = list(state["pending"])
    bins: list[dict[str, Any]] = list(state["bins"])
    out: list[Packed] = []
    _place_all(pending, bins, out, seq_len=seq_len)
    out.extend(_packed(b) for b in bins)
    return out


def _place_all(
    pending: list[dict[str, Any]], bins: list[dict[str, Any]], out: list[Packed], *, seq_len: int
) -> None:
    """Places every pending piece, longest first; ``sorted`` is stable, so equals keep arrival order."""
    for piece in sorted(pending, key=lambda p: -int(p["ids"].size)):
        _place(piece, bins, out, seq_len=seq_len)


def _place(piece: dict[str, Any], bins: list[dict[str, Any]], out: list[Packed], *, seq_len: int) -> None:
    n = int(piece["ids"].size)
    best, best_room = -1, seq_len + 1
    for i, b in enumerate(bins):
        room = seq_len - int(b["ids"].size)
        if n <= room < best_room:
            best, best_room = i, room
    if best < 0:
        bins.append(
            {
                "ids": piece["ids"],
                "lens": np.asarray([n], dtype=np.int32),
                "docs": piece["doc"].reshape(1, 3),
            }
        )
        best = len(bins) - 1
    else:
        b = bins[best]
        bins[best] = {
            "ids": np.concatenate([b["ids"], piece["ids"]]),
            "lens": np.concatenate([b["lens"], np.asarray([n], dtype=np.int32)]),
            "docs": np.concatenate([b["docs"], piece["doc"].reshape(1, 3)]),
        }
    if bins[best]["ids"].size == seq_len:
        out.append(_packed(bins.pop(best)))


def _bound(bins: list[dict[str, Any]], out: list[Packed], *, open_bins: int) -> None:
    """Emits the fullest bins (the oldest of equals) until at most ``open_bins`` are open."""
    while len(bins) > open_bins:
        fullest = 0
        for i in range(1, len(bins)):
            if bins[i]["ids"].size > bins[fullest]["ids"].size:
                fullest = i
        out.append(_packed(bins.pop(fullest)))


def _packed(b: dict[str, Any]) -> Packed:
    return b["ids"], b["lens"], b["docs"]


__all__ = ["Packed", "add", "drain", "fresh"]
