"""Tests of the embedded Loader: state refusals, merge_states, errors surfacing, lifecycle."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.coders import PickleCoder
from apache_beam.transforms.combiners import CountCombineFn
from apache_beam.transforms.userstate import BagStateSpec, CombiningValueStateSpec, ReadModifyWriteStateSpec
from checkpointing import assert_equal_output_after_checkpoint
from helpers import Corpus, DocKey, chain_spec, example_spec, run_batches, tagged_texts, write_jsonl

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.batches import split_ragged
from zephon_flow.core.errors import (
    DataError,
    FingerprintMismatchError,
    LaneCountMismatchError,
    SpecError,
    StageError,
    StateConflictError,
    StateError,
    ZephonError,
)
from zephon_flow.core.source import START, Split
from zephon_flow.engine.simulate import global_batches, global_digests
from zephon_flow.runners.dealing import Dealing


def state_after(spec: zf.LoaderSpec, steps: int, **loader_kwargs: Any) -> dict[str, Any]:
    with zf.Loader(spec, **loader_kwargs) as loader:
        for step, _ in loader:
            if step + 1 == steps:
                return loader.state_dict()
    raise AssertionError("the loader ended early")


# -- refusals of a state -------------------------------------------------------------------
def test_a_state_of_another_pipeline_names_the_differing_part(corpus: Corpus) -> None:
    state = state_after(example_spec(corpus, seq_len=16), 2)
    with pytest.raises(
        FingerprintMismatchError,
        match=r"written for another pipeline; these parts of the fingerprint differ: operator pack$",
    ):
        zf.Loader(example_spec(corpus, seq_len=32), state=state)
    with pytest.raises(FingerprintMismatchError, match=r"differ: operator mix; if only the Mix's weights"):
        zf.Loader(example_spec(corpus, weights=(0.5, 0.5)), state=state)
    with pytest.raises(FingerprintMismatchError, match=r"differ: seed$"):
        zf.Loader(example_spec(corpus, seed=1), state=state)


def test_a_state_for_changed_data_names_the_source(corpus: Corpus, tmp_path: Path) -> None:
    copy = Corpus(
        root=tmp_path,
        web_jsonl=shutil.copy(corpus.web_jsonl, str(tmp_path / "web.jsonl")),
        code_parquet=corpus.code_parquet,
        tokenizer_json=corpus.tokenizer_json,
        web_texts=corpus.web_texts,
        code_texts=corpus.code_texts,
    )
    state = state_after(example_spec(copy), 1)
    with open(copy.web_jsonl, "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "web 999 appended later"}) + "\n")
    with pytest.raises(FingerprintMismatchError, match=r"differ: data web$"):
        zf.Loader(example_spec(copy), state=state)


def test_a_state_for_another_lane_count_is_refused(corpus: Corpus) -> None:
    state = state_after(example_spec(corpus, lanes=4, global_batch_size=8), 1)
    with pytest.raises(
        LaneCountMismatchError,
        match=r"written for lanes=4, this spec has lanes=2; the lane count is part of a pipeline's identity",
    ):
        zf.Loader(example_spec(corpus, lanes=2, global_batch_size=8), state=state)


def test_a_state_missing_the_ranks_lanes_points_to_merge_states(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8)
    rank0 = state_after(spec, 2, rank=0, world_size=2)
    assert sorted(ls["lane"] for ls in rank0["lane_states"]) == [0, 1]
    with pytest.raises(
        StateError,
        match=r"no entry for lane\(s\) \[2, 3\], which rank 0 of 1 runs; gather every rank's state_dict\(\) and pass zf.merge_states\(states\)",
    ):
        zf.Loader(spec, state=rank0)
    with pytest.raises(StateError, match=r"no entry for lane\(s\) \[2\], which rank 2 of 4 runs"):
        zf.Loader(spec, rank=2, world_size=4, state=rank0)
    zf.Loader(spec, rank=1, world_size=4, state=rank0).close()  # lane 1 is there


# -- merge_states ----------------------------------------------------------------------------
def rank_states(
    spec: zf.LoaderSpec, world_size: int, steps: int, **loader_kwargs: Any
) -> list[dict[str, Any]]:
    return [
        state_after(spec, steps, rank=r, world_size=world_size, **loader_kwargs) for r in range(world_size)
    ]


def test_merge_states_unions_the_ranks_lanes(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8)
    merged = zf.merge_states(rank_states(spec, 2, 3))
    assert merged.step == 3 and sorted(merged.lane_states) == [0, 1, 2, 3]
    assert zf.encode_state(merged) == zf.encode_state(zf.LoaderState.from_plain(state_after(spec, 3)))
    # Ranks sharing lanes (W=8 > L=4) agree about them; bytes merge like dicts.
    eight = rank_states(spec, 8, 3)
    assert zf.encode_state(
        zf.merge_states([zf.encode_state(zf.LoaderState.from_plain(s)) for s in eight])
    ) == zf.encode_state(merged)


def test_merge_states_refuses_ranks_that_disagree_about_a_lane(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=2, global_batch_size=4)
    a, b = (state_after(spec, 2, rank=r, world_size=4) for r in (0, 1))  # both run lane 0
    tampered = zf.LoaderState.from_plain(b).to_plain()
    tampered["lane_states"][0]["cursor"]["mix_position"] += 1
    with pytest.raises(
        StateConflictError, match=r"states disagree about lane 0 at step 2 \(state 1 differs\)"
    ):
        zf.merge_states([a, tampered])


def test_merge_states_refuses_different_steps_pipelines_and_nothing(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=2, global_batch_size=4)
    with pytest.raises(
        StateConflictError, match=r"cannot merge states of different steps: 2 \(state 0\) and 3 \(state 1\)"
    ):
        zf.merge_states(
            [state_after(spec, 2, rank=0, world_size=2), state_after(spec, 3, rank=1, world_size=2)]
        )
    other = example_spec(corpus, lanes=2, global_batch_size=4, seed=5)
    with pytest.raises(
        FingerprintMismatchError, match=r"state 1 was written for another pipeline than state 0"
    ):
        zf.merge_states(
            [state_after(spec, 2, rank=0, world_size=2), state_after(other, 2, rank=1, world_size=2)]
        )
    with pytest.raises(StateConflictError, match=r"merge_states needs at least one state"):
        zf.merge_states([])


def test_ranks_sharing_a_lane_with_different_chunk_sizes_merge_at_the_end_of_the_data(tmp_path: Path) -> None:
    # chunk_records only sets how much stateless work is batched: the state of a lane after a
    # step must not depend on it, or ranks sharing that lane cannot be merged.
    path = write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 16, seed=8))
    spec = chain_spec(path, ("key", DocKey()), epochs=1, global_batch_size=2)
    a = state_after(spec, 8, rank=0, world_size=2, chunk_records=16)
    b = state_after(spec, 8, rank=1, world_size=2, chunk_records=3)
    assert zf.merge_states([a, b]).step == 8


# -- errors surfacing through the loader ---------------------------------------------------------
def malformed(tmp_path: Path) -> tuple[str, int]:
    """A JSONL file whose 6th line is not JSON; returns the path and that line's byte offset."""
    lines = [json.dumps({"text": t}) for t in tagged_texts("web", 8, seed=3)]
    lines[5] = '{"text": "web 5 unterminated'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path), sum(len(line) + 1 for line in lines[:5])


