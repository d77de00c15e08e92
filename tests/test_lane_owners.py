"""Lane owners on Ray: the same bytes as the embedded Loader, checkpoints across owner counts
and world sizes, and a SIGKILLed owner replaced without a gap, a repeat or a changed byte."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from helpers import Corpus, example_spec

import zephon_flow as zf
from zephon_flow.cluster import (
    Coordinator,
    CoordinatorLostError,
    LaneOwner,
    OwnedLoader,
    OwnerLostError,
    OwnerOptions,
    plan_owners,
)
from zephon_flow.cluster.coordinator import readers_of
from zephon_flow.cluster.owner import OwnerError
from zephon_flow.core.batches import batch_digest, concat
from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.checkpoint.store import encode_state, to_loader_state
from zephon_flow.core.errors import SpecError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.engine.simulate import global_digests

LANES, BATCH = 6, 12
STEPS = 6


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=LANES, global_batch_size=BATCH)


@pytest.fixture(scope="module")
def reference(spec: zf.LoaderSpec) -> list[tuple[int, str]]:
    """The embedded Loader's global batches (world size 1), the bytes everything must match."""
    return global_digests(spec, steps=2 * STEPS)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """One local Ray on loopback for the module (2 CPUs). Its workers cannot import the tests'
    helpers: the pipeline's module travels by value (``actors.ship_user_code``)."""
    ray = pytest.importorskip("ray")
    from zephon_flow.runners.ray_env import connect

    started = connect("tests", None, num_cpus=2)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def owned_digests(
    spec: zf.LoaderSpec,
    *,
    owners: int,
    world_size: int,
    steps: int,
    state: Any = None,
    on_step: Any = None,
    **options: Any,
) -> tuple[list[tuple[int, str]], LoaderState]:
    """Global batches assembled from ``world_size`` OwnedLoaders read in step (as trainer ranks
    would), and the checkpoint gathered after the last one (``tables`` in ``options``: a list
    that gets each rank's last owner table; ``after``: called with rank 0's loader after that
    checkpoint, which replaces an owner no rank saw die, before the owners end)."""
    tables = options.pop("tables", None)
    after = options.pop("after", None)
    name = options.pop("name", None) or f"test-{uuid.uuid4().hex[:8]}"
    out: list[tuple[int, str]] = []
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(
                OwnedLoader(
                    spec,
                    lane_owners=owners,
                    rank=r,
                    world_size=world_size,
                    state=state,
                    name=name,
                    **options,
                )
            )
            for r in range(world_size)
        ]
        iters = [iter(ld) for ld in loaders]
        for _ in range(steps):
            parts = [next(it) for it in iters]
            assert len({p[0] for p in parts}) == 1
            out.append((parts[0][0], batch_digest(concat([p[1] for p in parts]))))
            if on_step is not None:
                on_step(parts[0][0], loaders[0])
        final = loaders[0].checkpoint()
        if tables is not None:
            tables.extend(ld.table for ld in loaders)
        if after is not None:
            after(loaders[0])
    return out, final


def wait_for_snapshot_file(coordinator: Any, owner: int) -> str:
    """The snapshot file the coordinator actor keeps for ``owner`` (``snapshot_dir``), once it
    has one: the first gather can take seconds on a loaded machine, and a test that kills the
    owner before it would see its replacement start from the run's first step."""
    import ray

    for _ in range(600):
        kept = ray.get(coordinator.snapshot_files.remote())
        if owner in kept:
            return str(kept[owner])
        time.sleep(0.1)
    raise AssertionError(f"no snapshot file of owner {owner} was kept within 60 s")


def coordinator_view(into: list[Any]) -> Any:
    """An ``after`` for ``owned_digests``: appends the coordinator's owner table and each
    owner's status (``LaneOwner.status``) to ``into``."""

    def after(loader: OwnedLoader) -> None:
        import ray

        table = ray.get(loader._coordinator.table.remote())
        into.append((table, ray.get([h.status.remote() for h in table.handles])))

    return after


