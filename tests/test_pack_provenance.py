"""Pack's provenance: every sequence names, per segment, the record its document came from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import ParseIds, chain_spec, run_batches, write_jsonl
from test_pack_best_fit import best_fit, pack_direct, table

from zephon_flow import operators as ops
from zephon_flow.core.batches import split_ragged
from zephon_flow.core.errors import SpecError

# pack_direct gives document i the id (0, 1, 10 * i).


def docs_of(outs: list[dict[str, np.ndarray]]) -> list[list[int]]:
    """Per sequence, the record offsets of its segments' documents."""
    for o in outs:
        assert o["documents"].dtype == np.int64 and o["documents"].shape[1] == 3
        assert (o["documents"][:, :2] == [0, 1]).all()
    return [o["documents"][:, 2].tolist() for o in outs]


def test_concat_names_each_segment_and_continued_documents_in_both_sequences() -> None:
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12], [13]]
    outs = pack_direct(ops.Pack(seq_len=4), docs)
    assert table(outs, "input_ids", "segment_ids") == [
        ([1, 2, 3, 4], [0, 0, 0, 1]),
        ([5, 6, 7, 8], [0, 1, 1, 1]),
        ([9, 10, 11, 12], [0, 0, 0, 0]),
        ([13, 0, 0, 0], [0, -1, -1, -1]),
    ]
    assert docs_of(outs) == [[0, 10], [10, 20], [20], [30]]


def test_best_fit_names_each_piece() -> None:
    docs = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10, 11], [12, 13]]
    outs = pack_direct(best_fit(4, buffer=0, open_bins=2), docs)
    assert table(outs, "input_ids") == [
        ([1, 2, 3, 6],),
        ([7, 8, 9, 10],),
        ([4, 5, 11, 99],),
        ([12, 13, 99, 99],),
    ]
    assert docs_of(outs) == [[0, 20], [30], [10, 30], [40]]


def test_without_provenance_there_is_no_documents_field() -> None:
    for pack in (ops.Pack(seq_len=4, provenance=False), best_fit(4, provenance=False)):
        outs = pack_direct(pack, [[1, 2, 3], [4, 5]])
        assert all(sorted(o) == ["input_ids", "position_ids", "segment_ids"] for o in outs)


def test_provenance_must_be_a_bool() -> None:
    with pytest.raises(SpecError, match=r"^Pack: provenance must be True or False, got 'yes'$"):
        ops.Pack(seq_len=4, provenance="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_the_loader_names_the_jsonl_line_of_every_segment(tmp_path: Path, strategy: str) -> None:
    records = ["1 2 3 | 4 5 6 7 8 9 | 10", "11 | 12 13", "14 15 16 17 18 19 20 21 22 23 | 24 25", "26 27"]
    path = write_jsonl(tmp_path / "multi.jsonl", records)
    offsets, at = {}, 0
    for text in records:
        offsets[at] = [int(t) for t in text.replace("|", " ").split()]
        at += len((json.dumps({"text": text}) + "\n").encode())
    pack = ops.Pack(seq_len=4, strategy=strategy) if strategy == "concat" else best_fit(4, buffer=2)
    batches = run_batches(
        chain_spec(path, ("ids", ParseIds()), ("pack", pack), global_batch_size=2, epochs=1)
    )
    segments = 0
    for b in batches:
        for ids, seg, docs in zip(b["input_ids"], b["segment_ids"], split_ragged(b), strict=True):
            assert len(docs) == len(np.unique(seg[seg >= 0]))
            for j, (source, split, offset) in enumerate(docs.tolist()):
                assert (source, split) == (0, 0)
                piece = ids[seg == j].tolist()
                record = offsets[offset]
                assert any(record[k : k + len(piece)] == piece for k in range(len(record))), (piece, record)
                segments += 1
    assert segments >= len(records)