@pytest.mark.parametrize("backend", ["inline", "threads", "processes"])
def test_malformed_json_names_file_offset_and_operator(tmp_path: Path, backend: str) -> None:
    path, offset = malformed(tmp_path)
    spec = chain_spec(path, ("key", DocKey()))
    got = []
    with (
        pytest.raises(DataError) as info,
        zf.Loader(spec, backend=backend, workers=1, chunk_records=1) as loader,
    ):
        for _, batch in loader:
            got.append(int(batch["doc"][0]))
    message = str(info.value)
    assert message.startswith(
        f"ReadJsonl('src'): malformed JSON in {path} at byte {offset}: Unterminated string"
    )
    assert got == [0, 1, 2, 3, 4]  # everything before the bad line was delivered, once


def test_a_failing_stateless_dofn_is_a_stage_error_with_the_record(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 8, seed=3))
    offset = len(Path(path).read_text().splitlines()[0]) + 1
    spec = chain_spec(path, ("key", DocKey()), ("fail", _FailOn(1)))
    with pytest.raises(
        StageError,
        match=rf"^DoFn 'fail' raised ValueError: doc 1 \(on the record at {path} byte {offset}, via ReadJsonl\('src'\)\)",
    ):
        run_batches(spec)


def test_a_failing_stateful_dofn_is_a_stage_error_naming_it(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 8, seed=3))
    spec = chain_spec(path, ("key", DocKey()), ("count", _CountThenFail()))
    with pytest.raises(StageError, match=r"'count'.*ValueError: third element"):
        run_batches(spec)


