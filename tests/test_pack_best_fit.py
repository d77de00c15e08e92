"""Tests of Pack's best_fit strategy and of labels: hand-made bins, conservation, and checkpoint/resume."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from checkpointing import assert_equal_output_after_checkpoint
from helpers import ParseIds, chain_spec, run_batches, source_epochs, write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.checkpoint import blob
from zephon_flow.core.errors import SpecError


class _Cell:
    """A stand-in for the runner's ReadModifyWrite state and watermark timer."""

    def __init__(self) -> None:
        self.value: Any = None
        self.timer: Any = None

    def read(self) -> Any:
        return self.value

    def write(self, value: Any) -> None:
        self.value = value

    def clear(self) -> None:
        self.value = None

    def set(self, timestamp: Any) -> None:
        self.timer = timestamp


def pack_direct(pack: ops.Pack, docs: list[list[int]], *, finish: bool = True) -> list[dict[str, np.ndarray]]:
    """Calls Pack's process for each document, then its end-of-input timer, without a runner."""
    cell = _Cell()
    out: list[dict[str, np.ndarray]] = []
    for i, doc in enumerate(docs):  # document i comes from the record at offset 10 * i
        out += list(
            pack.process((0, np.asarray(doc, dtype=np.int32)), carry=cell, flush=cell, doc=(0, 1, 10 * i))
        )
    if finish:
        out += list(pack.flush_tail(carry=cell))
    return out


def best_fit(seq_len: int, **kwargs: Any) -> ops.Pack:
    return ops.Pack(seq_len=seq_len, strategy="best_fit", pad_id=kwargs.pop("pad_id", 99), **kwargs)


def table(outs: list[dict[str, np.ndarray]], *keys: str) -> list[tuple[list[int], ...]]:
    keys = keys or ("input_ids", "position_ids", "segment_ids")
    return [tuple(o[k].tolist() for k in keys) for o in outs]


# -- hand-made bins ------------------------------------------------------------------------
def test_online_best_fit_picks_the_tightest_bin_and_splits_only_long_documents() -> None:
    docs = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10, 11], [12, 13]]
    assert table(pack_direct(best_fit(4, buffer=0, open_bins=2), docs)) == [
        # [6] fits both open bins; the one with least room ([1, 2, 3]) takes it and is full.
        ([1, 2, 3, 6], [0, 1, 2, 0], [0, 0, 0, 1]),
        # a document longer than seq_len: a full piece at once, its remainder packed.
        ([7, 8, 9, 10], [0, 1, 2, 3], [0, 0, 0, 0]),
        ([4, 5, 11, 99], [0, 1, 0, 0], [0, 0, 1, -1]),
        ([12, 13, 99, 99], [0, 1, 0, 0], [0, 0, -1, -1]),
    ]


def test_a_full_buffer_is_placed_longest_first() -> None:
    docs = [[1], [2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]
    # The fourth document overflows the buffer of 3: all four are placed, longest first:
    # [7..11] opens a bin, [2, 3, 4] another, [5, 6] joins it, [1] fills the first.
    assert table(pack_direct(best_fit(6, buffer=3, open_bins=4), docs)) == [
        ([7, 8, 9, 10, 11, 1], [0, 1, 2, 3, 4, 0], [0, 0, 0, 0, 0, 1]),
        ([2, 3, 4, 5, 6, 99], [0, 1, 2, 0, 1, 0], [0, 0, 0, 1, 1, -1]),
    ]


def test_ties_go_to_the_earliest_document_and_the_oldest_bin() -> None:
    # Equal lengths: the earliest pending document is placed first.
    assert table(pack_direct(best_fit(4, buffer=2), [[1, 2], [3, 4], [5, 6]]), "input_ids") == [
        ([1, 2, 3, 4],),
        ([5, 6, 99, 99],),
    ]
    # Equal room: the oldest open bin takes the document.
    assert table(pack_direct(best_fit(5, buffer=0), [[1, 2, 3], [4, 5, 6], [7]]), "input_ids") == [
        ([1, 2, 3, 7, 99],),
        ([4, 5, 6, 99, 99],),
    ]


def test_too_many_open_bins_emit_the_fullest() -> None:
    docs = [[1] * 6, [2] * 5, [3] * 7, [4] * 4]
    outs = pack_direct(best_fit(10, buffer=0, open_bins=2), docs, finish=False)
    # The third bin opened makes three: the fullest ([3] * 7) goes; then [4] * 4 fills the first.
    assert table(outs, "input_ids") == [([3] * 7 + [99] * 3,), ([1] * 6 + [4] * 4,)]


def test_a_document_of_exactly_seq_len_is_a_sequence_of_its_own() -> None:
    outs = pack_direct(best_fit(3, buffer=4), [[1], [2, 3, 4], [5, 6, 7, 8, 9, 10]], finish=False)
    assert table(outs, "input_ids") == [([2, 3, 4],), ([5, 6, 7],), ([8, 9, 10],)]


# -- labels --------------------------------------------------------------------------------
def test_labels_mask_every_document_start_and_padding_with_concat() -> None:
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12], [13]]
    outs = pack_direct(ops.Pack(seq_len=4, pad_id=99, labels=True), docs)
    assert table(outs, "input_ids", "labels") == [
        ([1, 2, 3, 4], [-100, 2, 3, -100]),
        # [4, 5] continues at the start of the sequence: 5 has no context here, so it is masked.
        ([5, 6, 7, 8], [-100, -100, 7, 8]),
        ([9, 10, 11, 12], [-100, 10, 11, 12]),
        ([13, 99, 99, 99], [-100, -100, -100, -100]),
    ]
    assert all(o["labels"].dtype == np.int32 for o in outs)


