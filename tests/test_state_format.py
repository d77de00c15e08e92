"""Checkpoint format 3: compact lanes, every older version still read, incremental chains, memory."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import struct
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
import zstandard
from checkpointing import assert_equal_output_after_checkpoint
from elastic import Segment, reference_digests, run_in_segments
from helpers import Corpus
from hypothesis import given, settings
from hypothesis import strategies as st
from vlm_helpers import encode, gradient

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.checkpoint import FORMAT_VERSION, blob, frame_decode, frame_encode, framed_file
from zephon_flow.core.checkpoint.packed_segments import PACKED_SEGMENTS
from zephon_flow.core.checkpoint.state import FeedCursor, LaneState, LoaderState, SourceCursor, StageState
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.errors import CorruptStateError, StateError
from zephon_flow.engine.simulate import global_digests

STEPS = 6


def packed_spec(corpus: Corpus, *, labels: bool = True, strategy: str = "concat") -> zf.LoaderSpec:
    """The README pipeline in small: two sources, mix, tokenize, pack (with labels), shuffle."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(corpus.web_jsonl, field="text", split_bytes=400)
        code = p | "code" >> ops.ReadParquet(corpus.code_parquet, column="content")
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.6, 0.4])
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(corpus.tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=24, labels=labels, strategy=strategy))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=6))

    return zf.LoaderSpec(build, lanes=4, seed=3, global_batch_size=12)


def frames(data: bytes) -> list[Any]:
    """The JSON trees of a format-3 checkpoint's frames (header first, then each lane)."""
    stream = io.BytesIO(data)
    framed_file.read_version(stream, "test")
    out = []
    while stream.tell() < len(data) - 32:
        size, _raw = struct.unpack("<QQ", stream.read(16))
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(stream.read(size))
        (head,) = struct.unpack_from("<Q", raw)
        out.append(json.loads(raw[8 : 8 + head]))
    return out


def column_nodes(tree: Any) -> list[dict[str, Any]]:
    if isinstance(tree, list):
        return [c for v in tree for c in column_nodes(v)]
    if isinstance(tree, dict):
        if "~c" in tree:
            return [tree["~c"]]
        return [c for v in tree.values() for c in column_nodes(v)]
    return []


def state_at(spec: zf.LoaderSpec, steps: int) -> LoaderState:
    final: list[dict[str, Any]] = []
    assert len(global_digests(spec, steps=steps, final_state=final)) == steps
    return LoaderState.from_plain(final[0])


def lane_digests(state: Any) -> dict[int, str]:
    st = to_loader_state(state)
    return {lane: blob.canonical_digest(ls.to_plain()) for lane, ls in st.lane_states.items()}


# -- compact lanes --------------------------------------------------------------------------
def test_compact_restores_give_the_uninterrupted_digests_at_every_step(corpus: Corpus) -> None:
    spec = packed_spec(corpus)
    ref = assert_equal_output_after_checkpoint(spec, STEPS)
    data = ref.states[-1]
    assert data[8:12] == struct.pack("<I", FORMAT_VERSION)
    lanes = frames(data)[1:]
    buffers = [c for lane in lanes for c in column_nodes(lane)]
    assert buffers, "no element list was stored as columns"
    # Pack's position_ids, segment_ids and labels are rebuilt, not stored
    assert all(
        c["derived"] == ["pack.segments/1", ["position_ids", "segment_ids", "labels"]] for c in buffers
    )
    assert all(set(c["cols"]) == {"input_ids", "documents", "~piece_starts", "~valid"} for c in buffers)
    # token ids are stored in the smallest type holding them (a 300-token vocabulary: uint16)
    assert {c["cols"]["input_ids"]["a"]["~a"][1] for c in buffers} == {"<u2"}
    assert {c["cols"]["input_ids"]["a"]["~a"][0] for c in buffers} == {"<i4"}


def test_best_fit_packing_also_restores_exactly(corpus: Corpus) -> None:
    assert_equal_output_after_checkpoint(packed_spec(corpus, strategy="best_fit", labels=False), 4)


def test_compact_restores_across_topology_changes(corpus: Corpus) -> None:
    spec = packed_spec(corpus)
    plan = [
        Segment(world_size=w, backend="threads", workers=2, prefetch=2, chunk_records=3, prefetch_chunks=2)
        for w in (1, 3, 2, 6)
    ]
    assert run_in_segments(spec, 8, [2, 3, 6], plan) == reference_digests(spec, 8)