class _FailOn(beam.DoFn):  # type: ignore[misc]
    def __init__(self, doc: int) -> None:
        self.doc = doc

    def process(self, sample: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        if int(sample["doc"]) == self.doc:
            raise ValueError(f"doc {self.doc}")
        yield sample


class _CountThenFail(beam.DoFn):  # type: ignore[misc]
    SEEN = ReadModifyWriteStateSpec("seen", PickleCoder())

    def process(self, element: tuple[int, Any], seen: Any = beam.DoFn.StateParam(SEEN)) -> Any:
        _, value = element
        n = (seen.read() or 0) + 1
        seen.write(n)
        if n == 3:
            raise ValueError("third element")
        yield value


# -- user state ----------------------------------------------------------------------------------
class _Triples(beam.DoFn):  # type: ignore[misc]
    """Groups every three documents into one sample, numbered by a combining counter."""

    HELD = BagStateSpec("held", PickleCoder())
    COUNT = CombiningValueStateSpec("count", PickleCoder(), CountCombineFn())

    def process(
        self,
        element: tuple[int, Any],
        held: Any = beam.DoFn.StateParam(HELD),
        count: Any = beam.DoFn.StateParam(COUNT),
    ) -> Any:
        _, sample = element
        held.add(int(sample["doc"]))
        count.add(1)
        docs = list(held.read())
        if len(docs) == 3:
            held.clear()
            yield {"docs": np.asarray(docs, dtype=np.int64), "n": np.int64(count.read())}


def test_a_user_stateful_dofn_with_bag_and_combining_state_resumes_at_every_step(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 10, seed=4))
    spec = chain_spec(
        path, ("key", DocKey()), ("triples", _Triples()), lanes=2, global_batch_size=2, split_bytes=200
    )
    ref = assert_equal_output_after_checkpoint(spec, 8)
    assert [int(n) for b in ref.batches for n in b["n"]][:4] == [3, 3, 6, 6]


# -- resume cost -----------------------------------------------------------------------------------
class _RecordingJsonl(ops.ReadJsonl):
    """ReadJsonl that logs every (split start, position) it is asked to read from."""

    calls: list[tuple[int, int]] = []  # a shared log: the inline backend runs in this process

    def read_split(self, split: Split, position: int) -> Iterator[Any]:
        _RecordingJsonl.calls.append((split.start, position))
        return super().read_split(split, position)


