"""Global batch size schedules (issue 31, item 2): a ramp's batches are a pure function of the
pipeline and the schedule under any world size dividing every size, any backend and any resume
point; sizes that the lanes or the world size do not divide are refused naming the step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import Corpus, DocKey, chain_spec, example_spec, write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon_flow as zf
from zephon_flow.core.errors import FingerprintMismatchError
from zephon_flow.engine.simulate import global_batches, global_digests
from zephon_flow.engine.verify import OK, verify_state
from zephon_flow.service.server import BatchServer

LANES, STEPS = 4, 10
#: 8 rows for steps 0..4, then a ramp to 24 in steps of 8: 16 from step 5, 24 from step 7.
SCHEDULE = zf.BatchSchedule({0: 8, 3: zf.Ramp(start=8, stop=24, steps=4, increment=8)})
Digests = list[tuple[int, str]]


@pytest.fixture(scope="module")
def fixed(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=LANES, global_batch_size=8)


@pytest.fixture(scope="module")
def spec(fixed: zf.LoaderSpec) -> zf.LoaderSpec:
    return zf.LoaderSpec(fixed.build, lanes=LANES, seed=0, global_batch_size=SCHEDULE)


@pytest.fixture(scope="module")
def reference(spec: zf.LoaderSpec) -> Digests:
    ref = global_digests(spec, steps=STEPS)
    assert len(ref) == STEPS and len({d for _, d in ref}) == STEPS
    return ref


def test_the_schedule_is_its_sizes() -> None:
    assert SCHEDULE.changes == ((0, 8), (5, 16), (7, 24))
    assert [SCHEDULE.size(s) for s in range(STEPS)] == [8, 8, 8, 8, 8, 16, 16, 24, 24, 24]
    assert SCHEDULE.rows_before(6) == 5 * 8 + 16
    ramp = zf.BatchSchedule(zf.Ramp(start=64, stop=1024, steps=2000))
    assert ramp.size(0) == 64 and ramp.size(1999) == 960 and ramp.size(2000) == 1024
    assert all(size % 64 == 0 for _, size in ramp.changes) and len(ramp.changes) == 16


def test_window_b_of_each_lane_is_its_outputs_from_rows_before_b(
    spec: zf.LoaderSpec, fixed: zf.LoaderSpec
) -> None:
    # One row per lane per step: fixed-size step k holds output k of lanes 0..L-1 (the Mix's
    # weights are constant, so a lane's outputs do not depend on the batch size).
    one = zf.LoaderSpec(fixed.build, lanes=LANES, seed=0, global_batch_size=LANES)
    outputs = [b["input_ids"] for _, b in global_batches(one, steps=SCHEDULE.rows_before(STEPS) // LANES)]
    for step, batch in global_batches(spec, steps=STEPS):
        lo, hi = SCHEDULE.rows_before(step) // LANES, SCHEDULE.rows_before(step + 1) // LANES
        want = np.stack([outputs[k][lane] for lane in range(LANES) for k in range(lo, hi)])
        assert len(batch["input_ids"]) == SCHEDULE.size(step)
        np.testing.assert_array_equal(batch["input_ids"], want)


@pytest.mark.parametrize(
    ("world_size", "backend", "workers"), [(2, "threads", 2), (4, "inline", 1), (4, "threads", 3)]
)
def test_every_world_size_dividing_every_size_gives_the_same_batches(
    spec: zf.LoaderSpec, reference: Digests, world_size: int, backend: str, workers: int
) -> None:
    got = global_digests(spec, steps=STEPS, world_size=world_size, backend=backend, workers=workers)
    assert got == reference


@pytest.mark.parametrize(
    ("cut", "before", "after"),
    [(3, 1, 4), (5, 4, 2), (6, 2, 1), (8, 4, 4)],
    ids=["before-the-change", "at-the-change", "after-the-change", "after-the-last-change"],
)
def test_a_resume_on_either_side_of_a_change_continues_the_batches(
    spec: zf.LoaderSpec, reference: Digests, cut: int, before: int, after: int
) -> None:
    final: list[dict[str, Any]] = []
    first = global_digests(spec, steps=cut, world_size=before, final_state=final)
    state = zf.encode_state(zf.LoaderState.from_plain(final[0]))
    rest = global_digests(
        spec, steps=STEPS - cut, world_size=after, backend="threads", workers=2, state=state
    )
    assert first + rest == reference


@settings(max_examples=6, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([4, 8, 16]), min_size=1, max_size=4),
    at=st.lists(st.integers(1, 7), min_size=3, max_size=3, unique=True),
    cut=st.integers(1, 7),
    worlds=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])),
)
def test_any_schedule_world_sizes_and_resume_point_give_the_batches_of_one_rank(
    fixed: zf.LoaderSpec,
    sizes: list[int],
    at: list[int],
    cut: int,
    worlds: tuple[int, int],
) -> None:
    steps = sorted(at)[: len(sizes) - 1]
    schedule = zf.BatchSchedule({0: sizes[0], **dict(zip(steps, sizes[1:], strict=False))})
    spec = zf.LoaderSpec(fixed.build, lanes=LANES, seed=0, global_batch_size=schedule)
    reference = global_digests(spec, steps=8)
    final: list[dict[str, Any]] = []
    head = global_digests(spec, steps=cut, world_size=worlds[0], final_state=final)
    tail = global_digests(
        spec, steps=8 - cut, world_size=worlds[1], state=zf.encode_state(zf.LoaderState.from_plain(final[0]))
    )
    assert head + tail == reference


def test_zephon_verify_checks_a_schedules_checkpoint(spec: zf.LoaderSpec) -> None:
    final: list[dict[str, Any]] = []
    global_digests(spec, steps=6, world_size=2, final_state=final)  # step 6: inside the change
    verdicts = verify_state(spec, zf.encode_state(zf.LoaderState.from_plain(final[0])))
    assert [v.verdict for v in verdicts] == [OK] * LANES and {v.step for v in verdicts} == {6}


def test_a_finite_pass_under_a_ramp_delivers_every_record_once(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [f"web {i} x" for i in range(101)])
    base = chain_spec(path, ("key", DocKey()), lanes=LANES, global_batch_size=LANES, epochs=1)
    spec = zf.LoaderSpec(
        base.build, lanes=LANES, global_batch_size={0: 4, 3: zf.Ramp(start=8, stop=24, steps=4)}
    )
    batches = list(global_batches(spec, steps=100))
    assert [(len(b["doc"]), int(b["valid"].sum())) for _, b in batches][-3:] == [(16, 16), (24, 24), (24, 17)]
    real = sorted(int(doc) for _, b in batches for doc, ok in zip(b["doc"], b["valid"], strict=True) if ok)
    assert real == list(range(101))
    digests = [(s, zf.batch_digest(b)) for s, b in batches]
    assert global_digests(spec, steps=100, world_size=4, backend="threads", workers=2) == digests
    final: list[dict[str, Any]] = []
    head = global_digests(spec, steps=4, world_size=2, final_state=final)
    assert (
        head
        + global_digests(
            spec, steps=100, world_size=4, state=zf.encode_state(zf.LoaderState.from_plain(final[0]))
        )
        == digests
    )


def test_a_size_the_lanes_do_not_divide_is_refused_naming_the_step(fixed: zf.LoaderSpec) -> None:
    with pytest.raises(zf.SpecError, match=r"the size at step 4 is 10, not a multiple of lanes=4"):
        zf.LoaderSpec(fixed.build, lanes=LANES, global_batch_size={0: 8, 4: 10})
    ramp = zf.Ramp(start=8, stop=20, steps=6, increment=6)  # 8, 14, 20: 14 at step 3
    with pytest.raises(zf.SpecError, match=r"the size at step 3 is 14, not a multiple of lanes=4"):
        zf.LoaderSpec(fixed.build, lanes=LANES, global_batch_size=ramp)
    with pytest.raises(zf.SpecError, match=r"the first size must be at step 0"):
        zf.BatchSchedule({2: 8})
    with pytest.raises(zf.SpecError, match=r"stop - start = 10 is not a multiple of the increment"):
        zf.Ramp(start=8, stop=18, steps=4, increment=4)


def test_a_world_size_not_dividing_a_size_is_refused_naming_the_step(fixed: zf.LoaderSpec) -> None:
    spec = zf.LoaderSpec(fixed.build, lanes=LANES, global_batch_size={0: 8, 3: 12, 6: 16})
    with pytest.raises(
        zf.SpecError, match=r"world_size=8 does not divide the global batch size 12 of step 3"
    ):
        zf.Loader(spec, rank=0, world_size=8)
    # Resumed past the sizes it does not divide, the same world size is accepted.
    final: list[dict[str, Any]] = []
    ref = global_digests(spec, steps=8)
    head = global_digests(spec, steps=6, final_state=final)
    tail = global_digests(
        spec, steps=2, world_size=8, state=zf.encode_state(zf.LoaderState.from_plain(final[0]))
    )
    assert head + tail == ref


def test_the_fingerprint_covers_the_sizes_not_how_they_are_written(
    spec: zf.LoaderSpec, fixed: zf.LoaderSpec
) -> None:
    def total(size: Any) -> str:
        return zf.LoaderSpec(fixed.build, lanes=LANES, global_batch_size=size).fingerprint["total"]

    assert total(8) == fixed.fingerprint["total"]
    # The constant schedule is the int's stream, so it has the int's fingerprint (documented).
    assert total(zf.BatchSchedule(8)) == total({0: 8}) == total(8)
    assert total({0: 8, 5: 16, 7: 24}) == spec.fingerprint["total"]  # SCHEDULE, written out
    assert len({total(8), spec.fingerprint["total"], total({0: 8, 5: 16}), total({0: 8, 6: 16, 7: 24})}) == 4
    assert fixed.global_batch_size == 8 and fixed.batch_size(9) == 8
    with pytest.raises(
        zf.SpecError, match=r"takes one fixed global batch size, but this spec's global_batch_size"
    ):
        _ = spec.global_batch_size


def test_a_schedule_change_on_resume_is_refused_unless_allowed(
    spec: zf.LoaderSpec, fixed: zf.LoaderSpec
) -> None:
    final: list[dict[str, Any]] = []
    head = [b for _, b in global_batches(fixed, steps=4, final_state=final)]
    state = zf.encode_state(zf.LoaderState.from_plain(final[0]))
    with pytest.raises(
        FingerprintMismatchError, match=r"differ: global_batch_size; .*allow_batch_change=True"
    ):
        zf.Loader(spec, state=state)
    changed = zf.LoaderSpec(fixed.build, lanes=LANES, global_batch_size={0: 8, 6: 16})
    with zf.Loader(changed, state=state, allow_batch_change=True) as loader:
        tail = []
        for step, batch in loader:
            tail.append(batch)
            if step == 6:
                break
        later = loader.state()
    assert [len(b["input_ids"]) for b in head + tail] == [8, 8, 8, 8, 8, 8, 16]
    # The lanes' outputs go on where they were: the same rows as the fixed run until the change.
    same = [b["input_ids"] for _, b in global_batches(fixed, steps=6)]
    np.testing.assert_array_equal(
        np.concatenate([b["input_ids"] for b in head + tail[:2]]), np.concatenate(same)
    )
    # The states written after the change are the new spec's: they resume it, not the old one.
    assert later.fingerprint == changed.fingerprint
    with pytest.raises(FingerprintMismatchError, match=r"global_batch_size"):
        zf.Loader(fixed, state=later)


def test_zephon_dataset_yields_each_ranks_rows_of_each_size(spec: zf.LoaderSpec, reference: Digests) -> None:
    from zephon_flow.torch import ZephonDataset

    ranks = [ZephonDataset.from_loader(spec, rank=r, world_size=2) for r in range(2)]
    parts: list[list[dict[str, np.ndarray]]] = [[], []]
    for r, ds in enumerate(ranks):
        for step, batch in ds:
            parts[r].append({k: v.numpy() for k, v in batch.items()})
            if step == STEPS - 1:
                break
        ds.close()
    assert [len(b["input_ids"]) for b in parts[0]] == [SCHEDULE.size(s) // 2 for s in range(STEPS)]
    got = [zf.batch_digest(_concat(parts[0][s], parts[1][s])) for s in range(STEPS)]
    assert got == [d for _, d in reference]


@pytest.fixture
def server(spec: zf.LoaderSpec) -> Iterator[BatchServer]:
    srv = BatchServer(spec, host="127.0.0.1", port=0, ahead=2 * STEPS).start()  # ranks read in turn
    yield srv
    srv.stop(grace=None)


def test_the_server_slices_each_step_by_its_size(
    server: BatchServer, spec: zf.LoaderSpec, reference: Digests
) -> None:
    world, start = 2, 3
    parts: list[list[dict[str, np.ndarray]]] = []
    for rank in range(world):
        with zf.Client(f"127.0.0.1:{server.port}", rank, world, start_step=start) as client:
            got = []
            for step, batch in client:
                got.append(dict(batch))
                if step == STEPS - 1:
                    break
        parts.append(got)
    assert [len(b["input_ids"]) for b in parts[1]] == [SCHEDULE.size(s) // world for s in range(start, STEPS)]
    got_digests = [zf.batch_digest(_concat(a, b)) for a, b in zip(*parts, strict=True)]
    assert got_digests == [d for _, d in reference[start:]]
    with (
        pytest.raises(
            zf.ServiceError, match=r"world_size=16 does not divide the global batch size 8 of step 0"
        ),
        zf.Client(f"127.0.0.1:{server.port}", 0, 16, retries=0) as client,
    ):
        next(iter(client))


def test_zephon_serve_takes_a_schedule_change_on_resume_only_when_allowed(
    fixed: zf.LoaderSpec, tmp_path: Path
) -> None:
    with zf.Loader(fixed) as loader:
        for step, _ in loader:
            if step == 3:
                break
        zf.save_state(loader.state(), str(tmp_path / "step-4.zfstate"))
    changed = zf.LoaderSpec(fixed.build, lanes=LANES, global_batch_size={0: 8, 6: 16})
    resume = str(tmp_path / "step-4.zfstate")
    with pytest.raises(FingerprintMismatchError, match=r"zephon serve: pass --allow-batch-change"):
        BatchServer(changed, host="127.0.0.1", port=0, resume=resume)
    embedded = []
    with zf.Loader(changed, state=zf.load_state(resume), allow_batch_change=True) as loader:
        for step, batch in loader:
            embedded.append(zf.batch_digest(batch))
            if step == 7:
                break
    srv = BatchServer(changed, host="127.0.0.1", port=0, resume=resume, allow_batch_change=True).start()
    try:
        with zf.Client(f"127.0.0.1:{srv.port}", 0, 1, start_step=4) as client:
            served = []
            for step, batch in client:
                served.append(zf.batch_digest(dict(batch)))
                if step == 7:
                    break
    finally:
        srv.stop(grace=None)
    assert served == embedded


def test_zephon_serve_ray_refuses_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from zephon_flow.cli import main

    assert main(["serve", "nowhere.py:spec", "--port", "0", "--ray", "--allow-batch-change"]) == 2
    assert "--allow-batch-change is not supported with --ray" in capsys.readouterr().err


def test_materialize_through_beam_writes_the_loaders_batches(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [f"web {i} x" for i in range(61)])
    base = chain_spec(path, ("key", DocKey()), lanes=LANES, global_batch_size=LANES, epochs=1)
    spec = zf.LoaderSpec(
        base.build, lanes=LANES, global_batch_size={0: 4, 2: zf.Ramp(start=8, stop=16, steps=2)}
    )
    expected = [zf.batch_digest(b) for _, b in global_batches(spec, steps=100)]
    done = zf.materialize(spec, steps=100, out=str(tmp_path / "out"))
    assert (
        done.ended
        and [zf.batch_digest(b) for _, b in zf.read_materialized(str(tmp_path / "out"))] == expected
    )


def test_a_mixture_moving_by_step_under_a_ramp_is_the_same_everywhere(corpus: Corpus, tmp_path: Path) -> None:
    # The Mix's weights move with the step, so where the sizes cut a lane's outputs decides
    # each draw: every way of running the lanes must cut them alike (Beam's fused lane stage).
    from test_conformance import text_mix

    base = text_mix(corpus, tmp_path, epochs=1, schedule=True)
    spec = zf.LoaderSpec(
        base.build, lanes=LANES, seed=7, global_batch_size=zf.Ramp(start=4, stop=16, steps=6)
    )
    expected = [(s, zf.batch_digest(b)) for s, b in global_batches(spec, steps=1000)]
    fixed = zf.LoaderSpec(base.build, lanes=LANES, seed=7, global_batch_size=4)
    assert expected[:2] == global_digests(fixed, steps=2)  # the first steps: the same 4 rows each
    assert expected[3] not in global_digests(fixed, steps=12)  # later: the draws moved with the sizes
    assert global_digests(spec, steps=1000, world_size=4, backend="threads", workers=2) == expected
    zf.materialize(spec, steps=1000, out=str(tmp_path / "out"))
    assert [(s, zf.batch_digest(b)) for s, b in zf.read_materialized(str(tmp_path / "out"))] == expected


def test_the_paths_without_schedules_refuse_them_by_name(spec: zf.LoaderSpec) -> None:
    with pytest.raises(zf.SpecError, match=r"not yet on lane owners \(zephon_flow.cluster"):
        zf.cluster.OwnedLoader(spec, rank=0, world_size=1, lane_owners=1)


def _concat(*parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from zephon_flow.core.batches import concat

    return concat(list(parts))
