"""What a trainer saves of a ZephonDataset: the trained step despite read-ahead, DCP across world
sizes, topology resolved at the first iteration, gathers over a data-parallel subgroup."""

from __future__ import annotations

import io
import pickle
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers import Corpus, example_spec

import zephon_flow as zf
from zephon_flow.core.errors import SpecError, StateError
from zephon_flow.engine.simulate import global_batches, global_digests
from zephon_flow.torch import LaneBytes, StepMismatchWarning, ZephonDataset, gather_states, to_hf_inputs

LANES, BATCH = 4, 8
Items = list[tuple[int, dict[str, torch.Tensor]]]


def spec_of(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=LANES, global_batch_size=BATCH)


def read_ahead(ds: ZephonDataset, trained: int) -> Items:
    """A trainer whose loader reads one batch ahead: it trains on ``trained`` batches, and the
    dataset has yielded one more when the trainer saves."""
    out: Items = []
    batches = iter(ds)
    ahead = next(batches)
    while len(out) < trained:
        current, ahead = ahead, next(batches)
        out.append((current.step, current.batch))
    return out


def take(ds: ZephonDataset, n: int) -> Items:
    out: Items = []
    for step, batch in ds:
        out.append((step, batch))
        if len(out) == n:
            break
    return out


def digests(items: Items) -> list[tuple[int, str]]:
    return [(step, zf.batch_digest({k: v.numpy() for k, v in b.items()})) for step, b in items]


def glued(parts: list[Items]) -> list[tuple[int, str]]:
    """Global digests of several ranks' rows, step by step."""
    out = []
    for items in zip(*parts, strict=True):
        assert len({step for step, _ in items}) == 1
        whole = {k: np.concatenate([b[k].numpy() for _, b in items]) for k in items[0][1]}
        out.append((items[0][0], zf.batch_digest(whole)))
    return out


def resume_digests(spec: zf.LoaderSpec, state: dict[str, Any], n: int, **options: Any) -> list[Any]:
    ds = ZephonDataset.from_loader(spec, **options)
    ds.load_state_dict(state)
    try:
        return digests(take(ds, n))
    finally:
        ds.close()


# -- read-ahead -----------------------------------------------------------------------------------
def test_a_consumer_reading_ahead_saves_the_trained_step_not_the_yielded_one(corpus: Corpus) -> None:
    spec = spec_of(corpus)
    reference = global_digests(spec, steps=8)
    ds = ZephonDataset.from_loader(spec)
    trained = read_ahead(ds, 3)
    assert digests(trained) == reference[:3] and ds.next_step == 4
    naive, right = ds.state_dict(), ds.state_dict(step=3)
    ds.close()
    assert (naive["step"], right["step"]) == (4, 3)
    # The off-by-one: the state after the last batch yielded skips step 3, never trained on.
    assert resume_digests(spec, naive, 2) == reference[4:6]
    assert resume_digests(spec, right, 3) == reference[3:6]
    # The same state after a pickle (what a framework's torch.save does), on 2 thread workers.
    data = io.BytesIO()
    torch.save(right, data)
    data.seek(0)
    loaded = torch.load(data, weights_only=True)
    assert all(type(v) is bytes for v in loaded["lane_states"].values())
    assert resume_digests(spec, loaded, 3, backend="threads", workers=2) == reference[3:6]
    # A framework that knows its step is told, by name, when the loaded state disagrees.
    fresh = ZephonDataset.from_loader(spec)
    with pytest.warns(StepMismatchWarning) as caught:
        fresh.load_state_dict(naive, expected_step=3)
    assert str(caught[0].message).startswith(
        "zephon_flow: the loader state is at step 4 but the trainer resumes at step 3: the data "
        "continues at step 4, so steps 3..3 are never trained on; save the data state with "
        "state_dict(step=<the step the trainer resumes at>)"
    )


