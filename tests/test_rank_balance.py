"""Balanced rank slices (``balance=``): the ranks' rows, put back in order, are the global batch;
the cost spread is no worse than contiguous slices on skewed batches; states are unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import Corpus, example_spec, run_batches
from hypothesis import given, settings
from hypothesis import strategies as st
from vlm_helpers import vlm_spec, write_captioned_images

import zephon_flow as zf
from zephon_flow.cli import main
from zephon_flow.core.batches import batch_digest
from zephon_flow.core.checkpoint.store import encode_state
from zephon_flow.core.errors import StageError
from zephon_flow.engine.balance import ROWS_FIELD, RankBalance, contiguous_rows, take_rows
from zephon_flow.service.server import BatchServer

pytestmark = pytest.mark.timeout(120)
STEPS = 4


@pytest.fixture(scope="module")
def text(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=4, global_batch_size=16, seq_len=16)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, corpus: Corpus) -> zf.LoaderSpec:
    images = write_captioned_images(tmp_path_factory.mktemp("balance_vlm"), 37, seed=3)
    # A finite pass: its last batches carry padding rows (valid false) and ragged documents.
    return vlm_spec(images, corpus.tokenizer_json, lanes=4, global_batch_size=8, max_images=3, epochs=1)


def _reference(spec: zf.LoaderSpec, steps: int | None = STEPS) -> list[dict[str, np.ndarray]]:
    return run_batches(spec, steps)


def _ranks(
    spec: zf.LoaderSpec, world: int, balance: Any, steps: int | None = STEPS, **kw: Any
) -> list[list[dict[str, np.ndarray]]]:
    return [run_batches(spec, steps, rank=r, world_size=world, balance=balance, **kw) for r in range(world)]


def _canonical(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The ranks' rows put back in global order by their ``rows`` field."""
    rows = np.concatenate([p[ROWS_FIELD] for p in parts])
    merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k != ROWS_FIELD}
    assert sorted(rows.tolist()) == list(range(len(rows)))
    return take_rows(merged, np.argsort(rows, kind="stable"))


@pytest.mark.parametrize(("world", "cost"), [(1, "attention"), (2, "attention"), (4, "tokens")])
def test_the_ranks_rows_in_order_are_the_global_batch(text: zf.LoaderSpec, world: int, cost: str) -> None:
    ref = _reference(text)
    ranks = _ranks(text, world, cost)
    for step, whole in enumerate(ref):
        parts = [rank[step] for rank in ranks]
        for p in parts:
            assert len(p[ROWS_FIELD]) == 16 // world
            assert np.all(np.diff(p[ROWS_FIELD]) > 0)  # ascending global indices
        assert batch_digest(_canonical(parts)) == batch_digest(whole)


def test_a_finite_vision_language_pass_balanced_by_images(vlm: zf.LoaderSpec) -> None:
    ref = _reference(vlm, None)
    ranks = _ranks(vlm, 2, "images", None)
    assert [len(r) for r in ranks] == [len(ref)] * 2
    assert not all(b["valid"].all() for b in ref)  # some rows are padding
    for step, whole in enumerate(ref):
        parts = [rank[step] for rank in ranks]
        assert batch_digest(_canonical(parts)) == batch_digest(whole)
        loads = [int(p["image_count"][p["valid"]].sum()) for p in parts]
        assert max(loads) - min(loads) <= 3  # max_images: LPT is within one row's cost


def _spread(costs: np.ndarray, assignment: np.ndarray) -> tuple[float, float]:
    loads = costs[assignment].sum(axis=1)
    return float(loads.max() - loads.min()), float(loads.max())


@pytest.mark.parametrize("world", [2, 4, 8])
def test_balanced_spread_is_no_worse_than_contiguous_on_skewed_batches(world: int) -> None:
    rng = np.random.default_rng(world)
    batches = [
        np.r_[np.full(16, 100.0), np.ones(48)],  # the costly rows together
        np.sort(rng.pareto(1.2, 64))[::-1].copy(),  # heavy-tailed, in decreasing order
        rng.integers(0, 9, 64).astype(float) ** 2,  # 0-8 images, squared
    ]
    for costs in batches:
        balanced = zf.balance_rows(costs, world)
        contiguous = contiguous_rows(len(costs), world)
        b_spread, b_max = _spread(costs, balanced)
        c_spread, c_max = _spread(costs, contiguous)
        assert b_spread <= c_spread and b_max <= c_max
        assert sorted(balanced.ravel().tolist()) == list(range(64))