# -- without Ray: the plan, the owner and the coordinator in-process ---------------------------
def test_plan_owners_is_contiguous_and_balanced() -> None:
    assert plan_owners(6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert plan_owners(7, 3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert plan_owners(6, 1) == [list(range(6))]
    with pytest.raises(SpecError, match=r"lane_owners must be an integer in \[1, lanes=6\].*got 7"):
        plan_owners(6, 7)


def test_bad_owner_options_are_refused_before_ray_starts(spec: zf.LoaderSpec) -> None:
    # The shared option groups' checks (zephon_flow.options), naming the entry point.
    with pytest.raises(
        SpecError, match=r"^OwnedLoader: unknown backend 'gpu'; choose one of inline, threads"
    ):
        OwnedLoader(spec, lane_owners=2, backend="gpu")
    with pytest.raises(SpecError, match=r"^OwnedLoader: ahead must be a positive integer, got 0$"):
        OwnedLoader(spec, lane_owners=2, ahead=0)
    with pytest.raises(SpecError, match=r"^OwnedLoader: chunk_records must be a positive integer, got 0$"):
        OwnedLoader(spec, lane_owners=2, chunk_records=0)
    with pytest.raises(
        SpecError, match=r"^OwnedLoader: timeout must be a positive number of seconds, got -1"
    ):
        OwnedLoader(spec, lane_owners=2, timeout=-1)
    with pytest.raises(SpecError, match=r"world_size=5 is not divisible|not divisible by world_size=5"):
        OwnedLoader(spec, lane_owners=2, world_size=5)
    with pytest.raises(SpecError, match=r"lane_owners must be an integer in \[1, lanes=6\].*got 0"):
        OwnedLoader(spec, lane_owners=0)


def test_an_owner_builds_its_lanes_with_its_chunk_options(
    spec: zf.LoaderSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zephon_flow.cluster import owner as owner_module
    from zephon_flow.engine.loader import build_lane_runners as real

    built: list[tuple[int, int]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        built.append((kwargs["chunk_records"], kwargs["depth"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner_module, "build_lane_runners", spy)
    options = OwnerOptions(chunk_records=3, prefetch_chunks=2)
    owner = LaneOwner(spec, [0, 1, 2], state=None, readers={0: 0}, options=options)
    owner.close()
    assert built == [(3, 2)]


def test_readers_are_the_ranks_on_the_owners_lanes(spec: zf.LoaderSpec) -> None:
    # 4 ranks of 3 rows over 6 lanes of 2 rows: rank 1 has rows 3-5 (lanes 1 and 2).
    assert readers_of([0, 1], spec, 4) == [0, 1]
    assert readers_of([2, 3], spec, 4) == [1, 2]
    assert readers_of([4, 5], spec, 4) == [2, 3]


def _in_process(
    spec: zf.LoaderSpec, owners: int, world_size: int, state: Any = None, **kw: Any
) -> Coordinator:
    options = OwnerOptions()

    def launch(
        index: int, name: str, lanes: list[int], st: Any, readers: dict[int, int], generation: int
    ) -> LaneOwner:
        return LaneOwner(spec, lanes, state=st, readers=readers, options=options, name=name).start()

    return Coordinator(
        spec,
        owners=owners,
        world_size=world_size,
        state=None if state is None else to_loader_state(state),
        launch=launch,
        gather=lambda owner, step: owner.snapshot(step),
        stop=lambda owner: owner.close(),
        **kw,
    )


def _read(coord: Coordinator, rank: int, world_size: int, step: int, spec: zf.LoaderSpec) -> Any:
    from zephon_flow.core.assemble import assemble_rows

    rs = RankSlice(rank=rank, world_size=world_size, lanes=LANES, global_batch_size=BATCH)
    table = coord.table()
    windows, layouts = [], []
    for owner, lanes in table.groups_for(rs.lane_ids):
        got = table.handles[owner].rows(rank, step, lanes, timeout=30)
        windows += got.windows
        layouts += list(zip(got.lanes, got.layouts, strict=True))
    return assemble_rows(
        step, windows, layouts, rows=rs.rows_of_lanes(), per_lane=spec.per_lane, finite=False, padding=None
    )


def test_in_process_owners_match_the_loader_and_replace_an_owner(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    coord = _in_process(spec, owners=3, world_size=2, snapshot_every=2)
    try:
        got = []
        for step in range(STEPS):
            if step == 3:  # owner 1 "dies": its replacement restarts from the snapshot of step 2
                dead = coord.table()
                dead.handles[1].close()
                table = coord.replace(1, dead.generations[1])
                assert table.generations == (0, 1, 0)
                assert coord.replace(1, 0).generations == (0, 1, 0)  # already replaced: same table
            parts = [_read(coord, r, 2, step, spec) for r in range(2)]
            got.append((step, batch_digest(concat(parts))))
            for r in range(2):
                coord.progress(r, step + 1)
        assert got == reference[:STEPS]
        assert coord.gathers >= 3  # snapshots of the 3 owners at step 2 (and later ones)
        state = coord.checkpoint(STEPS)
        assert sorted(state.lane_states) == list(range(LANES))
        assert global_digests(spec, steps=3, world_size=3, state=state) == reference[STEPS : STEPS + 3]
    finally:
        coord.shutdown()


def test_in_process_coordinator_started_again_restarts_a_dead_owner_from_its_newest_file_that_loads(
    spec: zf.LoaderSpec, reference: list[tuple[int, str]], tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """What a coordinator Ray starts again does (``_adopt``), in-process: owner 0 is alive and
    taken over, owner 1 died with the coordinator before it. Owner 1's newest file (step 8) is
    damaged: passed over with a warning naming it, and owner 1 restarts from its file of
    step 4; the ranks, which only owner 0 can place, read on with the reference bytes."""
    from zephon_flow.cluster.coordinator import Adopted
    from zephon_flow.core.checkpoint.store import save_state

    def store(owner: LaneOwner, step: int, index: int) -> str | None:
        snaps = owner.snapshot(step)
        if snaps is None:
            return None
        path = str(tmp_path / f"owner-{index}-step-{step}.zfstate")
        save_state(LoaderState(step, spec.lanes, dict(spec.fingerprint), snaps, owner.mix_history()), path)
        return path

    before = _in_process(spec, owners=2, world_size=2, snapshot_every=4, store=store)
    for step in range(STEPS):
        for r in range(2):
            _read(before, r, 2, step, spec)
            before.progress(r, step + 1)
    assert before.snapshot_files() == {i: str(tmp_path / f"owner-{i}-step-4.zfstate") for i in (0, 1)}
    live, dead = before.table().handles
    dead.close()  # owner 1 dies with the coordinator: only the files and owner 0 are left
    damaged = tmp_path / "owner-1-step-8.zfstate"
    damaged.write_bytes(b"cut short")
    status = live.status()
    found = Adopted(
        live,
        0,
        {**status["expected"], **status["positions"]},
        status["low"],
        live.mix_history(),
        status["floor"],
    )
    stored = {1: [(4, str(tmp_path / "owner-1-step-4.zfstate")), (8, str(damaged))]}
    with caplog.at_level("WARNING", logger="zephon_flow.cluster"):
        after = _in_process(
            spec, owners=2, world_size=2, snapshot_every=4, adopt=[found, None], stored=stored
        )
    try:
        assert f"snapshot file {damaged} does not load, passed over" in caplog.text
        table = after.table()
        assert table.generations == (0, 1)
        assert table.handles[1].status()["first_step"] == 4
        got = []
        for step in range(STEPS, 2 * STEPS):
            got.append((step, batch_digest(concat([_read(after, r, 2, step, spec) for r in range(2)]))))
        assert got == reference[STEPS : 2 * STEPS]
    finally:
        after.shutdown()


def test_in_process_owner_that_cannot_restart_names_lanes_and_step(spec: zf.LoaderSpec) -> None:
    coord = _in_process(spec, owners=2, world_size=1, max_replacements=0)
    try:
        coord.progress(0, 3)
        with pytest.raises(
            OwnerLostError,
            match=r"lane owner 1 \(lanes \[3, 4, 5\]\) died at step 3 and cannot be restarted: "
            r"max_replacements=0",
        ):
            coord.replace(1, 0)
    finally:
        coord.shutdown()


# -- on Ray ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("owners", "world_size"), [(1, 1), (2, 2), (3, 2), (3, 1)])
def test_owned_batches_equal_the_loader(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]], owners: int, world_size: int
) -> None:
    got, final = owned_digests(spec, owners=owners, world_size=world_size, steps=STEPS)
    assert got == reference[:STEPS]
    assert final.step == STEPS


def test_owners_read_in_the_chunks_their_loader_is_given_with_the_same_bytes(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    """``OwnedLoader(chunk_records=, prefetch_chunks=)``, as ``zf.Loader``'s work options, reach
    every owner (its status says what its lanes were built with); the bytes do not change."""
    import ray

    seen: list[dict[str, Any]] = []

    def look(step: int, loader: OwnedLoader) -> None:
        if step == 0:
            seen.extend(ray.get([h.status.remote() for h in loader.table.handles]))

    got, _ = owned_digests(
        spec, owners=2, world_size=2, steps=STEPS, on_step=look, chunk_records=3, prefetch_chunks=2
    )
    assert got == reference[:STEPS]
    assert [(s["chunk_records"], s["prefetch_chunks"]) for s in seen] == [(3, 2), (3, 2)]


@pytest.mark.slow
@pytest.mark.parametrize(("owners", "world_size"), [(1, 2), (2, 1), (2, 4)])
def test_owned_batches_equal_the_loader_more_topologies(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]], owners: int, world_size: int
) -> None:
    got, _ = owned_digests(spec, owners=owners, world_size=world_size, steps=STEPS)
    assert got == reference[:STEPS]


@pytest.mark.slow
def test_owners_with_worker_processes_give_the_same_bytes(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    got, _ = owned_digests(spec, owners=2, world_size=2, steps=STEPS, backend="processes", workers=2)
    assert got == reference[:STEPS]


def test_checkpoint_of_two_owners_resumes_on_three_one_and_the_loader(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    half = STEPS // 2
    got, state = owned_digests(spec, owners=2, world_size=2, steps=half)
    assert got == reference[:half] and state.step == half
    # The checkpoint is an ordinary state: on 3 owners at world size 1, on 1 owner at world
    # size 4, and on the embedded Loader at world size 3, the same next batches.
    on3, _ = owned_digests(spec, owners=3, world_size=1, steps=half, state=state.to_plain())
    on1, _ = owned_digests(spec, owners=1, world_size=4, steps=half, state=encode_state(state))
    embedded = global_digests(spec, steps=half, world_size=3, state=state.to_plain())
    assert on3 == on1 == embedded == reference[half:STEPS]


def test_sigkilled_owner_is_replaced_with_the_same_bytes(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    killed: list[int] = []

    def kill_owner_1(step: int, loader: OwnedLoader) -> None:
        if step == 4:
            pid = loader.owner_pids()[1]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    tables: list[Any] = []
    got, _ = owned_digests(
        spec, owners=3, world_size=2, steps=2 * STEPS, on_step=kill_owner_1, snapshot_every=2, tables=tables
    )
    assert killed
    # Owner 1 (lanes 2 and 3) serves both ranks: both found it dead, one replacement serves both.
    assert [t.generations for t in tables] == [(0, 1, 0), (0, 1, 0)]
    assert got == reference[: 2 * STEPS]


def test_owner_that_cannot_be_restarted_names_lanes_and_step(ray_session: None, spec: zf.LoaderSpec) -> None:
    with OwnedLoader(spec, lane_owners=2, name=f"test-{uuid.uuid4().hex[:8]}", max_replacements=0) as loader:
        it = iter(loader)
        for _ in range(2):
            next(it)
        os.kill(loader.owner_pids()[0], signal.SIGKILL)
        with pytest.raises(
            OwnerLostError,
            match=r"lane owner 0 \(lanes \[0, 1, 2\]\) died at step \d+ and cannot be restarted",
        ):
            for _ in range(STEPS):
                next(it)


def test_a_coordinator_killed_for_good_is_named_and_its_owners_end_by_themselves(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    import ray

    name = f"test-{uuid.uuid4().hex[:8]}"
    with OwnedLoader(spec, lane_owners=2, name=name, orphan_timeout=2.0) as loader:
        it = iter(loader)
        assert [next(it) for _ in range(2)][1][0] == 1
        ray.kill(loader._coordinator, no_restart=True)
        message = rf"rank 0: the lane owners' coordinator '{name}' failed to start or was ended for good "
        with pytest.raises(
            CoordinatorLostError, match=message + r"during checkpoint\(step=2\): ActorDiedError"
        ):
            loader.checkpoint()
        # The owners are not on the coordinator's path: the rank reads on while they live...
        step, batch = next(it)
        assert (step, batch_digest(batch)) == reference[2]
        # ...and they end by themselves once it is gone (orphan_timeout), not left running.
        with pytest.raises(CoordinatorLostError, match=message + r"during the replacement of owner \d"):
            for _ in range(200):
                next(it)
                time.sleep(0.05)
        left = ["not looked yet"]
        for _ in range(100):  # every owner ends, each on its own watch
            left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if name in a["name"]]
            if not left:
                break
            time.sleep(0.1)
        assert not left


def _kill_coordinator_then_owner(killed: dict[str, list[int]]) -> Any:
    def on_step(step: int, loader: OwnedLoader) -> None:
        if step == 2:
            killed["owners before"] = loader.owner_pids()
            pid = loader.coordinator_pid()
            os.kill(pid, signal.SIGKILL)
            killed["coordinator"] = [pid]
        if step == 5:
            # Restarted by Ray: a new process that took the same owners over.
            assert loader.coordinator_pid() not in killed["coordinator"]
            assert loader.owner_pids() == killed["owners before"]
            os.kill(killed["owners before"][1], signal.SIGKILL)  # replaced by the new coordinator

    return on_step


def test_an_owner_and_the_coordinator_killed_together_restart_from_the_owners_snapshot_file(
    ray_session: None, spec: zf.LoaderSpec, tmp_path: Any
) -> None:
    """Both die at once (a node lost with both on it): the coordinator Ray starts again finds
    the owner dead and restarts it from the newest snapshot file it wrote, not from the run's
    first step (a replay as long as the run so far); rank 1, which reads only that owner, and
    which no live owner can place, reads on with the same bytes."""

    # A file a dead run of the same name left (another timeline): removed as this run starts,
    # or the restarted coordinator would take it for owner 1's newest snapshot.
    name = f"test-{uuid.uuid4().hex[:8]}"
    stale = tmp_path / name / "owner-1-step-999.zfstate"
    stale.parent.mkdir()
    stale.write_bytes(b"a snapshot of a run that is over")
    killed: list[int] = []

    def kill_both(step: int, loader: OwnedLoader) -> None:
        if step == 0:
            assert not stale.exists()  # (the folder also goes when the run ends)
        if step == 8:
            wait_for_snapshot_file(loader._coordinator, 1)
            pids = [loader.owner_pids()[1], loader.coordinator_pid()]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed.extend(pids)

    steps = 3 * STEPS
    tables: list[Any] = []
    got, final = owned_digests(
        spec,
        owners=2,
        world_size=2,
        steps=steps,
        on_step=kill_both,
        snapshot_every=2,
        snapshot_dir=str(tmp_path),
        after=coordinator_view(tables),
        name=name,
    )
    assert len(killed) == 2
    assert got == global_digests(spec, steps=steps)
    ((table, statuses),) = tables
    assert table.generations == (0, 1)
    # Owner 1's replacement started at a snapshot step it had written (every 2 steps of the
    # slowest rank: step 2 at the least, as rank 1 took step 8), not at the run's step 0.
    assert statuses[1]["first_step"] >= 2 and statuses[1]["first_step"] % 2 == 0
    assert final.step == steps


def test_a_sigkilled_coordinator_is_restarted_and_takes_its_live_owners_over(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    killed: dict[str, list[int]] = {}
    tables: list[Any] = []
    got, final = owned_digests(
        spec,
        owners=2,
        world_size=2,
        steps=2 * STEPS,
        on_step=_kill_coordinator_then_owner(killed),
        snapshot_every=2,
        tables=tables,
    )
    assert killed["coordinator"] and len(killed["owners before"]) == 2
    assert got == reference[: 2 * STEPS]
    # Owner 1 runs rank 1's lanes only; rank 1 had fetched at most up to step 10 (a run in
    # hand and one in flight), so it met the death and the restarted coordinator replaced it.
    assert [t.generations for t in tables] == [(0, 0), (0, 1)]
    # The checkpoint gathered by the restarted coordinator resumes on the embedded Loader.
    assert final.step == 2 * STEPS
    more = global_digests(spec, steps=2, world_size=3, state=final.to_plain())
    assert more == global_digests(spec, steps=2 * STEPS + 2)[2 * STEPS :]


@pytest.mark.parametrize("trial", range(3))
def test_an_owner_sigkilled_just_before_a_checkpoint_is_replaced_by_it(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]], trial: int
) -> None:
    # Two ranks take steps 4 and 5 from what they already fetched, so neither notices the
    # death: the checkpoint is the first to meet it (raised a raw ActorDiedError before).
    def kill_owner(step: int, loader: OwnedLoader) -> None:
        if step == 3:
            os.kill(loader.owner_pids()[trial % 2], signal.SIGKILL)

    got, final = owned_digests(
        spec, owners=2, world_size=2, steps=STEPS, on_step=kill_owner, backend="processes", prefetch=4
    )
    assert got == reference[:STEPS]
    assert final.step == STEPS
    assert global_digests(spec, steps=2, world_size=2, state=final.to_plain()) == reference[STEPS : STEPS + 2]


def test_another_world_size_is_refused_by_running_owners(ray_session: None, spec: zf.LoaderSpec) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    with (
        OwnedLoader(spec, lane_owners=1, world_size=2, name=name),
        pytest.raises(SpecError, match=r"these lane owners serve world_size=2, not 3"),
    ):
        OwnedLoader(spec, lane_owners=1, rank=0, world_size=3, name=name)


def test_a_rank_waiting_for_a_step_gives_up_after_its_timeout_on_its_clock(
    ray_session: None, spec: zf.LoaderSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of 2 takes step 0 and stops (its next ask, step 1, is its position), so the owner
    makes steps 0 to 2 (ahead=2). Rank 0 takes them, then asks for step 3 again and again; it
    gives up after ``timeout`` on its clock (a ``ManualClock``, moved by the pauses between its
    asks; each ask waits ``CALL_WAIT`` at the owner, made short here) with an ``OwnerError``
    naming the owner, its lanes and the step."""
    from zephon_flow.cluster import actors
    from zephon_flow.core.clock import ManualClock

    monkeypatch.setattr(actors, "CALL_WAIT", 0.05)
    clock, name = ManualClock(), f"test-{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = {"ahead": 2, "keep": 2, "prefetch": 2, "timeout": 20.0, "clock": clock}
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(OwnedLoader(spec, lane_owners=1, rank=r, world_size=2, name=name, **options))
            for r in range(2)
        ]
        assert next(iter(loaders[1]))[0] == 0
        it = iter(loaders[0])
        assert [next(it)[0] for _ in range(3)] == [0, 1, 2]
        with pytest.raises(
            OwnerError,
            match=r"^rank 0 waited 20 s for lane owner 0 \(lanes \[0, 1, 2, 3, 4, 5\]\) to make step 3: "
            r"its other readers \(ranks\) may have stopped reading",
        ):
            next(it)
        assert clock.now() >= 20


# -- served: zephon serve --ray --lane-owners N, read by zf.Client(lane_owners=True) -----------
@pytest.mark.parametrize("killed", ["owner", "coordinator then owner"])
def test_served_owners_give_clients_the_loaders_bytes_through_a_sigkill(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]], tmp_path: Any, killed: str
) -> None:
    import ray

    from zephon_flow.cluster.serve import OwnersServer

    server = OwnersServer(spec, owners=3, world_size=2, snapshot_every=2, checkpoint_dir=str(tmp_path))
    clients = [
        zf.Client(f"127.0.0.1:{server.port}", r, 2, lane_owners=True, fingerprint=spec.fingerprint)
        for r in range(2)
    ]
    try:
        iters = [iter(c) for c in clients]
        got = []
        for i in range(STEPS + 2):
            if i == 1 and killed != "owner":  # Ray starts it again; it takes the owners over
                os.kill(ray.get(server._coordinator.pid.remote()), signal.SIGKILL)
            if i == STEPS // 2:  # owner 1 (lanes 2 and 3) serves both ranks
                os.kill(server.owner_pids()[1], signal.SIGKILL)
            parts = [next(it) for it in iters]
            got.append((parts[0][0], batch_digest(concat([p[1] for p in parts]))))
        assert got == reference[: STEPS + 2]
        assert server.table().generations == (0, 1, 0)
        assert server.poll() is None
        # A checkpoint written by the coordinator resumes on the embedded Loader, 3 ranks.
        path = clients[0].checkpoint()
        assert path == str(tmp_path / f"step-{STEPS + 2}.zfstate")
        resumed = global_digests(spec, steps=2, world_size=3, state=zf.load_state(path))
        assert resumed == reference[STEPS + 2 : STEPS + 4]
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_serve_with_ray_needs_the_world_size_and_refuses_held_bytes(
    corpus: Corpus, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from service_helpers import write_pipeline

    from zephon_flow.cli import main

    target = f"{write_pipeline(tmp_path / 'pipe.py', corpus, lanes=LANES, global_batch_size=BATCH)}:spec"
    assert main(["serve", target, "--ray", "--lane-owners", "2", "--port", "0"]) == 1
    assert (
        "zephon serve --lane-owners needs --world-size (the trainer ranks), got None"
        in capsys.readouterr().err
    )
    argv = ["serve", target, "--ray", "--world-size", "2", "--port", "0", "--held-bytes", "1MiB"]
    assert main(argv) == 1
    assert (
        "zephon serve --ray does not support --held-bytes: each owner holds --ahead"
        in capsys.readouterr().err
    )
    token = tmp_path / "token"
    token.write_text("\n")
    argv = ["serve", target, "--ray", "--world-size", "2", "--port", "0", "--token-file", str(token)]
    assert main(argv) == 1
    assert f"zephon serve: --token-file {token} is empty" in capsys.readouterr().err
    assert main(["serve", target, "--ray", "--lane-owners", "7", "--world-size", "2", "--port", "0"]) == 1
    assert "lane_owners must be an integer in [1, lanes=6]" in capsys.readouterr().err


def test_a_finite_pass_ends_at_the_loaders_step_with_the_same_padding(
    ray_session: None, corpus: Corpus
) -> None:
    # One pass over 60 documents on 4 lanes of 2 rows: lanes end at different steps, the
    # last batches are padded and carry `valid`, and rank 1's own lanes may run dry first.
    from helpers import DocKey, chain_spec

    spec = chain_spec(corpus.web_jsonl, ("key", DocKey()), lanes=4, global_batch_size=8, epochs=1)
    reference = global_digests(spec, steps=1000)
    name = f"test-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(OwnedLoader(spec, lane_owners=3, rank=r, world_size=2, name=name))
            for r in range(2)
        ]
        got = [(p0[0], batch_digest(concat([p0[1], p1[1]]))) for p0, p1 in zip(*loaders, strict=True)]
    assert 4 < len(reference) < 1000
    assert got == reference


@pytest.mark.slow
def test_closing_the_last_loader_frees_the_name_for_the_next_run(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    for owners in (1, 2):  # the same name at once again: a new coordinator, not the dying one
        with OwnedLoader(spec, lane_owners=owners, name=name) as loader:
            assert [(s, batch_digest(b)) for _, (s, b) in zip(range(2), loader, strict=False)] == reference[
                :2
            ]
            assert len(loader.table.lanes) == owners


# -- scale on paper ----------------------------------------------------------------------------
@pytest.mark.parametrize(("lanes", "owners", "ranks"), [(16, 4, 8), (12, 5, 8), (8, 3, 24), (6, 6, 4)])
def test_scale_simulation_follows_its_formulas(tmp_path: Any, lanes: int, owners: int, ranks: int) -> None:
    from bench.scale_sim import formulas, simulate

    point = simulate(
        lanes=lanes,
        owners=owners,
        ranks=ranks,
        snapshot_every=4,
        steps=16,
        lane_state_bytes=64,
        root=str(tmp_path),
    )
    expected = formulas(lanes=lanes, owners=owners, ranks=ranks, snapshot_every=4, lane_state_bytes=64)
    assert point.fetches_per_step == expected["fetches_per_step"]
    assert point.coordinator_messages_per_step == expected["coordinator_messages_per_step"]
    assert point.coordinator_bytes_per_step == expected["coordinator_bytes_per_step"]
    assert point.checkpoint_bytes > lanes * 64  # every lane's state, gathered from every owner


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 12])
def test_readers_of_agrees_with_the_rank_slices(spec: zf.LoaderSpec, world_size: int) -> None:
    for owners in range(1, LANES + 1):
        for group in plan_owners(LANES, owners):
            slices = [
                RankSlice(rank=r, world_size=world_size, lanes=LANES, global_batch_size=BATCH)
                for r in range(world_size)
            ]
            assert readers_of(group, spec, world_size) == [
                s.rank for s in slices if set(group) & set(s.lane_ids)
            ]


# -- a pipeline module that Ray ships by value -------------------------------------------------
SHIPPED = """
import apache_beam as beam
import numpy as np
from zephon_flow import LoaderSpec, operators as ops

WIDTH = 3

def widths(text):
    return np.full(WIDTH, len(text), dtype=np.int32)

class Widths(beam.DoFn):
    def process(self, text):
        yield widths(text)

def build(p):
    return p | "src" >> ops.ReadJsonl(JSONL, split_bytes=64) | "widths" >> beam.ParDo(Widths())

spec = LoaderSpec(build, lanes=4, global_batch_size=4)
"""


def test_owners_resume_the_loaders_checkpoint_of_a_module_shipped_by_value(
    ray_session: None, tmp_path: Any
) -> None:
    """The pipeline's module is shipped to the owners by value (``ship_user_code``): there its
    DoFn's helper is no user module's and the class has no source, so a fingerprint
    recomputed by the owners differed from the Loader's and its checkpoint was refused. The
    owners use the spec's own (computed where it was made): the embedded Loader's checkpoint
    resumes on 2 owners, and theirs on the Loader, at the uninterrupted run's batches."""
    import importlib.util
    import sys

    from helpers import write_jsonl

    jsonl = write_jsonl(tmp_path / "docs.jsonl", [f"document {'x' * (i % 7)} {i}" for i in range(60)])
    path = tmp_path / "owned_widths.py"
    path.write_text(f"JSONL = {jsonl!r}\n" + SHIPPED)
    found = importlib.util.spec_from_file_location("owned_widths", path)
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    sys.modules["owned_widths"] = module
    try:
        found.loader.exec_module(module)
        spec = module.spec
        assert "code widths :: helper widths in module owned_widths" in spec.fingerprint
        reference = global_digests(spec, steps=6)
        with zf.Loader(spec) as loader:
            for step, _ in loader:
                if step == 1:
                    state = loader.state_dict()
                    break
        # A rank of another process: the same file, its spec's fingerprint not yet asked.
        found.loader.exec_module(module)
        got, owned = owned_digests(module.spec, owners=2, world_size=1, steps=2, state=state)
        assert got == reference[2:4]
        assert owned.fingerprint == spec.fingerprint
        assert global_digests(spec, steps=2, state=owned.to_plain()) == reference[4:6]
    finally:
        sys.modules.pop("owned_widths", None)


def test_a_ranks_state_dict_holds_its_own_lanes_from_its_own_owners(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(OwnedLoader(spec, lane_owners=3, rank=r, world_size=2, name=name))
            for r in range(2)
        ]
        for _, (p0, p1) in zip(range(3), zip(*loaders, strict=True), strict=False):
            assert p0[0] == p1[0]
        states = [ld.state_dict() for ld in loaders]
    assert [sorted(to_loader_state(s).lane_states) for s in states] == [[0, 1, 2], [3, 4, 5]]
    merged = zf.merge_states(states)
    assert global_digests(spec, steps=2, world_size=3, state=merged) == reference[3:5]


@pytest.mark.parametrize("owners", [1, 2])
def test_a_recipe_checkpoint_resumes_on_owners_with_the_loaders_bytes(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]], owners: int, tmp_path: Any
) -> None:
    # The owners rebuild the recipes of their lanes (they served the recipe records before).
    path = tmp_path / "recipe.zfstate"
    with zf.Loader(spec, state_mode="recipe") as loader:
        for step, _ in loader:
            if step == 4:
                zf.save_state(loader.state(), path)
                break
    state = zf.load_state(path)
    assert to_loader_state(state).recipe
    got, final = owned_digests(spec, owners=owners, world_size=2, steps=4, state=state)
    assert got == reference[5:9]
    assert final.step == 9 and not final.recipe


def test_owned_loader_writes_recipe_states_that_resume_anywhere(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]], tmp_path: Any
) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(
                OwnedLoader(spec, lane_owners=2, rank=r, world_size=2, name=name, state_mode="recipe")
            )
            for r in range(2)
        ]
        for _, (p0, p1) in zip(range(3), zip(*loaders, strict=True), strict=False):
            assert p0[0] == p1[0]
        full = loaders[0].checkpoint()
        parts = [ld.state_dict() for ld in loaders]
    assert full.recipe and all(to_loader_state(p).recipe for p in parts)
    path = tmp_path / "owned.zfstate"
    zf.save_state(full, path)
    compact_size = len(encode_state(owned_digests(spec, owners=1, world_size=1, steps=3)[1]))
    assert path.stat().st_size < compact_size  # recipes name the documents, not their tokens
    assert global_digests(spec, steps=2, world_size=3, state=zf.load_state(path)) == reference[3:5]
    assert global_digests(spec, steps=2, state=zf.merge_states(parts)) == reference[3:5]
    with pytest.raises(SpecError, match=r"^OwnedLoader: state_mode must be one of compact, recipe, got 'x'$"):
        OwnedLoader(spec, lane_owners=1, state_mode="x")


def test_owners_write_their_parts_and_a_manifest_that_load_state_reads(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]], tmp_path: Any
) -> None:
    from zephon_flow.core.errors import CorruptStateError, StateError, UsageError

    killed: list[int] = []

    def kill_owner_2_at_3(step: int, loader: OwnedLoader) -> None:
        if step == 3 and not killed:  # the save below meets the death first, and replaces it
            killed.append(loader.owner_pids()[2])
            os.kill(killed[0], signal.SIGKILL)

    name = f"test-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "ckpt" / "step-4.zfstate"
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(OwnedLoader(spec, lane_owners=3, rank=r, world_size=2, name=name))
            for r in range(2)
        ]
        for _, parts in zip(range(4), zip(*loaders, strict=True), strict=False):
            kill_owner_2_at_3(parts[0][0], loaders[0])
        assert loaders[1].save_checkpoint(path) == str(path)  # any rank may ask
        assert loaders[0].table.generations[2] == 0  # not yet seen by the ranks: the save met it
    manifest = path.read_text()
    assert '"kind": "zephon-flow/loader-state+manifest"' in manifest and len(manifest) < 2000
    written = sorted(p.name for p in (tmp_path / "ckpt" / "step-4.zfstate.parts").iterdir())
    assert written == ["part-0.zfstate", "part-1.zfstate", "part-2.zfstate"]
    state = zf.load_state(path)
    assert state.step == 4 and sorted(state.lane_states) == list(range(LANES))
    assert global_digests(spec, steps=3, world_size=3, state=state) == reference[4:7]
    assert owned_digests(spec, owners=2, world_size=1, steps=2, state=state)[0] == reference[4:6]

    part = tmp_path / "ckpt" / "step-4.zfstate.parts" / "part-1.zfstate"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError, match=r"its part step-4.zfstate.parts/part-1.zfstate was changed"):
        zf.load_state(path)
    part.unlink()
    with pytest.raises(StateError, match=r"its part step-4.zfstate.parts/part-1.zfstate is missing"):
        zf.load_state(path)
    with (
        OwnedLoader(spec, lane_owners=1, state_mode="recipe", name=f"test-{uuid.uuid4().hex[:8]}") as loader,
        pytest.raises(UsageError, match=r"save_checkpoint writes compact parts"),
    ):
        loader.save_checkpoint(tmp_path / "r.zfstate")


