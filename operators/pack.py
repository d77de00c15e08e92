"""``Pack``: concatenate token arrays and cut them into fixed-length sequences (stateful)."""

from __future__ import annotations

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

from zephon_flow.errors import DataError, SpecError

_EMPTY = np.zeros(0, dtype=np.int32)


class Pack(beam.DoFn):  # type: ignore[misc]
    """Packs documents (int arrays of ids) into sequences of exactly ``seq_len`` tokens.

    Each output is ``{"input_ids", "position_ids", "segment_ids"}`` (int32, length
    ``seq_len``). ``position_ids`` restart at 0 at each document and at the start of each
    sequence (a document continued from the previous sequence starts again at 0);
    ``segment_ids`` number the documents inside a sequence from 0, so trainers can mask
    attention across documents. Documents longer than ``seq_len`` continue into the next
    sequences. At the end of a finite input, the last partial sequence is padded with
    ``pad_id`` and segment id -1. The carry (an incomplete sequence) is the lane state.
    """

    CARRY = ReadModifyWriteStateSpec("carry", PickleCoder())
    FLUSH = TimerSpec("flush", TimeDomain.WATERMARK)

    def __init__(self, seq_len: int, *, pad_id: int = 0) -> None:
        super().__init__()
        if not isinstance(seq_len, int) or seq_len < 1:
            raise SpecError(f"Pack: seq_len must be a positive integer, got {seq_len!r}")
        self.seq_len = seq_len
        self.pad_id = int(pad_id)

    def params(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "pad_id": self.pad_id}

    def process(
        self,
        element: tuple[int, Any],
        carry: Any = beam.DoFn.StateParam(CARRY),
        flush: Any = beam.DoFn.TimerParam(FLUSH),
    ) -> Any:
        _lane, doc = element
        ids = np.asarray(doc)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DataError(
                f"Pack: expected a 1-d integer array of token ids, got {ids.dtype}{list(ids.shape)}"
            )
        if ids.size == 0:
            return
        held = carry.read()
        if held is None:
            flush.set(MAX_TIMESTAMP)
            c_ids, c_pos, c_seg = _EMPTY, _EMPTY, _EMPTY
            next_seg = 0
        else:
            c_ids, c_pos, c_seg = held["ids"], held["pos"], held["seg"]
            next_seg = int(c_seg[-1]) + 1 if c_seg.size else 0
        # Position and segment ids of the whole document at once: the part that fits the
        # open sequence continues it; every later piece starts a sequence, at position 0
        # and segment 0.
        n = ids.size
        room = self.seq_len - c_ids.size
        t = np.arange(n, dtype=np.int32)
        later = t >= room
        pos = np.where(later, (t - room) % self.seq_len, t).astype(np.int32, copy=False)
        seg = np.where(later, 0, next_seg).astype(np.int32, copy=False)
        all_ids = np.concatenate([c_ids, ids.astype(np.int32, copy=False)])
        all_pos = np.concatenate([c_pos, pos])
        all_seg = np.concatenate([c_seg, seg])
        full = all_ids.size // self.seq_len * self.seq_len
        for start in range(0, full, self.seq_len):
            stop = start + self.seq_len
            yield {
                "input_ids": all_ids[start:stop].copy(),
                "position_ids": all_pos[start:stop].copy(),
                "segment_ids": all_seg[start:stop].copy(),
            }
        carry.write(
            {"ids": all_ids[full:].copy(), "pos": all_pos[full:].copy(), "seg": all_seg[full:].copy()}
        )

    @on_timer(FLUSH)
    def flush_tail(self, carry: Any = beam.DoFn.StateParam(CARRY)) -> Any:
        held = carry.read()
        carry.clear()
        if held is None or held["ids"].size == 0:
            return
        pad = self.seq_len - held["ids"].size
        yield {
            "input_ids": np.concatenate([held["ids"], np.full(pad, self.pad_id, dtype=np.int32)]),
            "position_ids": np.concatenate([held["pos"], np.zeros(pad, dtype=np.int32)]),
            "segment_ids": np.concatenate([held["seg"], np.full(pad, -1, dtype=np.int32)]),
        }