def test_the_ring_keeps_the_last_states_and_names_its_range(corpus: Corpus) -> None:
    spec = spec_of(corpus)
    reference = global_digests(spec, steps=9)
    ds = ZephonDataset.from_loader(spec, keep_states=3)
    assert ds.state_dict(step=0)["step"] == 0  # fresh: step 0 only
    with pytest.raises(StateError, match=r"nothing was yielded or loaded, so only step 0 can be asked for"):
        ds.state_dict(step=1)
    take(ds, 5)
    with pytest.raises(
        StateError,
        match=r"^ZephonDataset.state_dict\(step=2\): the dataset keeps the states from which steps "
        r"3..5 are next \(keep_states=3\)",
    ):
        ds.state_dict(step=2)
    kept = {step: ds.state_dict(step=step) for step in (3, 4, 5)}
    local = ds.local_state(step=4)
    # Across a second iteration (a new loader), the kept states stay valid.
    take(ds, 1)
    assert ds.state_dict(step=4) == kept[4]
    ds.close()
    for step, state in kept.items():
        assert resume_digests(spec, state, 2) == reference[step : step + 2]
    assert resume_digests(spec, {"step": 4, "loader_state": local}, 2) == reference[4:6]
    # A state loaded, then iterated past: still the one to save for its step.
    again = ZephonDataset.from_loader(spec, keep_states=4)
    again.load_state_dict(kept[3])
    take(again, 2)
    assert bytes(again.state_dict(step=3)["lane_states"]["1"]) == bytes(kept[3]["lane_states"]["1"])
    again.close()


def test_the_embedded_loader_keeps_states_by_step(corpus: Corpus) -> None:
    spec = spec_of(corpus)
    reference = global_digests(spec, steps=6)
    with zf.Loader(spec, keep_states=2) as loader:
        for step, _ in loader:
            if step == 3:
                break
        state = loader.state_dict(step=3)
        assert loader.state(step=4).step == 4
        with pytest.raises(
            StateError,
            match=r"Loader.state\(step=2\): the loader keeps the states from which steps 3..4 are next "
            r"\(keep_states=2\)",
        ):
            loader.state(step=2)
    with zf.Loader(spec, state=state) as loader:
        assert [(s, zf.batch_digest(b)) for s, b in _first(loader, 2)] == reference[3:5]


def _first(loader: zf.Loader, n: int) -> list[tuple[int, Any]]:
    out = []
    for item in loader:
        out.append(item)
        if len(out) == n:
            break
    return out


def test_state_dict_values_encode_lazily_and_pickle_as_bytes(corpus: Corpus) -> None:
    ds = ZephonDataset.from_loader(spec_of(corpus))
    take(ds, 2)
    state = ds.state_dict()
    ds.close()
    value = state["lane_states"]["2"]
    assert isinstance(value, LaneBytes) and value._data is None  # nothing encoded yet
    data = bytes(value)
    assert zf.decode_state(data).step == 2
    assert list(zf.decode_state(data).lane_states) == [2]
    assert pickle.loads(pickle.dumps(value)) == data and value == data


def test_to_hf_inputs_gives_causal_lm_fields(corpus: Corpus) -> None:
    spec = spec_of(corpus)
    (_, whole), *_ = global_batches(spec, steps=1)
    ds = ZephonDataset.from_loader(spec)
    ((_, batch),) = take(ds, 1)
    ds.close()
    hf = to_hf_inputs(batch)
    assert sorted(hf) == ["input_ids", "labels", "position_ids"]
    assert all(v.dtype == torch.int64 for v in hf.values())
    np.testing.assert_array_equal(hf["input_ids"].numpy(), whole["input_ids"])
    starts = whole["position_ids"] == 0
    np.testing.assert_array_equal(hf["labels"].numpy(), np.where(starts, -100, whole["input_ids"]))
    kept = to_hf_inputs(batch, keep=("documents",), labels=False)
    assert sorted(kept) == ["documents", "input_ids", "position_ids"]


def test_a_group_without_torch_distributed_is_refused_when_iterating(corpus: Corpus) -> None:
    ds = ZephonDataset.from_loader(spec_of(corpus), group=object())  # resolved later: accepted now
    with pytest.raises(
        SpecError,
        match=r"^ZephonDataset: built with group=, but torch.distributed is not initialised; "
        r"initialise it before iterating, or pass rank= and world_size=$",
    ):
        next(iter(ds))


# -- torch.distributed (gloo on 127.0.0.1, spawned processes) -------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(main: Any, world: int, corpus: Corpus, out: Path) -> None:
    """``world`` processes forked from this one (torch and the pipeline's modules are imported
    already: a spawned process would spend seconds importing them again)."""
    mp.start_processes(  # type: ignore[no-untyped-call]
        main, args=(world, free_port(), corpus, str(out)), nprocs=world, join=True, start_method="fork"
    )