def test_the_algorithm_is_pinned() -> None:
    # Highest cost first (ties by index), each to the least loaded rank with room (ties by rank).
    assert zf.balance_rows([5, 1, 4, 2, 3, 3], 2).tolist() == [[0, 1, 5], [2, 3, 4]]
    assert zf.balance_rows([1, 1, 1, 1], 2).tolist() == [[0, 2], [1, 3]]
    assert zf.balance_rows([7, 3], 1).tolist() == [[0, 1]]
    # LPT alone gives [[1, 2, 7], [5, 6, 8], [0, 3, 4]] (costs 17, 16, 14); the costliest rank
    # swaps row 1 (9) for row 4 (7) of rank 2: costs 15, 16, 16.
    assert zf.balance_rows([7, 9, 4, 0, 7, 5, 8, 4, 3], 3).tolist() == [[2, 4, 7], [5, 6, 8], [0, 1, 3]]


def test_deterministic_across_runs_and_worker_counts(text: zf.LoaderSpec) -> None:
    def digests(**kw: Any) -> list[list[str]]:
        return [[batch_digest(b) for b in rank] for rank in _ranks(text, 2, "attention", **kw)]

    first = digests()
    assert digests() == first
    assert digests(backend="threads", workers=3) == first


def test_states_are_the_same_with_and_without_balance(text: zf.LoaderSpec) -> None:
    def states(**kw: Any) -> list[dict[str, Any]]:
        out = []
        for rank in range(2):
            with zf.Loader(text, rank=rank, world_size=2, **kw) as loader:
                for step, _ in loader:
                    if step == 2:
                        break
                out.append(loader.state_dict())
        return out

    contiguous = encode_state(zf.merge_states(states()))
    balanced = states(balance="attention")
    # A balanced rank runs (and saves) every lane: its state alone is the whole checkpoint.
    assert encode_state(zf.LoaderState.from_plain(balanced[0])) == contiguous
    assert encode_state(zf.LoaderState.from_plain(balanced[1])) == contiguous


def test_resume_gives_the_same_rows(text: zf.LoaderSpec) -> None:
    whole = _ranks(text, 2, "attention", steps=5)
    with zf.Loader(text, rank=1, world_size=2, balance="attention") as loader:
        for step, _ in loader:
            if step == 1:
                break
        state = loader.state_dict()
    # Resumed balanced, and from a contiguous run's merged state (the states are the same).
    contiguous = []
    for rank in range(2):
        with zf.Loader(text, rank=rank, world_size=2) as loader:
            for step, _ in loader:
                if step == 1:
                    break
            contiguous.append(loader.state_dict())
    for start in (state, zf.merge_states(contiguous)):
        again = run_batches_from(text, start, rank=1, world_size=2, balance="attention", steps=3)
        assert [batch_digest(b) for b in again] == [batch_digest(b) for b in whole[1][2:5]]


def run_batches_from(
    spec: zf.LoaderSpec, state: Any, *, steps: int, **kw: Any
) -> list[dict[str, np.ndarray]]:
    out: list[tuple[int, dict[str, np.ndarray]]] = []
    with zf.Loader(spec, state=state, **kw) as loader:
        for item in loader:
            out.append(item)
            if len(out) == steps:
                break
    assert [step for step, _ in out] == list(range(2, 2 + steps))
    return [batch for _, batch in out]


