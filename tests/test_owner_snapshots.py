"""Packed lane snapshots (``cluster/snapshots.py``): what a coordinator keeps to replace an owner
unpacks to the owner's snapshot exactly, pickles each buffered element once, and a replacement
started from it gives the embedded Loader's bytes."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from helpers import Corpus, example_spec

import zephon_flow as zf
from zephon_flow.cluster import Coordinator, LaneOwner, OwnerOptions
from zephon_flow.cluster.snapshots import Held, PackedSnapshot, SnapshotPacker
from zephon_flow.core.assemble import assemble_rows
from zephon_flow.core.batches import batch_digest, concat
from zephon_flow.core.checkpoint.state import FeedCursor, LaneState, LoaderState, SourceCursor, StageState
from zephon_flow.core.checkpoint.store import encode_state
from zephon_flow.core.lanes import RankSlice
from zephon_flow.engine.simulate import global_digests

LANES, BATCH, STEPS = 6, 12, 10


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=LANES, global_batch_size=BATCH)


def _state(spec: zf.LoaderSpec, step: int, lanes: dict[int, LaneState]) -> bytes:
    return encode_state(LoaderState(step, spec.lanes, dict(spec.fingerprint), lanes, []))


def _wire(packed: PackedSnapshot) -> PackedSnapshot:
    """As the coordinator gets it: pickled by the owner's process, unpickled by its own."""
    got: PackedSnapshot = pickle.loads(pickle.dumps(packed))
    return got


def test_packed_snapshots_unpack_to_the_same_state_and_pickle_each_element_once(spec: zf.LoaderSpec) -> None:
    owner = LaneOwner(spec, list(range(LANES)), state=None, readers={0: 0}, options=OwnerOptions(ahead=4))
    owner.start()
    packer = SnapshotPacker()
    rs = RankSlice(rank=0, world_size=1, lanes=LANES, global_batch_size=BATCH)
    try:
        counts, kept = [], None
        for step in range(STEPS):
            assert owner.share(rs, step, timeout=30) is not None
            snaps = owner.snapshot(step)
            assert snaps is not None
            expected = _state(spec, step, snaps)
            whole = _wire(packer.pack(step, snaps))
            assert set(whole.items) == set(whole.keys)
            assert _state(spec, step, whole.unpack()) == expected
            # As the coordinator asks: the items it holds are not sent again.
            sent = _wire(packer.pack(step, snaps, None if kept is None else kept.held()))
            assert packer.pickled == 0  # the same snapshot again: nothing pickled twice
            kept = sent.complete(kept)
            assert kept.items == whole.items
            assert _state(spec, step, kept.unpack()) == expected
            counts.append((len(sent.items), len(whole.items)))
        # The buffered elements outlive a step: later gathers send only the new ones.
        assert all(sent < items for sent, items in counts[2:])
    finally:
        owner.close()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            type(b) is np.ndarray
            and a.dtype == b.dtype
            and a.shape == b.shape
            and b.flags.writeable
            and bool(np.array_equal(a, b))
        )
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(type(a) is type(b) and a == b)


def test_every_kind_of_element_comes_back_as_it_was() -> None:
    structured = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])
    structured["a"] = [1, 2, 3]
    elements: list[Any] = [
        {
            "ids": np.arange(7, dtype=np.int32),
            "w": np.ones((2, 3), dtype=">f4"),
            "m": np.array([True, False]),
        },
        {"f": np.asfortranarray(np.arange(6).reshape(2, 3)), "o": np.array([{"x": 1}, None], dtype=object)},
        {"s": structured, "z": np.array(5, dtype=np.uint8), "e": np.zeros((0, 4), dtype=np.int64)},
        {1: np.arange(3)},  # not string keys: pickled as it is
        np.arange(4, dtype=np.complex64),
        np.arange(10)[::2],  # not contiguous
        (b"bytes", "text", 3),
        [np.arange(2), {"k": "v"}],
        7,
        "a string",
    ]
    shared = elements[0]
    ls = LaneState(
        lane=0,
        cursor=FeedCursor(0, [SourceCursor.first()]),
        stages={
            "s": StageState(values={"buffer": elements, "by_key": {"a": shared, "b": elements[4]}, "n": 3}),
        },
        pending=[shared, elements[1]],
    )
    packer = SnapshotPacker()
    packed = _wire(packer.pack(0, {0: ls}))
    back = packed.unpack()[0]
    assert _equal(back.stages["s"].values, ls.stages["s"].values)
    assert _equal(back.pending, ls.pending)
    assert back.pending[1]["f"].flags.f_contiguous  # pickled as it is, order kept
    # Shared as they were shared: one element, in the buffer, a dict and the pending outputs.
    assert back.pending[0] is back.stages["s"].values["buffer"][0] is back.stages["s"].values["by_key"]["a"]
    again = _wire(packer.pack(1, {0: ls}))
    assert packer.pickled == 0 and again.items == packed.items
    assert _wire(packer.pack(2, {0: ls}, again.held())).items == {}
    assert _wire(packer.pack(2, {0: ls}, ("another packer", again.keys))).items == packed.items
    with pytest.raises(KeyError):
        _wire(packer.pack(3, {0: ls}, again.held())).complete(None)


def test_a_coordinator_keeping_packed_snapshots_replaces_an_owner_with_the_same_bytes(
    spec: zf.LoaderSpec,
) -> None:
    reference = global_digests(spec, steps=STEPS, world_size=1)
    options = OwnerOptions()
    packers: dict[int, SnapshotPacker] = {}

    def launch(
        index: int, name: str, lanes: list[int], st: Any, readers: dict[int, int], gen: int
    ) -> LaneOwner:
        return LaneOwner(spec, lanes, state=st, readers=readers, options=options, name=name).start()

    def pack(owner: LaneOwner, step: int, held: Held | None) -> PackedSnapshot | None:
        snaps = owner.snapshot(step)
        packer = packers.setdefault(id(owner), SnapshotPacker())
        return None if snaps is None else _wire(packer.pack(step, snaps, held))

    coord = Coordinator(
        spec,
        owners=2,
        world_size=1,
        state=None,
        launch=launch,
        gather=lambda owner, step: owner.snapshot(step),
        pack=pack,
        stop=lambda owner: owner.close(),
        snapshot_every=2,
    )
    rs = RankSlice(rank=0, world_size=1, lanes=LANES, global_batch_size=BATCH)
    try:
        got = []
        for step in range(STEPS):
            if step == 5:  # owner 1 "dies": its replacement starts from the packed snapshot of 4
                dead = coord.table()
                dead.handles[1].close()
                coord.replace(1, dead.generations[1])
            table = coord.table()
            windows, layouts = [], []
            for owner, lanes in table.groups_for(rs.lane_ids):
                rows = table.handles[owner].rows(0, step, lanes, timeout=30)
                windows += rows.windows
                layouts += list(zip(rows.lanes, rows.layouts, strict=True))
            batch = assemble_rows(
                step,
                windows,
                layouts,
                rows=rs.rows_of_lanes(),
                per_lane=spec.per_lane,
                finite=False,
                padding=None,
            )
            got.append((step, batch_digest(concat([batch]))))
            coord.progress(0, step + 1)
        assert coord.gathers >= 4
        assert got == reference
    finally:
        coord.shutdown()