def test_derived_fields_that_do_not_follow_the_rule_are_stored_as_they_are() -> None:
    pos = np.arange(8, dtype=np.int32)
    good = {
        "input_ids": np.arange(8, dtype=np.int32),
        "position_ids": pos,
        "segment_ids": np.zeros(8, np.int32),
    }
    odd = dict(good, position_ids=pos[::-1].copy())  # not Pack's rule: must be kept as is
    for items in ([good, good], [good, odd]):
        frame = frame_encode.Frame()
        raw = b"".join(bytes(c) for c in frame.chunks(items))
        back = frame_decode.decode_frame(raw)
        for a, b in zip(items, back, strict=True):
            assert all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
        (node,) = column_nodes(json.loads(raw[8 : 8 + struct.unpack_from("<Q", raw)[0]]))
        assert (node["derived"] is None) == (items[1] is odd)


# -- older versions -------------------------------------------------------------------------
def test_a_format_2_checkpoint_still_loads_and_resumes(corpus: Corpus, tmp_path: Path) -> None:
    spec = packed_spec(corpus)
    reference = reference_digests(spec, STEPS)
    state = state_at(spec, 3)
    plain = to_loader_state(state).to_plain()
    for lane in plain["lane_states"]:
        del lane["layout"]  # format 2 had no sample layout
    old = blob.encode({**plain, "format_version": 2})  # the format-2 writer
    assert old[8:12] == struct.pack("<I", 2)
    path = tmp_path / "old.zf"
    path.write_bytes(old)
    loaded = zf.load_state(path)
    assert all(ls.layout is None for ls in loaded.lane_states.values())
    expected = {
        lane: blob.canonical_digest({**ls.to_plain(), "layout": None})
        for lane, ls in to_loader_state(state).lane_states.items()
    }
    assert lane_digests(loaded) == expected
    assert global_digests(spec, steps=STEPS - 3, state=loaded, world_size=2) == reference[3:]
    # and re-saved, it is format 3, smaller, and still the same state
    zf.save_state(loaded, tmp_path / "new.zf")
    assert (tmp_path / "new.zf").read_bytes()[8:12] == struct.pack("<I", 3)
    assert (tmp_path / "new.zf").stat().st_size < len(old)
    assert lane_digests(zf.load_state(tmp_path / "new.zf")) == expected


def test_format_3_bytes_round_trip_exactly(corpus: Corpus) -> None:
    data = zf.encode_state(state_at(packed_spec(corpus), 2))
    assert zf.encode_state(zf.decode_state(data)) == data