def test_labels_with_best_fit() -> None:
    outs = pack_direct(best_fit(5, buffer=0, labels=True), [[1, 2], [3, 4, 5, 6, 7, 8], [9]])
    assert table(outs, "input_ids", "labels") == [
        ([3, 4, 5, 6, 7], [-100, 4, 5, 6, 7]),
        ([1, 2, 8, 9, 99], [-100, 2, -100, -100, -100]),
    ]


def test_without_labels_there_is_no_labels_field() -> None:
    assert sorted(pack_direct(best_fit(4), [[1, 2]])[0]) == [
        "documents",
        "input_ids",
        "position_ids",
        "segment_ids",
    ]


# -- properties ----------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    seq_len=st.integers(1, 12),
    buffer=st.integers(0, 6),
    open_bins=st.integers(1, 4),
    lengths=st.lists(st.integers(1, 40), max_size=40),
)
def test_every_token_comes_out_once_and_only_long_documents_are_split(
    seq_len: int, buffer: int, open_bins: int, lengths: list[int]
) -> None:
    starts = np.cumsum([0, *lengths])
    docs = [list(range(a + 1, b + 1)) for a, b in itertools.pairwise(starts)]
    pack = best_fit(seq_len, buffer=buffer, open_bins=open_bins, pad_id=0, labels=True)
    outs = pack_direct(pack, docs)
    seen: dict[int, list[int]] = {}  # document -> the sequences that hold its tokens
    tokens = []
    for i, o in enumerate(outs):
        ids, pos, seg = o["input_ids"], o["position_ids"], o["segment_ids"]
        assert ids.shape == (seq_len,)
        real = seg >= 0
        assert (ids[~real] == 0).all() and (pos[~real] == 0).all()
        assert not (~real[:-1] & real[1:]).any(), "padding only at the end"
        assert (o["labels"] == np.where(pos == 0, -100, ids)).all()
        for s in np.unique(seg[real]):
            piece = ids[seg == s]
            doc = int(np.searchsorted(starts, piece[0], side="left")) - 1
            assert piece.tolist() == list(range(piece[0], piece[0] + piece.size)), "a piece is contiguous"
            assert (pos[seg == s] == np.arange(piece.size)).all()
            seen.setdefault(doc, []).append(i)
        tokens += ids[real].tolist()
    assert sorted(tokens) == list(range(1, int(starts[-1]) + 1))
    for d, n in enumerate(lengths):
        assert len(seen[d]) == -(-n // seq_len), f"document {d} ({n} tokens) is cut more than needed"


def test_the_state_stays_bounded_and_is_plain_data() -> None:
    pack = best_fit(16, buffer=5, open_bins=3)
    cell = _Cell()
    rng = np.random.default_rng(0)
    for n in rng.integers(1, 40, size=300):
        list(pack.process((0, np.arange(n, dtype=np.int32)), carry=cell, flush=cell))
        assert len(cell.value["pending"]) <= 5 and len(cell.value["bins"]) <= 3
    back = blob.decode(blob.encode(cell.value))
    assert blob.canonical_digest(back) == blob.canonical_digest(cell.value)


# -- options -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "first_fit"}, "Pack: strategy must be one of concat, best_fit, got 'first_fit'"),
        ({"buffer": 8}, "Pack: buffer and open_bins apply only to strategy='best_fit'"),
        ({"strategy": "best_fit", "buffer": -1}, "Pack: buffer must be a non-negative integer, got -1"),
        ({"strategy": "best_fit", "open_bins": 0}, "Pack: open_bins must be a positive integer, got 0"),
        ({"labels": 1}, "Pack: labels must be True or False, got 1"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        ops.Pack(seq_len=8, **kwargs)
    assert str(info.value) == message


# -- through the loader, and checkpoints -----------------------------------------------------
RECORDS = ["1 2 3 | 4 5 6 7 8 9 | 10", "11 | 12 13", "14 15 16 17 18 19 20 21 22 23 | 24 25"] * 2


def test_the_loader_runs_best_fit_to_the_end_of_a_finite_input(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "multi.jsonl", RECORDS[:3])
    pack = best_fit(4, buffer=2, open_bins=2, labels=True)
    batches = run_batches(chain_spec(path, ("ids", ParseIds()), ("pack", pack), epochs=1))
    got = sorted(t for b in batches for t in b["input_ids"][b["segment_ids"] >= 0].tolist())
    assert got == list(range(1, 26))
    assert sorted(batches[0]) == [
        "documents",
        "documents_count",
        "input_ids",
        "labels",
        "position_ids",
        "segment_ids",
        "valid",
    ]


def test_resume_at_every_step_with_open_bins_across_an_epoch(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "multi.jsonl", RECORDS)
    pack = best_fit(5, buffer=3, open_bins=2, labels=True)
    spec = chain_spec(path, ("ids", ParseIds()), ("pack", pack), lanes=2, global_batch_size=2, split_bytes=40)
    ref = assert_equal_output_after_checkpoint(spec, 20)
    assert min(source_epochs(spec, ref.final_state)["src"]) >= 1
    carries = [
        st["values"]["carry"]
        for s in ref.states
        for ls in zf.decode_state(s).to_plain()["lane_states"]
        for st in ls["stages"].values()
        if "carry" in st["values"]
    ]
    assert any(c["pending"] and c["bins"] for c in carries), "some checkpoint holds pending docs and bins"
