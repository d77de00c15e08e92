"""Tests of Pack: exact sequences, positions and segments, no token lost, and checkpoint/resume."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from checkpointing import assert_equal_output_after_checkpoint, reference_run
from helpers import Corpus, ParseIds, chain_spec, run_batches, source_epochs, write_jsonl
from test_pack_best_fit import _Cell, pack_direct
from tokenizers import Tokenizer

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import DataError, SpecError

HAND = ["1 2 3", "4 5", "6 7 8 9 10 11 12", "13"]


def pack_spec(path: str, seq_len: int, **kwargs: object) -> zf.LoaderSpec:
    pad_id = kwargs.pop("pad_id", 0)
    return chain_spec(path, ("ids", ParseIds()), ("pack", ops.Pack(seq_len=seq_len, pad_id=pad_id)), **kwargs)  # type: ignore[arg-type]


def rows(batches: list[dict[str, np.ndarray]]) -> list[tuple[list[int], list[int], list[int]]]:
    """Every sequence of every batch as (input_ids, position_ids, segment_ids) lists."""
    out = []
    for b in batches:
        for i in range(len(b["input_ids"])):
            out.append(
                (b["input_ids"][i].tolist(), b["position_ids"][i].tolist(), b["segment_ids"][i].tolist())
            )
    return out


def reference_pack(docs: list[list[int]], seq_len: int) -> list[tuple[list[int], list[int], list[int]]]:
    """An independent packer: cut the token stream, then number positions and segments."""
    tokens = [(tok, doc, pos) for doc, ids in enumerate(docs) for pos, tok in enumerate(ids)]
    seqs = []
    for start in range(0, len(tokens) - seq_len + 1, seq_len):
        chunk = tokens[start : start + seq_len]
        first_pos: dict[int, int] = {}
        segments: dict[int, int] = {}
        for _, doc, pos in chunk:
            first_pos.setdefault(doc, pos)
            segments.setdefault(doc, len(segments))
        seqs.append(
            (
                [t for t, _, _ in chunk],
                [pos - first_pos[doc] for _, doc, pos in chunk],
                [segments[doc] for _, doc, _ in chunk],
            )
        )
    return seqs


def test_packs_hand_made_documents_and_pads_the_tail(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "hand.jsonl", HAND)
    batches = run_batches(pack_spec(path, 4, pad_id=99, epochs=1))
    assert rows(batches) == [
        ([1, 2, 3, 4], [0, 1, 2, 0], [0, 0, 0, 1]),
        # "4 5" continues: its position restarts at 0 at the sequence start.
        ([5, 6, 7, 8], [0, 0, 1, 2], [0, 1, 1, 1]),
        ([9, 10, 11, 12], [0, 1, 2, 3], [0, 0, 0, 0]),
        # End of the finite input: the tail is padded with pad_id and segment id -1.
        ([13, 99, 99, 99], [0, 0, 0, 0], [0, -1, -1, -1]),
    ]
    assert all(b[k].dtype == np.int32 for b in batches for k in ("input_ids", "position_ids", "segment_ids"))
    assert all(b["documents"].dtype == np.int64 for b in batches)


def test_endless_input_packs_across_the_epoch_boundary(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "hand.jsonl", HAND)
    assert rows(run_batches(pack_spec(path, 4), 5))[3:] == [
        ([13, 1, 2, 3], [0, 0, 1, 2], [0, 1, 1, 1]),
        ([4, 5, 6, 7], [0, 1, 0, 1], [0, 0, 1, 1]),
    ]


def test_a_long_document_continues_through_several_sequences(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "long.jsonl", ["1 2", " ".join(str(i) for i in range(10, 21)), "7"])
    assert rows(run_batches(pack_spec(path, 3, epochs=1))) == [
        ([1, 2, 10], [0, 1, 0], [0, 0, 1]),
        ([11, 12, 13], [0, 1, 2], [0, 0, 0]),
        ([14, 15, 16], [0, 1, 2], [0, 0, 0]),
        ([17, 18, 19], [0, 1, 2], [0, 0, 0]),
        ([20, 7, 0], [0, 0, 0], [0, 1, -1]),
    ]


def test_no_token_is_lost_or_repeated_over_a_long_run(tmp_path: Path) -> None:
    rng = random.Random(3)
    records = []
    for _ in range(12):  # records of 1 to 3 documents of 1 to 20 tokens
        docs = [
            " ".join(str(rng.randrange(1000)) for _ in range(rng.randint(1, 20)))
            for _ in range(rng.randint(1, 3))
        ]
        records.append(" | ".join(docs))
    path = write_jsonl(tmp_path / "rand.jsonl", records)
    tokens = [[int(t) for t in part.split()] for r in records for part in r.split("|")]
    seq_len, steps, batch = 7, 100, 2
    got = rows(run_batches(pack_spec(path, seq_len, global_batch_size=batch), steps))
    n_tokens = sum(map(len, tokens))
    epochs = steps * batch * seq_len // n_tokens + 1
    assert epochs >= 3, "the run should cover several epochs"
    assert got == reference_pack(tokens * epochs, seq_len)[: steps * batch]


def test_seq_len_must_be_a_positive_integer() -> None:
    with pytest.raises(SpecError, match=r"Pack: seq_len must be a positive integer, got 0"):
        ops.Pack(seq_len=0)
    with pytest.raises(SpecError, match=r"Pack: seq_len must be a positive integer, got '8'"):
        ops.Pack(seq_len="8")  # type: ignore[arg-type]


class _Floats(ParseIds):
    def process(self, text: str):  # type: ignore[no-untyped-def]
        for ids in super().process(text):
            yield ids.astype(np.float64)


def test_non_integer_documents_are_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "hand.jsonl", HAND)
    spec = chain_spec(path, ("floats", _Floats()), ("pack", ops.Pack(seq_len=4)))
    with pytest.raises(DataError, match=r"Pack: expected a 1-d integer array of token ids, got float64\[3\]"):
        run_batches(spec, 1)


# -- checkpoints ---------------------------------------------------------------------------
def test_resume_at_every_step_with_tokenize_across_an_epoch(corpus: Corpus, tmp_path: Path) -> None:
    texts = list(corpus.web_texts[:10])
    path = write_jsonl(tmp_path / "web.jsonl", texts)
    spec = chain_spec(
        path,
        ("tok", ops.Tokenize(corpus.tokenizer_json)),
        ("pack", ops.Pack(seq_len=16)),
        lanes=2,
        global_batch_size=4,
        split_bytes=300,
    )
    steps = 14
    ref = assert_equal_output_after_checkpoint(spec, steps)
    tok = Tokenizer.from_file(corpus.tokenizer_json)
    corpus_tokens = sum(len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in texts)
    assert steps * 4 * 16 > corpus_tokens  # more tokens came out than one epoch holds
    assert min(source_epochs(spec, ref.final_state)["src"]) >= 1  # every lane is in epoch >= 1


def test_resume_at_every_step_inside_multi_document_records(tmp_path: Path) -> None:
    # Records of several documents make the cursor point inside a record (its skip count).
    records = ["1 2 3 | 4 5 6 7 8 9 | 10", "11 | 12 13", "14 15 16 17 18 19 20 21 22 23 | 24 25"] * 2
    path = write_jsonl(tmp_path / "multi.jsonl", records)
    spec = pack_spec(path, 3, lanes=2, global_batch_size=2, split_bytes=40)
    ref = assert_equal_output_after_checkpoint(spec, 20)
    assert min(source_epochs(spec, ref.final_state)["src"]) >= 1
    assert any(
        ls["cursor"]["skip"] > 0 for s in ref.states for ls in zf.decode_state(s).to_plain()["lane_states"]
    )


def test_resume_at_every_step_with_two_ranks_and_threads(tmp_path: Path) -> None:
    records = ["1 2 3 | 4 5 6 7 8 9 | 10", "11 | 12 13", "14 15 16 17 18 19 20 21 22 23 | 24 25"] * 2
    path = write_jsonl(tmp_path / "multi.jsonl", records)
    spec = pack_spec(path, 3, lanes=2, global_batch_size=4, split_bytes=40)
    ref = assert_equal_output_after_checkpoint(
        spec, 10, world_size=2, backend="threads", workers=2, chunk_records=1
    )
    assert min(source_epochs(spec, ref.final_state)["src"]) >= 1


# -- the carry's earlier form ----------------------------------------------------------------
def _as_earlier_carry(carry: dict[str, Any]) -> dict[str, Any]:
    """``concat``'s carry as versions before the pieces form stored it: the open sequence's
    arrays (ids, positions restarting per piece, segments) and its ``[k, 3]`` document table."""
    pieces, docs = carry["pieces"], carry["docs"]
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    pos = np.concatenate([np.arange(p.size, dtype=np.int32) for p in pieces]) if pieces else ids.copy()
    seg = (
        np.concatenate([np.full(p.size, k, dtype=np.int32) for k, p in enumerate(pieces)])
        if pieces
        else ids.copy()
    )
    table = np.stack(docs).astype(np.int64) if docs else np.zeros((0, 3), dtype=np.int64)
    return {"ids": ids, "pos": pos, "seg": seg, "docs": table}


def _equal_outputs(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]) -> bool:
    return len(got) == len(want) and all(
        a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
        for a, b in zip(got, want, strict=True)
    )


def test_a_carry_in_the_earlier_form_continues_with_the_same_outputs() -> None:
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 500, int(n), dtype=np.int32) for n in rng.integers(1, 30, 60)]
    pack = ops.Pack(seq_len=16, labels=True)
    want = pack_direct(pack, [d.tolist() for d in docs])
    for cut in range(1, len(docs)):
        cell = _Cell()
        got: list[dict[str, np.ndarray]] = []
        for i, doc in enumerate(docs):
            if i == cut:
                cell.value = _as_earlier_carry(cell.value)
            got += pack.process((0, doc), carry=cell, flush=cell, doc=(0, 1, 10 * i))
        got += pack.flush_tail(carry=cell)
        assert _equal_outputs(got, want), f"cut before document {cut}"
    # An earlier carry that is still open at the end is flushed as it was.
    cell = _Cell()
    for i, doc in enumerate(docs[:3]):
        list(pack.process((0, doc), carry=cell, flush=cell, doc=(0, 1, 10 * i)))
    earlier = _Cell()
    earlier.value = _as_earlier_carry(cell.value)
    tail = list(pack.flush_tail(carry=earlier))
    assert len(tail) == 1 and _equal_outputs(tail, list(pack.flush_tail(carry=cell)))


def test_a_checkpoint_with_earlier_carries_resumes_with_the_same_digests(tmp_path: Path) -> None:
    records = ["1 2 3 | 4 5 6 7 8 9 | 10", "11 | 12 13", "14 15 16 17 18 19 20 21 22 23 | 24 25"] * 3
    path = write_jsonl(tmp_path / "multi.jsonl", records)
    spec = pack_spec(path, 5, lanes=2, global_batch_size=2, split_bytes=40)
    ref = reference_run(spec, 16)
    rewritten = 0
    for s in range(1, 16, 3):
        state = zf.decode_state(ref.states[s]).to_plain()
        for lane in state["lane_states"]:
            values = lane["stages"]["pack"]["values"]
            if values.get("carry") is not None:
                values["carry"] = _as_earlier_carry(values["carry"])
                rewritten += 1
        with zf.Loader(spec, state=state) as loader:
            resumed = [(step, zf.batch_digest(batch)) for step, batch in itertools.islice(loader, 16 - s)]
        assert resumed == ref.digests[s:], f"resuming after {s} batches from earlier carries"
    assert rewritten >= 4


@pytest.mark.parametrize("strategy", ["concat", "best_fit"])
def test_outputs_never_share_memory_with_the_input_or_each_other(strategy: str) -> None:
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 500, int(n), dtype=np.int32) for n in rng.integers(1, 40, 50)]
    pack = ops.Pack(seq_len=16, strategy=strategy, labels=True)
    cell, out = _Cell(), []
    for i, doc in enumerate(docs):
        out += pack.process((0, doc), carry=cell, flush=cell, doc=(0, 1, i))
    out += pack.flush_tail(carry=cell)
    fields = [(key, a) for o in out for key, a in o.items()]
    arrays = [a for _, a in fields]
    # Only the positions and segments of one-piece sequences may be shared, and only read-only
    # (in place, they would change every sequence that shares them; read-only, numpy refuses).
    shared = {key for key, a in fields if not a.flags.writeable}
    assert shared <= {"position_ids", "segment_ids"}
    for k, a in enumerate(arrays):
        assert not any(np.shares_memory(a, d) for d in docs), "an output is a view of an input"
        for b in arrays[k + 1 :]:
            if np.shares_memory(a, b):
                assert not (a.flags.writeable or b.flags.writeable), "two outputs share writeable memory"
    with pytest.raises(ValueError, match="read-only"):
        next(o["position_ids"] for o in out if not o["position_ids"].flags.writeable)[0] = 7