def test_owners_write_incremental_parts_on_an_earlier_checkpoint(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]], tmp_path: Any
) -> None:
    from zephon_flow.core.errors import StateError

    first, later = tmp_path / "step-4.zfstate", tmp_path / "step-5.zfstate"
    with OwnedLoader(spec, lane_owners=2, name=f"test-{uuid.uuid4().hex[:8]}") as loader:
        it = iter(loader)
        for _ in range(4):
            next(it)
        loader.save_checkpoint(first)
        next(it)
        loader.save_checkpoint(later, base=first)
        with pytest.raises(StateError, match=r"its base .*nowhere.zfstate does not exist"):
            loader.save_checkpoint(tmp_path / "x.zfstate", base=tmp_path / "nowhere.zfstate")
        full = tmp_path / "full-5.zfstate"
        loader.save_checkpoint(full, step=5)

    def part_bytes(manifest: Any) -> int:
        return sum(p.stat().st_size for p in (tmp_path / f"{manifest.name}.parts").iterdir())

    assert part_bytes(later) < part_bytes(full)  # a step moves a few records of each lane
    state = zf.load_state(later)
    assert encode_state(state) == encode_state(zf.load_state(full))
    assert global_digests(spec, steps=2, world_size=2, state=state) == reference[5:7]


def test_owners_keep_their_snapshots_in_files_and_replacements_start_from_them(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]], tmp_path: Any
) -> None:
    def kill_owner_1(step: int, loader: OwnedLoader) -> None:
        if step == 6:
            wait_for_snapshot_file(loader._coordinator, 1)
            os.kill(loader.owner_pids()[1], signal.SIGKILL)
        if step == 2 * STEPS - 1:  # the coordinator holds names, the files hold the states
            import ray

            kept = ray.get(loader._coordinator.snapshot_files.remote())
            assert kept and all(os.path.exists(path) for path in kept.values())
            assert {os.path.basename(p).split("-step-")[0] for p in kept.values()} <= {
                "owner-0",
                "owner-1",
                "owner-2",
            }

    tables: list[Any] = []
    got, _ = owned_digests(
        spec,
        owners=3,
        world_size=2,
        steps=2 * STEPS,
        on_step=kill_owner_1,
        snapshot_every=2,
        snapshot_dir=str(tmp_path),
        after=coordinator_view(tables),
    )
    assert got == reference[: 2 * STEPS]
    # Replaced: by a rank that met the death, or else by the checkpoint after the last step
    # (both ranks may hold every step up to the end fetched when owner 1 dies at step 6: a
    # fresh-clone CI run saw neither rank's table change).
    ((table, statuses),) = tables
    assert table.generations == (0, 1, 0)
    assert statuses[1]["first_step"] >= 2  # from a snapshot file, not the run's first step
    assert not list(tmp_path.rglob("*.zfstate"))  # removed when the run ended