def _two_ranks(rank: int, world: int, port: int, corpus: Corpus, out: str) -> None:
    spec = spec_of(corpus)
    # Built before init_process_group (as a framework may): the topology is taken when iterating.
    early = ZephonDataset.from_loader(spec)
    resumed = ZephonDataset.from_loader(spec)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        trained = read_ahead(early, 3)
        assert (early.rank, early.world_size) == (rank, world)
        dcp.save({"data": early.state_dict(step=3)}, checkpoint_id=f"{out}/saved-on-two")
        dcp.load({"data": resumed}, checkpoint_id=f"{out}/saved-on-one")
        assert resumed.next_step == 3
        torch.save({"trained": trained, "resumed": take(resumed, 3)}, f"{out}/rank-{rank}.pt")
        early.close()
        resumed.close()
    finally:
        dist.destroy_process_group()


def test_dcp_across_world_sizes_and_topology_resolved_at_iteration(corpus: Corpus, tmp_path: Path) -> None:
    spec = spec_of(corpus)
    reference = global_digests(spec, steps=6)
    one = ZephonDataset.from_loader(spec)
    read_ahead(one, 3)
    with pytest.warns(UserWarning, match=r"assuming the intent is to save in a single process"):
        dcp.save({"data": one.state_dict(step=3)}, checkpoint_id=str(tmp_path / "saved-on-one"), no_dist=True)
    one.close()

    spawn(_two_ranks, 2, corpus, tmp_path)
    ranks = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=False) for r in range(2)]
    # Disjoint rows: the two ranks' rows glued are the global batches (not rank 0 of 1 twice).
    assert glued([r["trained"] for r in ranks]) == reference[:3]
    assert glued([r["resumed"] for r in ranks]) == reference[3:6]  # 1 -> 2
    fresh = ZephonDataset.from_loader(spec)
    with pytest.warns(UserWarning, match=r"assuming the intent is to load in a single process"):
        dcp.load({"data": fresh}, checkpoint_id=str(tmp_path / "saved-on-two"), no_dist=True)
    assert digests(take(fresh, 3)) == reference[3:6]  # 2 -> 1
    fresh.close()


def _data_parallel_of_two(rank: int, world: int, port: int, corpus: Corpus, out: str) -> None:
    """4 ranks: tensor parallel 2 (ranks 2d and 2d+1 read the same rows), data parallel 2."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes every group
        ds = ZephonDataset.from_loader(spec_of(corpus), group=groups[rank % 2])
        trained = read_ahead(ds, 2)
        assert (ds.rank, ds.world_size) == (rank // 2, 2)
        over_dp = gather_states(ds, step=2)  # the dataset's group
        over_all = gather_states(ds, step=2, group=dist.group.WORLD)  # replicas agree and merge
        dcp.save({"data": ds.state_dict(step=2)}, checkpoint_id=f"{out}/dcp")
        torch.save({"trained": trained, "dp": over_dp, "all": over_all}, f"{out}/rank-{rank}.pt")
        ds.close()
    finally:
        dist.destroy_process_group()


def test_a_data_parallel_subgroup_gathers_and_checkpoints(corpus: Corpus, tmp_path: Path) -> None:
    spec = spec_of(corpus)
    reference = global_digests(spec, steps=5)
    spawn(_data_parallel_of_two, 4, corpus, tmp_path)
    ranks = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=False) for r in range(4)]
    assert digests(ranks[0]["trained"]) == digests(ranks[1]["trained"])  # tensor-parallel replicas
    assert glued([ranks[0]["trained"], ranks[2]["trained"]]) == reference[:2]
    assert len({r["dp"] for r in ranks} | {r["all"] for r in ranks}) == 1
    assert resume_digests(spec, {"step": 2, "loader_state": ranks[3]["dp"]}, 3) == reference[2:5]
    fresh = ZephonDataset.from_loader(spec)
    with pytest.warns(UserWarning, match=r"assuming the intent is to load in a single process"):
        dcp.load({"data": fresh}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert digests(take(fresh, 3)) == reference[2:5]
    fresh.close()