def test_resume_seeks_to_the_cursor_and_reads_nothing_before_it(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 30, seed=4))

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "src" >> _RecordingJsonl(path, split_bytes=300)
        return docs | "key" >> beam.ParDo(DocKey())

    spec = zf.LoaderSpec(build, lanes=1, global_batch_size=1)
    ref = run_batches(spec, 9, chunk_records=1, prefetch_chunks=1, prefetch=1)
    state = state_after(spec, 7, chunk_records=1, prefetch_chunks=1, prefetch=1)
    epoch, item, position, _ = state["lane_states"][0]["cursor"]["sources"][0]
    assert position != START  # the cursor is inside a split
    splits = spec.compile().sources[0].source.splits(1)
    dealing = Dealing([s.cost for s in splits], lanes=1, seed=0, source="src")
    index = dealing.shares(0, epoch)[item].split
    _RecordingJsonl.calls.clear()
    with zf.Loader(spec, state=state, chunk_records=1, prefetch_chunks=1, prefetch=1) as loader:
        step, batch = next(iter(loader))
    assert (step, zf.batch_digest(batch)) == (7, zf.batch_digest(ref[7]))
    assert _RecordingJsonl.calls[0] == (splits[index].start, position)


# -- lifecycle -----------------------------------------------------------------------------------
def test_state_dict_before_iterating_is_step_zero_and_resumes_like_a_fresh_start(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8)
    with zf.Loader(spec, rank=1, world_size=2) as loader:
        state = loader.state_dict()
    assert state["step"] == 0 and [ls["lane"] for ls in state["lane_states"]] == [2, 3]
    assert state["fingerprint"] == spec.fingerprint
    merged = zf.merge_states([zf.Loader(spec, rank=0, world_size=2).state_dict(), state])
    assert global_digests(spec, steps=4, state=merged) == global_digests(spec, steps=4)


def test_each_rank_gets_its_rows_of_the_global_batch(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=12)
    ((_, whole),) = list(global_batches(spec, steps=1))
    for world in (3, 6):
        for rank in range(world):
            (part,) = run_batches(spec, 1, rank=rank, world_size=world)
            rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
            mine = {k: v[rows] for k, v in whole.items() if k != "documents"}
            mine["documents"] = np.concatenate(split_ragged(whole)[rows])  # ragged: rows by count
            assert zf.batch_digest(part) == zf.batch_digest(mine)


def test_close_is_idempotent_and_the_loader_is_a_context_manager(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=2, global_batch_size=4)
    with zf.Loader(spec, backend="threads", workers=2) as loader:
        it = iter(loader)
        step, batch = next(it)
        assert step == 0 and batch["input_ids"].shape == (4, 16)
    loader.close()
    loader.close()
    with pytest.raises(ZephonError, match=r"this Loader is closed"):
        next(iter(loader))
    assert loader.state_dict()["step"] == 1  # the last state stays readable


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "gpu"}, r"unknown backend 'gpu'; choose one of inline, threads, processes"),
        ({"workers": 0}, r"workers must be a positive integer, got 0"),
        ({"prefetch": 0}, r"prefetch must be a positive integer, got 0"),
        ({"chunk_records": -1}, r"chunk_records must be a positive integer, got -1"),
        ({"prefetch_chunks": 1.5}, r"prefetch_chunks must be a positive integer, got 1.5"),
    ],
)
def test_bad_loader_options_are_refused(corpus: Corpus, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        zf.Loader(example_spec(corpus), **kwargs)


def test_the_spec_must_be_a_loader_spec() -> None:
    with pytest.raises(SpecError, match=r"spec must be a zf.LoaderSpec, got function"):
        zf.Loader(lambda p: p)  # type: ignore[arg-type]


def test_a_finite_input_ends_the_iteration(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 7, seed=4))
    batches = run_batches(
        chain_spec(path, ("key", DocKey()), ("shuffle", ops.Shuffle(buffer=3)), epochs=2, global_batch_size=2)
    )
    assert len(batches) == 7  # 14 documents, 2 per batch
    assert sorted(int(d) for b in batches for d in b["doc"]) == sorted(list(range(7)) * 2)