def test_a_snapshot_of_a_step_an_owner_let_go_is_refused_by_name(spec: zf.LoaderSpec) -> None:
    # Served ranks are not in lockstep: a checkpoint at the slowest rank's step used to wait
    # 120 s on an owner whose own readers were far past it (found by the soak).
    owner = LaneOwner(spec, [0, 1], state=None, readers={0: 0}, options=OwnerOptions(ahead=2, keep=1)).start()
    try:
        for step in range(6):
            assert owner.rows(0, step, timeout=60) is not None
        assert owner.snapshot(5) is not None
        with pytest.raises(
            OwnerError, match=r"no snapshot of step 1: lane owner \(lanes \[0, 1\]\) holds steps \[4, "
        ):
            owner.snapshot(1)
    finally:
        owner.close()


def test_served_ranks_read_on_when_an_owner_and_the_coordinator_die_together(
    ray_session: None, spec: zf.LoaderSpec, tmp_path: Any
) -> None:
    """``zephon serve --ray --snapshot-dir``: owner 1 and the coordinator SIGKILLed together.
    The restarted coordinator restarts owner 1 from its newest snapshot file; rank 1, which
    reads only owner 1 and which no live owner can place, comes back to the replacement
    further past that snapshot than a rank usually asks ahead, and is served the same bytes
    (it was refused OUT_OF_RANGE, "rank 1 is at step 0")."""
    import ray

    from zephon_flow.cluster.serve import OwnersServer

    server = OwnersServer(spec, owners=2, world_size=2, snapshot_every=2, snapshot_dir=str(tmp_path))
    clients = [
        zf.Client(f"127.0.0.1:{server.port}", r, 2, lane_owners=True, retries=30, max_backoff=2.0)
        for r in range(2)
    ]
    steps = 50
    try:
        iters = [iter(c) for c in clients]
        got: list[tuple[int, str]] = []
        for i in range(steps):
            if i == 40:  # past the 8 + 24 steps a rank may ask beyond step 0
                coordinator = server._coordinator
                wait_for_snapshot_file(coordinator, 1)
                pids = [server.owner_pids()[1], ray.get(coordinator.pid.remote())]
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
            parts = [next(it) for it in iters]
            got.append((parts[0][0], batch_digest(concat([p[1] for p in parts]))))
        assert got == global_digests(spec, steps=steps)
        table = server.table()
        assert table.generations == (0, 1)
        first = ray.get(table.handles[1].status.remote())["first_step"]
        assert first >= 2 and first % 2 == 0  # a snapshot step (files are kept every 2 steps), not step 0
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_ranks_read_on_through_a_restart_of_the_served_owners_from_their_checkpoint(
    ray_session: None, spec: zf.LoaderSpec, tmp_path: Any
) -> None:
    """``zephon serve --ray --checkpoint-every 64`` stopped 35 steps or more past its first
    checkpoint and started again with ``--resume`` from it (step 64 or a little later: the
    slowest rank's step when it was written, on the same port): the ranks, which read on, come back further past it than a rank
    may usually ask ahead, and get the same bytes; the owners replay the steps in between, as
    ``zephon serve`` does. Each rank reads only its own owner, so the checkpoint is written
    while one rank runs ahead: its owner must still hold the slower rank's step."""
    from zephon_flow.cluster.owner import FLOOR_REACH
    from zephon_flow.cluster.serve import OwnersServer
    from zephon_flow.cluster.serving import ASK_SLACK

    kwargs: dict[str, Any] = {"owners": 2, "world_size": 2, "checkpoint_dir": str(tmp_path)}
    server = OwnersServer(spec, checkpoint_every=64, **kwargs)
    port = server.port
    clients = [
        zf.Client(f"127.0.0.1:{port}", r, 2, lane_owners=True, retries=30, max_backoff=2.0, timeout=90)
        for r in range(2)
    ]
    try:
        iters = [iter(c) for c in clients]
        got: list[tuple[int, str]] = []
        # The stop comes once the first checkpoint is on disk (at step 64 or a little after,
        # however loaded the machine), further past it than a rank may ask without a resume,
        # and further than the owners run past the slowest rank's step they are told (the
        # checkpoint's, until the ranks report: a CI run hung when a late checkpoint put the
        # stop there), but well before the next one (64 steps on).
        first: int | None = None
        while first is None or len(got) < first + 13:  # past the steps the ranks hold fetched
            step = len(got)
            if first is None and any(name.endswith(".zfstate") for name in os.listdir(tmp_path)):
                (at,) = [int(n[5:-8]) for n in os.listdir(tmp_path) if n.endswith(".zfstate")]
                first = max(step, at + 8 + FLOOR_REACH + 10)
            if step == first:
                server.stop()  # the ranks' owners end with it
                written = sorted(os.listdir(tmp_path))
                assert len(written) == 2 and written[1] == written[0] + ".parts", written
                at = int(written[0].removeprefix("step-").removesuffix(".zfstate"))
                assert first - at > 8 + ASK_SLACK  # further than a rank may ask without a resume
                resume = str(tmp_path / written[0])
                server = OwnersServer(spec, checkpoint_every=64, port=port, resume=resume, **kwargs)
            parts = [next(it) for it in iters]
            got.append((parts[0][0], batch_digest(concat([p[1] for p in parts]))))
            assert step < 400, "no checkpoint was written in 400 steps"
        assert got == global_digests(spec, steps=len(got))
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_a_rank_far_ahead_leaves_the_slowest_ranks_step_held_for_a_checkpoint(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]]
) -> None:
    """Each of the 2 ranks reads only its own owner (owner 0: lanes 0-2, rank 0). Rank 0 reads
    40 steps while rank 1 reads 8: rank 1's checkpoint at step 8 needs owner 0's lanes at step
    8, which owner 0's only reader left 32 steps behind. Owners hold the run's slowest rank's
    step (the coordinator tells them as ranks report), so the checkpoint is taken and resumes
    with the reference bytes; and owner 0 makes at most ``ahead + FLOOR_REACH`` steps past it."""
    import ray

    from zephon_flow.cluster.owner import FLOOR_REACH

    name = f"test-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(OwnedLoader(spec, lane_owners=2, rank=r, world_size=2, name=name, ahead=8))
            for r in range(2)
        ]
        assert [g for g, _ in loaders[0].table.groups_for(loaders[0]._slice.lane_ids)] == [0]
        fast, slow = iter(loaders[0]), iter(loaders[1])
        assert [next(fast)[0] for _ in range(40)] == list(range(40))
        assert [next(slow)[0] for _ in range(8)] == list(range(8))
        state = loaders[1].checkpoint()
        assert state.step == 8
        status = ray.get(loaders[0].table.handles[0].status.remote())
        assert status["produced"] <= 8 + 8 + FLOOR_REACH
    resumed = global_digests(spec, steps=4, world_size=1, state=state)
    assert resumed == reference[8:12]


