"""Tests of Shuffle: a seeded permutation of its input, end drain, and checkpoint/resume."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpointing import assert_equal_output_after_checkpoint
from helpers import DocKey, chain_spec, run_batches, source_epochs, tagged_texts, write_jsonl

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.errors import SpecError


def shuffle_spec(path: str, buffer: int, **kwargs: object) -> zf.LoaderSpec:
    return chain_spec(path, ("key", DocKey()), ("shuffle", ops.Shuffle(buffer=buffer)), **kwargs)  # type: ignore[arg-type]


def doc_order(batches: list[dict]) -> list[int]:  # type: ignore[type-arg]
    return [int(d) for b in batches for d in b["doc"]]


@pytest.fixture
def docs40(tmp_path: Path) -> str:
    return write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 40, seed=5))


def test_a_finite_input_comes_out_as_a_permutation_including_the_drain(docs40: str) -> None:
    order = doc_order(run_batches(shuffle_spec(docs40, 8, epochs=1)))
    assert sorted(order) == list(range(40))  # the last 8 come from the end-of-input drain
    assert order != list(range(40))
    # Before the buffer is full nothing is emitted; then each output is one of the held ones.
    assert all(d < i + 9 for i, d in enumerate(order))


def test_a_buffer_larger_than_the_input_is_drained_in_a_seeded_order(docs40: str) -> None:
    order = doc_order(run_batches(shuffle_spec(docs40, 100, epochs=1)))
    assert sorted(order) == list(range(40))
    assert order != list(range(40))


def test_a_buffer_of_one_passes_elements_through_in_order(docs40: str) -> None:
    assert doc_order(run_batches(shuffle_spec(docs40, 1, epochs=1))) == list(range(40))


def test_draws_depend_on_the_seed_and_only_on_it(docs40: str) -> None:
    def order(seed: int) -> list[int]:
        return doc_order(run_batches(shuffle_spec(docs40, 8, epochs=1, seed=seed)))

    assert order(1) == order(1)
    assert order(1) != order(2)
    assert sorted(order(2)) == list(range(40))


def test_every_lane_shuffles_its_own_dealt_stream(docs40: str) -> None:
    # Two lanes: a lane stops the loader when its data ends, so take one epoch's worth only.
    spec = shuffle_spec(docs40, 4, lanes=2, global_batch_size=2, split_bytes=200)
    order = doc_order(run_batches(spec, 10))
    assert len(set(order)) == 20 and set(order) <= set(range(40))
    assert order != sorted(order)


def test_buffer_must_be_a_positive_integer() -> None:
    with pytest.raises(SpecError, match=r"Shuffle: buffer must be a positive integer, got 0"):
        ops.Shuffle(buffer=0)
    with pytest.raises(SpecError, match=r"Shuffle: buffer must be a positive integer, got 2.5"):
        ops.Shuffle(buffer=2.5)  # type: ignore[arg-type]


# -- checkpoints ---------------------------------------------------------------------------
def test_resume_at_every_step_across_epochs(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 12, seed=6))
    spec = shuffle_spec(path, 5, lanes=2, global_batch_size=4, split_bytes=120)
    steps = 15  # 60 outputs from 12 documents: about five epochs
    ref = assert_equal_output_after_checkpoint(spec, steps)
    assert min(source_epochs(spec, ref.final_state)["src"]) >= 2
    seen = doc_order(ref.batches)
    assert len(seen) == 60 and set(seen) == set(range(12))


def test_resume_at_every_step_until_the_drain_of_a_finite_input(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 16, seed=8))
    spec = shuffle_spec(path, 6, epochs=1, global_batch_size=1)
    ref = assert_equal_output_after_checkpoint(spec, 16)
    assert sorted(doc_order(ref.batches)) == list(range(16))
    # The resumed run ends exactly where the uninterrupted one does.
    with zf.Loader(spec, state=ref.states[-1]) as loader:
        assert list(loader) == []