def test_bad_options_are_refused_by_name(text: zf.LoaderSpec) -> None:
    bad: Any
    for bad in ("flops", 3, ["tokens"]):
        with pytest.raises(zf.SpecError, match=r"balance must be one of 'tokens', 'attention', 'images'"):
            zf.Loader(text, balance=bad)
    with pytest.raises(zf.SpecError, match=r"balance='images': global batch 0 has no 'image_count' field"):
        run_batches(text, 1, world_size=2, balance="images")
    with pytest.raises(zf.SpecError, match=r"balance=.*returned -1.0 for row 0 of global batch 0"):
        run_batches(text, 1, world_size=2, balance=lambda row: -1.0)
    with pytest.raises(StageError, match=r"balance=.*raised on row 0 of global batch 0: KeyError"):
        run_batches(text, 1, world_size=2, balance=lambda row: row["nope"])
    with pytest.raises(zf.SpecError, match=r"cannot be shared by world_size=3"):
        zf.balance_rows(np.ones(16), 3)
    with pytest.raises(zf.SpecError, match=r"balance must be one of"):
        BatchServer(text, balance="pixels")


def test_a_row_function_sees_its_documents(text: zf.LoaderSpec) -> None:
    def documents(row: Any) -> float:
        return float(len(row["documents"]))

    ref = _reference(text, 2)
    ranks = _ranks(text, 2, documents, 2)
    for step, whole in enumerate(ref):
        assert batch_digest(_canonical([r[step] for r in ranks])) == batch_digest(whole)
        assert RankBalance(cost=documents).costs(whole).tolist() == whole["documents_count"].tolist()


def test_zephon_serve_refuses_balance_with_lane_owners(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["serve", "nowhere.py:spec", "--port", "0", "--ray", "--balance", "tokens"]) == 2
    assert "--balance is not supported with --ray" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "nowhere.py:spec", "--port", "0", "--balance", "flops"])


def test_torch_dataset_gives_rows_and_every_lane(text: zf.LoaderSpec) -> None:
    from zephon_flow.torch import ZephonDataset

    ds = ZephonDataset.from_loader(text, rank=1, world_size=2, balance="attention")
    expected = _ranks(text, 2, "attention", 2)[1]
    got = []
    for step, batch in ds:
        got.append(batch)
        if step == 1:
            break
    ds.close()
    for a, b in zip(got, expected, strict=True):
        assert a[ROWS_FIELD].tolist() == b[ROWS_FIELD].tolist()
        assert batch_digest({k: v.numpy() for k, v in a.items()}) == batch_digest(b)
    state = ds.state_dict()
    assert sorted(state["lane_states"]) == ["0", "1", "2", "3"]  # a balanced rank saves every lane
    again = ZephonDataset.from_loader(text, rank=0, world_size=2, balance="attention")
    again.load_state_dict(state)
    step, batch = next(iter(again))
    again.close()
    assert step == 2
    assert batch_digest({k: v.numpy() for k, v in batch.items()}) == batch_digest(
        _ranks(text, 2, "attention", 3)[0][2]
    )


@pytest.fixture
def server(text: zf.LoaderSpec) -> Iterator[BatchServer]:
    srv = BatchServer(text, ahead=4, balance="attention").start()
    yield srv
    srv.stop(grace=None)


def test_served_balanced_rows_are_the_embedded_ones(server: BatchServer, text: zf.LoaderSpec) -> None:
    world = 2
    embedded = _ranks(text, world, "attention", 3)
    for rank in range(world):
        with zf.Client(f"127.0.0.1:{server.port}", rank, world, fingerprint=text.fingerprint) as client:
            got = []
            for step, batch in client:
                got.append(batch_digest(batch))
                if step == 2:
                    break
        assert got == [batch_digest(b) for b in embedded[rank]]


@given(
    costs=st.lists(st.integers(0, 1000), min_size=1, max_size=64),
    world=st.integers(1, 8),
)
@settings(max_examples=60, deadline=None)
def test_every_row_goes_to_exactly_one_rank(costs: list[int], world: int) -> None:
    rows = len(costs) - len(costs) % world or world
    values = np.asarray((costs * world)[:rows], dtype=float)
    got = zf.balance_rows(values, world)
    assert got.shape == (world, rows // world)
    assert sorted(got.ravel().tolist()) == list(range(rows))
    assert all(np.all(np.diff(r) > 0) for r in got)
    assert np.array_equal(zf.balance_rows(values, world), got)  # a pure function