def test_an_owner_sigkilled_during_save_checkpoint_leaves_a_checkpoint_and_the_ranks_reading(
    ray_session: None, spec: zf.LoaderSpec, reference: list[tuple[int, str]], tmp_path: Any
) -> None:
    """Owner 1 is SIGKILLed 50 ms into ``save_checkpoint``: the checkpoint is written (the
    owner replaced from its snapshot), resumes on 3 ranks with the reference bytes, the ranks
    read on with them, and ``owner_pids()`` names the replacement (it raised Ray's
    ``ActorDiedError`` with the dead owner still in the rank's table)."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(OwnedLoader(spec, lane_owners=2, rank=r, world_size=2, name=name))
            for r in range(2)
        ]
        iters = [iter(ld) for ld in loaders]

        def steps(n: int) -> list[tuple[int, str]]:
            out = []
            for _ in range(n):
                parts = [next(it) for it in iters]
                out.append((parts[0][0], batch_digest(concat([p[1] for p in parts]))))
            return out

        got = steps(STEPS)
        victim = loaders[0].owner_pids()[1]
        killer = threading.Timer(0.05, os.kill, (victim, signal.SIGKILL))
        killer.start()
        path = loaders[0].save_checkpoint(str(tmp_path / "ck.zfstate"))
        killer.join()
        got += steps(2)
        pids = loaders[0].owner_pids()
        assert victim not in pids and len(pids) == 2
    assert got == reference[: STEPS + 2]
    resumed = global_digests(spec, steps=2, world_size=3, state=zf.load_state(path))
    assert resumed == reference[STEPS : STEPS + 2]
