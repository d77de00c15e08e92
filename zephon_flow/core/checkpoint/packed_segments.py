"""Pack's derived fields, a codec built into the checkpoint format (``pack.segments/1``).

``Pack`` and ``PackMultimodal`` declare it (their ``derived_fields``); it lives here, with the
format, because checkpoints name it: any process reads them without importing the operators.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from zephon_flow.core.checkpoint.derived_fields import Column, DerivedCodecs, Ragged, Reduced

#: The label of a position that must not be trained on (PyTorch's and HF's ``ignore_index``).
IGNORE = -100
_CHECK_ROWS = 64


class PackedSegments:
    """Pack's derived fields: ``position_ids``, ``segment_ids`` and ``labels`` follow from where
    each piece of a document starts in its sequence and where padding begins.

    A checkpoint stores, per sequence, the offsets of its piece starts and its unpadded length;
    ``rebuild`` recomputes the three fields from them (and ``labels`` from ``input_ids``). The
    rule: piece ``k`` holds ``segment_ids == k`` and ``position_ids`` counting from 0; padding
    (at the end) has segment -1 and position 0; ``labels`` is ``input_ids`` with every position
    0 set to ``IGNORE``. ``PackMultimodal`` follows the same rule.
    """

    name = "pack.segments/1"

    def reduce(self, columns: Mapping[str, Column]) -> Reduced | None:
        ids, pos, seg = (columns.get(k) for k in ("input_ids", "position_ids", "segment_ids"))
        if not (isinstance(ids, np.ndarray) and isinstance(pos, np.ndarray) and isinstance(seg, np.ndarray)):
            return None
        fields = [pos, seg]
        labels = columns.get("labels")
        if labels is not None:
            if not isinstance(labels, np.ndarray):
                return None
            fields.append(labels)
        if (
            ids.ndim != 2
            or ids.dtype.kind not in "iu"
            or any(f.shape != ids.shape or f.dtype != np.int32 for f in fields)
        ):
            return None
        if labels is not None and not np.array_equal(labels, np.where(pos == 0, np.int32(IGNORE), ids)):
            return None
        valid = seg >= 0
        starts = (pos == 0) & valid
        for r in range(0, ids.shape[0], _CHECK_ROWS):  # in blocks: small temporaries
            block = slice(r, r + _CHECK_ROWS)
            if not _follows_starts(pos[block], seg[block], valid[block], starts[block]):
                return None
        rows, cols = np.nonzero(starts)
        stored: dict[str, Column] = {
            "piece_starts": Ragged(
                cols.astype(np.int32), np.bincount(rows, minlength=ids.shape[0]).astype(np.int32)
            ),
            "valid": valid.sum(axis=1, dtype=np.int32),
        }
        return Reduced(stored, ("position_ids", "segment_ids", *(("labels",) if labels is not None else ())))

    def rebuild(
        self,
        columns: Mapping[str, Column],
        stored: Mapping[str, Column],
        names: tuple[str, ...],
    ) -> dict[str, Column]:
        ids, starts, valid = columns["input_ids"], stored["piece_starts"], stored["valid"]
        if not (isinstance(ids, np.ndarray) and isinstance(starts, Ragged) and isinstance(valid, np.ndarray)):
            raise ValueError(f"{self.name}: input_ids, piece_starts or valid have the wrong form")
        rows, width = ids.shape
        if starts.lengths.shape != (rows,) or valid.shape != (rows,) or (starts.values >= width).any():
            raise ValueError(f"{self.name}: stored facts do not fit the {rows} rows of {width}")
        size = rows * width
        index = np.arange(size, dtype=np.int32 if size < 2**31 else np.int64)
        first = np.repeat(index[:rows] * width, starts.lengths) + starts.values  # ascending
        mask = np.zeros(size, dtype=bool)
        mask[first] = True
        pad = np.arange(width) >= valid[:, None]
        # Every valid row begins with a piece start (reduce checks it), so running counts over
        # the flattened rows restart at each row, and a token's piece starts at first[count - 1].
        count = np.cumsum(mask, dtype=index.dtype)
        seg = count.reshape(rows, width).astype(np.int32)
        seg -= np.concatenate([[0], seg[:-1, -1]]).astype(np.int32)[:, None] + np.int32(1)
        seg[pad] = -1
        if first.size:
            count -= 1
            np.maximum(count, 0, out=count)
            pos = (index - first[count]).astype(np.int32, copy=False).reshape(rows, width)
        else:
            pos = np.zeros((rows, width), dtype=np.int32)
        pos[pad] = 0
        out: dict[str, Column] = {"position_ids": pos, "segment_ids": seg}
        if "labels" in names:
            out["labels"] = np.where(pos == 0, np.int32(IGNORE), ids).astype(np.int32)
        unknown = set(names) - set(out)
        if unknown:
            raise ValueError(f"{self.name}: cannot rebuild field(s) {sorted(unknown)}")
        return out


def _follows_starts(pos: np.ndarray, seg: np.ndarray, valid: np.ndarray, starts: np.ndarray) -> bool:
    """Whether each row is pieces then padding: padding (segment -1, position 0) only after the
    last valid token; the first valid token starts piece 0; every later token either starts the
    next piece (position 0, segment + 1) or continues its piece (position + 1, same segment)."""
    if np.any(~valid & ((seg != -1) | (pos != 0))) or np.any(valid[:, 1:] & ~valid[:, :-1]):
        return False
    if np.any(valid[:, 0] & (seg[:, 0] != 0)):  # position 0 there is starts[:, 0]
        return False
    if np.any(valid[:, 0] & ~starts[:, 0]):
        return False
    step_seg = (seg[:, 1:] - seg[:, :-1]) == starts[:, 1:]
    step_pos = starts[:, 1:] | ((pos[:, 1:] - pos[:, :-1]) == 1)
    return not np.any(valid[:, 1:] & ~(step_seg & step_pos))


PACKED_SEGMENTS = PackedSegments()
#: The format's own codecs, known to every reader and offered to every writer (before those a
#: pipeline's plan hands in).
BUILTIN = DerivedCodecs((PACKED_SEGMENTS,))
