"""Tests of zephon_flow.torch: ZephonDataset over a Loader and a (fake) Client, its state, gather_states."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers import Corpus, example_spec
from torch.utils.data import DataLoader

import zephon_flow as zf
from zephon_flow.core.batches import split_ragged
from zephon_flow.core.checkpoint.store import encode_state
from zephon_flow.core.errors import CorruptStateError, FingerprintMismatchError, SpecError, StateError
from zephon_flow.engine.simulate import global_batches, global_digests
from zephon_flow.torch import ZephonDataset, gather_states

LANES, BATCH = 4, 8


def spec_of(corpus: Corpus, **kwargs: Any) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=LANES, global_batch_size=BATCH, **kwargs)


def take(ds: ZephonDataset, n: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
    out = []
    for item in DataLoader(ds, batch_size=None, num_workers=0):
        out.append(item)
        if len(out) == n:
            break
    return out


def digests_of(items: list[Any]) -> list[tuple[int, str]]:
    return [(int(step), zf.batch_digest({k: v.numpy() for k, v in batch.items()})) for step, batch in items]


def topology_digests(spec: zf.LoaderSpec, state: dict[str, Any], world_size: int, steps: int) -> list[Any]:
    """Global digests of ``steps`` batches from ``world_size`` datasets all loading ``state``."""
    datasets = [ZephonDataset.from_loader(spec, rank=r, world_size=world_size) for r in range(world_size)]
    for ds in datasets:
        ds.load_state_dict(state)
    parts = [take(ds, steps) for ds in datasets]
    for ds in datasets:
        ds.close()
    out = []
    for items in zip(*parts, strict=True):
        assert len({int(step) for step, _ in items}) == 1
        glued = {k: np.concatenate([b[k].numpy() for _, b in items]) for k in items[0][1]}
        out.append((int(items[0][0]), zf.batch_digest(glued)))
    return out


# -- embedded ------------------------------------------------------------------------------------
def test_batches_are_the_loaders_rows_as_tensors(corpus: Corpus) -> None:
    spec = spec_of(corpus)
    ds = ZephonDataset.from_loader(spec, rank=1, world_size=2)
    got = take(ds, 3)
    ds.close()
    expected = [b for _, b in global_batches(spec, steps=3)]
    for (_, batch), whole in zip(got, expected, strict=True):
        assert sorted(batch) == ["documents", "documents_count", "input_ids", "position_ids", "segment_ids"]
        for key in ("input_ids", "position_ids", "segment_ids", "documents_count"):
            tensor = batch[key]
            assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.int32
            np.testing.assert_array_equal(tensor.numpy(), whole[key][BATCH // 2 :])
        # Provenance is ragged: this rank's sequences' document rows, in order.
        rows = split_ragged(whole)[BATCH // 2 :]
        np.testing.assert_array_equal(batch["documents"].numpy(), np.concatenate(rows))
    assert [int(step) for step, _ in got] == [0, 1, 2]


def test_state_dict_resumes_after_the_last_batch_yielded(corpus: Corpus) -> None:
    spec = spec_of(corpus)
    reference = global_digests(spec, steps=6)
    ds = ZephonDataset.from_loader(spec)
    fresh = ds.state_dict()
    assert fresh == {"step": 0, "lane_states": {str(lane): b"" for lane in range(LANES)}}
    first = take(ds, 2)
    state = ds.state_dict()
    assert state["step"] == 2 and sorted(state["lane_states"]) == ["0", "1", "2", "3"]
    assert all(isinstance(bytes(v), bytes) for v in state["lane_states"].values())
    # A second iteration continues where the first stopped.
    second = take(ds, 1)
    ds.close()
    assert digests_of(first + second) == reference[:3]

    again = ZephonDataset.from_loader(spec)
    again.load_state_dict(state)
    assert again.next_step == 2 and again.state_dict() == state  # before iterating: what was loaded
    assert digests_of(take(again, 4)) == reference[2:6]
    again.close()

    restarted = ZephonDataset.from_loader(spec, backend="threads", workers=2)
    restarted.load_state_dict(fresh)
    assert digests_of(take(restarted, 2)) == reference[:2]
    restarted.close()


def test_a_single_ranks_state_does_not_resume_another_topology(corpus: Corpus) -> None:
    spec = spec_of(corpus)
    ds = ZephonDataset.from_loader(spec, rank=0, world_size=2)
    take(ds, 1)
    local = ds.state_dict()  # this rank's lanes only
    assert sorted(local["lane_states"]) == ["0", "1"]
    ds.close()
    other = ZephonDataset.from_loader(spec, rank=1, world_size=2)
    with pytest.raises(StateError, match=r"no entry for lane\(s\) \[2, 3\], which rank 1 of 2 runs"):
        other.load_state_dict(local)


def test_bad_states_are_refused_with_a_reason(corpus: Corpus) -> None:
    spec = spec_of(corpus)
    ds = ZephonDataset.from_loader(spec)
    take(ds, 1)
    state = ds.state_dict()
    ds.close()
    fresh = ZephonDataset.from_loader(spec)
    with pytest.raises(CorruptStateError, match=r"missing 'loader_state'"):
        fresh.load_state_dict({"step": 1})
    with pytest.raises(CorruptStateError, match=r"'loader_state' should be bytes, found str"):
        fresh.load_state_dict({"step": 1, "loader_state": "x"})
    with pytest.raises(CorruptStateError, match=r"'lane_states'\['0'\] should be bytes, found int"):
        fresh.load_state_dict({"step": 1, "lane_states": {"0": 5}})
    with pytest.raises(CorruptStateError, match=r"says step 2, its loader state step 1"):
        fresh.load_state_dict({"step": 2, "lane_states": state["lane_states"]})
    with pytest.raises(CorruptStateError, match=r"is at step 3 but holds no loader state"):
        fresh.load_state_dict({"step": 3, "lane_states": {"0": b""}})
    with pytest.raises(FingerprintMismatchError, match=r"differ: seed$"):
        ZephonDataset.from_loader(spec_of(corpus, seed=5)).load_state_dict(state)


def test_options_are_checked_up_front(corpus: Corpus) -> None:
    with pytest.raises(
        SpecError, match=r"from_loader: backend must be one of inline, threads, processes, ray, got 'gpu'"
    ):
        ZephonDataset.from_loader(spec_of(corpus), backend="gpu")
    with pytest.raises(SpecError, match=r"from_loader: workers must be a positive integer, got 0"):
        ZephonDataset.from_loader(spec_of(corpus), workers=0)
    with pytest.raises(SpecError, match=r"world_size=3: every rank must get the same number of rows"):
        ZephonDataset.from_loader(spec_of(corpus), rank=0, world_size=3)
    with pytest.raises(SpecError, match=r"pass a state with load_state_dict, not state="):
        ZephonDataset.from_loader(spec_of(corpus), state=b"")
    with pytest.raises(SpecError, match=r"from_client: rank must be in \[0, 2\), got 2"):
        ZephonDataset.from_client("x:1", rank=2, world_size=2, client_factory=FakeClient)


def test_dataloader_workers_are_refused(corpus: Corpus) -> None:
    ds = ZephonDataset.from_loader(spec_of(corpus))
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(SpecError, match=r"use DataLoader\(\.\.\., num_workers=0\)"):
        next(iter(loader))


def test_a_dataloader_batch_size_is_refused_with_what_to_use(corpus: Corpus) -> None:
    ds = ZephonDataset.from_loader(example_spec(corpus))
    with pytest.raises(SpecError) as err:
        next(iter(DataLoader(ds, batch_size=8, num_workers=0)))
    assert str(err.value).startswith(
        "ZephonDataset yields whole batches (this rank's rows of one global batch per step), but the "
        "DataLoader collated 8 of them (steps 0..7) into one: use DataLoader(dataset, batch_size=None, "
        "num_workers=0)"
    )
    step, batch = next(iter(DataLoader(ZephonDataset.from_loader(example_spec(corpus)), batch_size=None)))
    assert step == 0 and isinstance(batch["input_ids"], torch.Tensor)


def test_import_zephon_flow_does_not_import_torch() -> None:
    code = "import sys, zephon_flow; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


# -- served (a fake Client with zf.Client's interface) --------------------------------------------
class FakeClient:
    """Yields ``(step, {"x": tensor of rows})`` from ``start_step``; records checkpoints and closes."""

    log: list[Any] = []

    def __init__(
        self,
        address: str,
        rank: int,
        world_size: int,
        start_step: int = 0,
        as_torch: bool = False,
        **options: Any,
    ) -> None:
        assert as_torch, "ZephonDataset asks the client for tensors"
        self.rank, self.world_size, self.next_step = rank, world_size, start_step
        FakeClient.log.append(("open", address, rank, world_size, start_step, options))

    def __iter__(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        while True:
            step = self.next_step
            self.next_step += 1
            yield step, {"x": torch.full((2,), step * 10 + self.rank, dtype=torch.int64)}

    def checkpoint(self, step: int) -> str:
        FakeClient.log.append(("checkpoint", step))
        return f"/srv/ck/step{step}.zfstate"

    def close(self) -> None:
        FakeClient.log.append(("close",))


def test_over_a_client_the_state_is_the_step() -> None:
    FakeClient.log = []
    ds = ZephonDataset.from_client("127.0.0.1:5", rank=1, world_size=2, client_factory=FakeClient, token="t")
    assert ds.served and ds.state_dict() == {"step": 0}
    got = take(ds, 3)
    assert [int(s) for s, _ in got] == [0, 1, 2]
    assert [b["x"].tolist() for _, b in got] == [[1, 1], [11, 11], [21, 21]]
    assert ds.state_dict() == {"step": 3}
    assert ds.checkpoint_on_server() == "/srv/ck/step3.zfstate"
    ds.close()

    again = ZephonDataset.from_client("127.0.0.1:5", rank=0, world_size=4, client_factory=FakeClient)
    again.load_state_dict({"step": 3})
    assert [int(s) for s, _ in take(again, 2)] == [3, 4]
    assert FakeClient.log[0] == ("open", "127.0.0.1:5", 1, 2, 0, {"token": "t"})
    assert ("checkpoint", 3) in FakeClient.log
    assert ("open", "127.0.0.1:5", 0, 4, 3, {}) in FakeClient.log
    with pytest.raises(StateError, match=r"no loader state: the server holds it"):
        gather_states(again)
    with pytest.raises(SpecError, match=r"start step with load_state_dict"):
        ZephonDataset.from_client("x:1", client_factory=FakeClient, start_step=2)


# -- gather_states over torch.distributed ---------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, corpus: Corpus, out: str, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ds = ZephonDataset.from_loader(spec_of(corpus))  # rank and world size from torch.distributed
        take(ds, steps)
        dcp.save({"data": ds}, checkpoint_id=f"{out}/dcp")
        merged = gather_states(ds)
        Path(f"{out}/gathered-{rank}.zfstate").write_bytes(merged)
        ds.close()
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_gather_a_state_that_resumes_on_one_and_four(corpus: Corpus, tmp_path: Path) -> None:
    spec = spec_of(corpus)
    steps, more = 3, 3
    mp.spawn(_rank_main, args=(2, free_port(), corpus, str(tmp_path), steps), nprocs=2, join=True)  # type: ignore[no-untyped-call]
    gathered = [(tmp_path / f"gathered-{r}.zfstate").read_bytes() for r in range(2)]
    assert gathered[0] == gathered[1]
    assert sorted(zf.decode_state(gathered[0]).lane_states) == list(range(LANES))

    reference = global_digests(spec, steps=steps + more)[steps:]
    for world in (1, 4):
        template = ZephonDataset.from_loader(spec, rank=0, world_size=world)
        loaded: dict[str, Any] = {"data": template.state_dict()}
        with pytest.warns(UserWarning, match=r"assuming the intent is to load in a single process"):
            dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        assert loaded["data"]["step"] == steps
        # DCP kept each rank's lanes under their own keys: all of them, as the gathered state has.
        parts = loaded["data"]["lane_states"]
        assert sorted(parts) == [str(lane) for lane in range(LANES)]
        assert encode_state(zf.merge_states([bytes(p) for p in parts.values()])) == gathered[0]
        assert topology_digests(spec, loaded["data"], world, more) == reference