# -- incremental checkpoints ----------------------------------------------------------------
@pytest.fixture(scope="module")
def chain(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A full checkpoint after 2 steps, a child after 3 on it, a grandchild after 5 on the child."""
    spec = packed_spec(corpus)
    root = tmp_path_factory.mktemp("chain")
    states = {s: state_at(spec, s) for s in (1, 2, 3, 5)}
    full, child, grandchild = root / "full.zf", root / "child.zf", root / "grandchild.zf"
    stats = {
        "full": zf.save_state(states[2], full),
        "child": zf.save_state(states[3], child, base=full),
        "grandchild": zf.save_state(states[5], grandchild, base=child),
    }
    return {"spec": spec, "states": states, "root": root, "stats": stats}


def copy_chain(chain: dict[str, Any], to: Path) -> Path:
    for name in ("full.zf", "child.zf", "grandchild.zf"):
        (to / name).write_bytes((chain["root"] / name).read_bytes())
    return to


def test_an_incremental_chain_loads_the_same_state_and_resumes(chain: dict[str, Any]) -> None:
    stats = chain["stats"]
    assert stats["child"].rows_from_base > 0 and stats["grandchild"].rows_from_base > 0
    assert stats["child"].written < stats["full"].written
    loaded = zf.load_state(chain["root"] / "grandchild.zf")
    assert loaded.step == 5
    assert lane_digests(loaded) == lane_digests(chain["states"][5])
    spec = chain["spec"]
    assert global_digests(spec, steps=3, state=loaded, world_size=3) == reference_digests(spec, 8)[5:]


def test_a_missing_base_is_refused_by_name(chain: dict[str, Any], tmp_path: Path) -> None:
    root = copy_chain(chain, tmp_path)
    (root / "full.zf").unlink()
    with pytest.raises(
        StateError, match=rf"{root}/child.zf is incremental on base {root}/full.zf, which is missing"
    ):
        zf.load_state(root / "grandchild.zf")


def test_a_corrupted_link_is_refused_by_name(chain: dict[str, Any], tmp_path: Path) -> None:
    root = copy_chain(chain, tmp_path)
    data = bytearray((root / "child.zf").read_bytes())
    data[len(data) // 2] ^= 0x10
    (root / "child.zf").write_bytes(bytes(data))
    with pytest.raises(CorruptStateError, match=rf"{root}/child.zf: checksum mismatch"):
        zf.load_state(root / "grandchild.zf")


def test_a_replaced_base_is_refused_by_name(chain: dict[str, Any], tmp_path: Path) -> None:
    root = copy_chain(chain, tmp_path)
    zf.save_state(chain["states"][1], root / "full.zf")  # a valid checkpoint, but not the base
    with pytest.raises(
        CorruptStateError,
        match=rf"{root}/child.zf is incremental on base {root}/full.zf, which was altered or replaced",
    ):
        zf.load_state(root / "grandchild.zf")


def test_incremental_bytes_need_their_file(chain: dict[str, Any]) -> None:
    data = (chain["root"] / "child.zf").read_bytes()
    with pytest.raises(StateError, match=r"checkpoint is an incremental checkpoint on base 'full.zf'"):
        zf.decode_state(data)


def test_a_base_of_another_pipeline_is_refused(chain: dict[str, Any], corpus: Corpus, tmp_path: Path) -> None:
    other = state_at(packed_spec(corpus, labels=False), 2)
    with pytest.raises(StateError, match=r"was written for another pipeline or lane count than this state"):
        zf.save_state(other, tmp_path / "x.zf", base=chain["root"] / "full.zf")


@pytest.mark.parametrize(
    ("target", "base", "chain_text"),
    [
        ("child.zf", "child.zf", "child.zf"),  # over its own base
        ("full.zf", "grandchild.zf", "full.zf <- .*child.zf <- .*grandchild.zf"),  # over a base's base
    ],
)
def test_a_save_over_a_file_of_its_own_chain_is_refused_and_changes_nothing(
    chain: dict[str, Any], tmp_path: Path, target: str, base: str, chain_text: str
) -> None:
    root = copy_chain(chain, tmp_path)
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    with pytest.raises(
        StateError,
        match=rf"cannot save to {root}/{target}: it is a file of the chain of bases .*{chain_text}",
    ):
        zf.save_state(chain["states"][5], root / target, base=root / base)
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before  # no temporary file either
    assert lane_digests(zf.load_state(root / "grandchild.zf")) == lane_digests(chain["states"][5])
    # through a symbolic link too
    (root / "alias.zf").symlink_to(root / target)
    with pytest.raises(StateError, match="cannot save to"):
        zf.save_state(chain["states"][5], root / "alias.zf", base=root / base)


def test_a_save_to_a_directory_is_refused_before_any_work(chain: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(
        IsADirectoryError, match=rf"is a directory; give the path of a file to write: '{tmp_path}/ckpt'"
    ):
        zf.save_state(chain["states"][2], tmp_path / "ckpt")
    assert os.listdir(tmp_path) == ["ckpt"] and os.listdir(tmp_path / "ckpt") == []


def test_a_path_given_as_a_state_says_to_load_it(chain: dict[str, Any]) -> None:
    path = chain["root"] / "full.zf"
    for as_given in (path, str(path)):
        with pytest.raises(
            StateError, match=re.escape(f"not a path: read the checkpoint file with zf.load_state('{path}')")
        ):
            zf.Loader(chain["spec"], state=as_given)  # type: ignore[arg-type]
        with pytest.raises(StateError, match="not a path"):
            zf.merge_states([as_given])


def test_save_leaves_no_temporary_file_and_returns_its_size(chain: dict[str, Any], tmp_path: Path) -> None:
    stats = zf.save_state(chain["states"][2], tmp_path / "ck.zf")
    assert os.listdir(tmp_path) == ["ck.zf"]
    assert stats.written == (tmp_path / "ck.zf").stat().st_size


# -- memory -----------------------------------------------------------------------------------
def synthetic_state(lanes: int, rows: int, seq_len: int) -> LoaderState:
    """Lanes whose shuffle buffers hold packed sequences (three pieces each, GPT-2-sized ids)."""
    rng = np.random.default_rng(0)
    states = {}
    for lane in range(lanes):
        buffer = []
        for _ in range(rows):
            lens = np.diff(
                np.concatenate([[0], np.sort(rng.choice(seq_len - 1, 2, replace=False) + 1), [seq_len]])
            )
            buffer.append(
                {
                    "input_ids": rng.integers(0, 50257, seq_len).astype(np.int32),
                    "position_ids": np.concatenate([np.arange(n, dtype=np.int32) for n in lens]),
                    "segment_ids": np.repeat(np.arange(3, dtype=np.int32), lens),
                    "documents": rng.integers(0, 1 << 20, (3, 3)),
                }
            )
        stages = {"shuffle": StageState({"buffer": buffer}, {}, rows)}
        states[lane] = LaneState(lane, FeedCursor(0, [SourceCursor.first()], skipped=[0]), stages=stages)
    return LoaderState(1, lanes, {"total": "synthetic"}, states)


def test_saving_holds_about_one_lane_at_a_time(tmp_path: Path) -> None:
    state = synthetic_state(lanes=6, rows=256, seq_len=1024)
    lane_raw = 256 * 3 * 1024 * 4
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        zf.save_state(state, tmp_path / "ck.zf")
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    # generous: the stacked columns of one lane and their checks, never the whole state (6 lanes)
    assert peak < 2 * lane_raw, f"saving took {peak / lane_raw:.2f} lanes' raw state"
    back = zf.load_state(tmp_path / "ck.zf")
    assert lane_digests(back) == lane_digests(state)


def test_multimodal_sequences_are_stored_compactly_and_restore_exactly(
    corpus: Corpus, tmp_path_factory: pytest.TempPathFactory
) -> None:
    shard = tmp_path_factory.mktemp("images") / "shard.tar"
    with tarfile.open(shard, "w") as tar:
        for i in range(10):
            for name, data in (
                (f"{i:05d}.jpg", encode(gradient(20 + 5 * i, 30, seed=i), "JPEG", quality=85)),
                (f"{i:05d}.txt", f"image {i} {'word ' * (i % 4)}".encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    def build(p: beam.Pipeline) -> beam.PCollection:
        samples = p | "images" >> ops.ReadWebDataset(str(shard), samples_per_split=3)
        decoded = samples | "decode" >> beam.ParDo(ops.DecodeImage(field="jpg", draft_size=8))
        resized = decoded | "resize" >> beam.ParDo(ops.ResizeImage(8))
        tokens = resized | "caption" >> beam.ParDo(ops.TokenizeField(corpus.tokenizer_json, field="txt"))
        packed = tokens | "pack" >> beam.ParDo(
            ops.PackMultimodal(24, image_token_id=1, tokens_per_image=4, max_images=3)
        )
        return packed | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=5))

    spec = zf.LoaderSpec(build, lanes=2, seed=0, global_batch_size=2)
    ref = assert_equal_output_after_checkpoint(spec, 5)
    buffers = [c for lane in frames(ref.states[-1])[1:] for c in column_nodes(lane)]
    assert buffers and all(
        c["derived"] == ["pack.segments/1", ["position_ids", "segment_ids"]] for c in buffers
    )
    assert all("images" in c["cols"] for c in buffers)


@st.composite
def packed_rows(draw: st.DrawFn) -> dict[str, np.ndarray]:
    """Rows as Pack makes them (pieces then padding), sometimes perturbed off Pack's rule."""
    width = draw(st.integers(1, 12))
    rows = draw(st.integers(1, 6))
    ids, pos, seg = (np.zeros((rows, width), dtype=np.int32) for _ in range(3))
    for r in range(rows):
        valid = draw(st.integers(0, width))
        cuts = sorted(draw(st.sets(st.integers(1, max(valid - 1, 1)), max_size=3))) if valid > 1 else []
        bounds = [0, *[c for c in cuts if c < valid], valid]
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            pos[r, a:b] = np.arange(b - a)
            seg[r, a:b] = k
        seg[r, valid:] = -1
        ids[r] = draw(st.lists(st.integers(0, 70000), min_size=width, max_size=width))
    labels = np.where(pos == 0, np.int32(-100), ids).astype(np.int32)
    out = {"input_ids": ids, "position_ids": pos, "segment_ids": seg, "labels": labels}
    if draw(st.booleans()):  # perturb one entry of one field
        field = draw(st.sampled_from(["position_ids", "segment_ids", "labels"]))
        r, c = draw(st.integers(0, rows - 1)), draw(st.integers(0, width - 1))
        out[field][r, c] += draw(st.sampled_from([-1, 1, 2]))
    return out


@settings(max_examples=300, deadline=None)
@given(columns=packed_rows())
def test_packed_segments_are_accepted_only_when_rebuilt_bit_for_bit(columns: dict[str, np.ndarray]) -> None:
    reduced = PACKED_SEGMENTS.reduce(columns)
    if reduced is None:
        return
    rebuilt = PACKED_SEGMENTS.rebuild({"input_ids": columns["input_ids"]}, reduced.stored, reduced.derived)
    assert set(rebuilt) == set(reduced.derived) == {"position_ids", "segment_ids", "labels"}
    for name, array in rebuilt.items():
        assert isinstance(array, np.ndarray) and array.dtype == np.int32
        np.testing.assert_array_equal(array, columns[name])
