"""``OwnedLoader``: one rank's batches, its rows fetched from the Ray lane owners of its lanes."""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any

from zephon_flow.cluster import actors
from zephon_flow.cluster.coordinator import OwnerTable, plan_owners
from zephon_flow.core.batches import Batch
from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import (
    CoordinatorLostError,
    OwnerError,
    SpecError,
    StateError,
    UsageError,
    ZephonError,
)
from zephon_flow.core.lanes import RankSlice
from zephon_flow.core.options import check_int, check_seconds
from zephon_flow.core.retry import POLL
from zephon_flow.engine import recipe
from zephon_flow.engine.options import OwnerOptions, StateOptions
from zephon_flow.engine.owned import PROGRESS_EVERY, owned_batches
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.runners.ray_env import connect, disconnect_if_started, require_ray
from zephon_flow.runners.streams import CHUNK_RECORDS

#: How the options' messages name this entry point.
_NAME = "OwnedLoader"


def default_name(spec: LoaderSpec) -> str:
    """The coordinator's Ray actor name for ``spec`` when none is given."""
    return f"zephon-owners-{spec.fingerprint['total'][:16]}"


class OwnedLoader:
    """Iterates ``(step, batch)`` like ``zf.Loader`` (the same bytes), with the lanes run by
    ``lane_owners`` Ray actors instead of in this process.

    Every rank of a job constructs one with the same ``spec``, ``lane_owners``, ``world_size``,
    ``state`` and ``name``: the first starts the coordinator (a Ray actor named ``name``, by
    default from the pipeline's fingerprint) and the owners; the others join it. Each rank then
    fetches its rows from the owners of its lanes, a run of up to ``prefetch - 1`` steps per
    call with the next call in flight, and merges them in lane order: batches never pass
    through one process. ``ray_address=None`` joins the Ray this
    process is connected to or starts a local one; an address joins that cluster. Owners run
    their stateless work on ``backend`` with ``workers`` each, each lane's source in chunks of
    up to ``chunk_records`` records, ``prefetch_chunks`` in flight (``zf.Loader``'s work
    options, ``WorkOptions``); ``owner_cpus`` is what each owner reserves. A dead owner is replaced (at most ``max_replacements`` times) from its
    lanes' last snapshot, gathered every ``snapshot_every`` steps (held by the coordinator, or
    with ``snapshot_dir`` written by each owner to a file there); ``checkpoint()`` gathers
    every lane's state at a step, ``state_dict()`` this rank's lanes (``zf.merge_states``);
    with ``state_mode="recipe"`` their buffered sequences as recipes, as ``zf.Loader``'s.
    A resumed owner verifies its lanes' first windows against ``state`` (``verify_resume``, as
    ``zf.Loader``'s), and a replaced one against the snapshot it restarts from. An owner that
    no node can place within ``start_timeout`` seconds is an error naming it and its lanes.
    The coordinator is started again by Ray if its process dies, and takes over the live
    owners (they do not die with it); owners whose coordinator is gone for good (its
    starter's process ended, or it was killed) end themselves after ``orphan_timeout`` s.
    """

    def __init__(
        self,
        spec: LoaderSpec,
        *,
        lane_owners: int,
        rank: int = 0,
        world_size: int = 1,
        state: LoaderState | bytes | Mapping[str, Any] | None = None,
        ray_address: str | None = None,
        name: str | None = None,
        backend: str = "inline",
        workers: int = 1,
        prefetch: int = 4,
        chunk_records: int = CHUNK_RECORDS,
        prefetch_chunks: int = 8,
        ahead: int = 4,
        keep: int = 4,
        snapshot_every: int = 8,
        max_replacements: int = 3,
        owner_cpus: float = 0.0,
        timeout: float = 300.0,
        allow_mix_change: bool = False,
        allow_code_change: bool = False,
        verify_resume: bool = True,
        start_timeout: float = 120.0,
        orphan_timeout: float = 60.0,
        state_mode: str = "compact",
        snapshot_dir: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        # Phases: check the options, connect to Ray, join (or start) the coordinator.
        self.spec, self._slice = spec, _rank_slice(spec, rank, world_size)
        # The owners' options, checked by the shared groups they are made of, before Ray starts.
        self._options = OwnerOptions(
            backend=backend,
            workers=workers,
            chunk_records=chunk_records,
            prefetch_chunks=prefetch_chunks,
            ahead=ahead,
            keep=keep,
            verify_resume=verify_resume,
            allow_mix_change=allow_mix_change,
            allow_code_change=allow_code_change,
            start_timeout=start_timeout,
            orphan_timeout=orphan_timeout,
            snapshot_dir=snapshot_dir,
            owner_cpus=owner_cpus,
            snapshot_every=snapshot_every,
            max_replacements=max_replacements,
            owner=_NAME,
        )
        _check_run(spec, lane_owners, prefetch, keep, timeout)
        self._recipes = _recipe_writer(spec, StateOptions(state_mode=state_mode, owner=_NAME))
        start = None if state is None else to_loader_state(state)
        self._timeout, self._clock, self._run = timeout, clock, _run_length(prefetch, ahead)
        self.name = name or default_name(spec)
        self._start_coordinator(ray_address, owners=lane_owners, world_size=world_size, state=start)
        self._join(0 if start is None else start.step)

    def _start_coordinator(self, ray_address: str | None, **run: Any) -> None:
        """Connects to Ray (``ray_address``) and starts the coordinator actor named
        ``self.name`` with the owners' options, or finds it started by another rank (``run``:
        ``actors.coordinator_handle``'s owner count, world size and state)."""
        self._ray = require_ray(actors.FEATURE)
        self._started_ray = connect(actors.FEATURE, ray_address)
        self._closed = False
        self._coordinator = actors.coordinator_handle(self.name, self.spec, options=self._options, **run)

    def _join(self, step: int) -> None:
        """Joins the run as this rank, from ``step``: the owner table it reads from."""
        self._step = step
        self._table: OwnerTable = self._ask_coordinator(
            "join", self._coordinator.join.remote(self._slice.rank, self._slice.world_size, step)
        )
        self._finite = self.spec.compile().finite

    @property
    def rank_slice(self) -> RankSlice:
        return self._slice

    @property
    def table(self) -> OwnerTable:
        """Which owner runs which lanes (as of the last replacement this rank saw)."""
        return self._table

    def _call(self, ref: Any, timeout: float | None = None) -> Any:
        """``ray.get``, with an error raised in an actor re-raised as itself."""
        try:
            return self._ray.get(ref, timeout=timeout)
        except self._ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ZephonError):
                raise cause from None
            raise

    def _ask_coordinator(self, what: str, ref: Any, timeout: float | None = None) -> Any:
        """``_call`` for a call to the coordinator: its end for good is a
        ``CoordinatorLostError`` naming it and the call, and any other failure in it an
        ``OwnerError`` naming the call, never a raw Ray error. (A coordinator whose process
        dies is started again by Ray, and the call waits for it.)"""
        errors = self._ray.exceptions
        try:
            return self._call(ref, timeout)
        except errors.RayActorError as exc:
            if isinstance(exc, errors.RayTaskError):  # raised inside it (it is alive)
                raise OwnerError(
                    f"rank {self._slice.rank}: the lane owners' coordinator {self.name!r} failed during "
                    f"{what}: {_first_line(exc)}"
                ) from exc
            raise CoordinatorLostError(
                f"rank {self._slice.rank}: the lane owners' coordinator {self.name!r} failed to start "
                f"or was ended for good during {what}: {_first_line(exc)}; its owners end within "
                f"orphan_timeout; resume from the last checkpoint (OwnedLoader(state=...) or "
                f"zf.Loader(state=...))"
            ) from None
        except errors.RayError as exc:
            raise OwnerError(
                f"rank {self._slice.rank}: the lane owners' coordinator {self.name!r} failed during "
                f"{what}: {_first_line(exc)}"
            ) from exc

    # -- iteration -----------------------------------------------------------------------------
    def _ask(self, owner: int, step: int) -> tuple[Any, int]:
        """Asks ``owner`` for this rank's shares of a run of steps from ``step``: the pending
        reply, and the generation of the owner asked (the one to report if it turns out dead)."""
        handle, rs = self._table.handles[owner], self._slice
        ref = handle.shares.remote(rs.rank, rs.world_size, step, self._run, actors.CALL_WAIT)
        return ref, self._table.generations[owner]

    def _replace(self, owner: int, generation: int) -> None:
        """Owner ``owner`` of ``generation`` died: the coordinator replaces it (once, whichever
        rank reports it first) and this rank reads the new table."""
        self._table = self._ask_coordinator(
            f"the replacement of owner {owner}", self._coordinator.replace.remote(owner, generation)
        )

    def _poll(
        self, owner: int, ask: Callable[[Any], Any], what: str, asked: tuple[Any, int] | None = None
    ) -> Any:
        """``owner``'s answer to ``ask(handle)`` (a pending Ray call; ``asked``: one already
        in flight, with the generation of the owner asked), asked again while it is None
        (the owner has not made the step yet: each call waits for it there, ``CALL_WAIT``),
        pausing between tries as ``POLL`` says, for up to ``timeout`` seconds on the clock;
        a dead owner is replaced and its replacement asked, with a new ``timeout``. Past
        ``timeout``: an ``OwnerError`` naming the owner, its lanes and ``what`` this rank
        waited for."""
        while True:
            for _ in POLL.until(self._clock, self._timeout):
                if asked is None:
                    asked = ask(self._table.handles[owner]), self._table.generations[owner]
                (ref, generation), asked = asked, None
                try:
                    got = self._call(ref)
                except self._ray.exceptions.RayActorError:
                    self._replace(owner, generation)
                    break  # its replacement recomputes its lanes: a wait of its own
                if got is not None:
                    return got
            else:
                raise OwnerError(
                    f"rank {self._slice.rank} waited {self._timeout:g} s for lane owner {owner} "
                    f"(lanes {list(self._table.lanes[owner])}) {what}"
                )

    def _fetch(self, step: int, owner: int, asked: tuple[Any, int]) -> list[Batch]:
        """This rank's shares of a run of steps from ``step`` from ``owner`` (``asked``: the
        call in flight): asked again while the owner has not produced the step yet, the owner
        replaced if it died (``_poll``)."""
        got: list[Batch] = self._poll(
            owner, lambda _: self._ask(owner, step)[0], f"to make step {step}: {_STUCK}", asked
        )
        return got

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        if self._closed:
            raise ZephonError("this OwnedLoader is closed")
        return self._batches()

    def _batches(self) -> Iterator[tuple[int, Batch]]:
        """The engine's reader of lane owners (``engine/owned.py``), its shares carried by
        Ray calls (``_Shares``)."""
        owners = [o for o, _ in self._table.groups_for(self._slice.lane_ids)]
        yield from owned_batches(_Shares(self, owners), owners, self._step, finite=self._finite)

    def _taken(self, step: int) -> None:
        """Every step before ``step`` taken: reported every few steps, for the coordinator's
        snapshot gathers and for the floor the owners hold."""
        self._step = step
        if step % self._options.snapshot_every == 0 or step % PROGRESS_EVERY == 0:
            self._coordinator.progress.remote(self._slice.rank, step)

    def _take(self, owner: int, run: _Run, step: int) -> Batch:
        """``owner``'s share of ``step`` (the next one of ``run``): from the run already
        fetched, else from the call in flight. The next run is asked for as soon as one
        arrives, so one call is always on its way while this rank takes the steps it has."""
        if not run.shares:
            if run.pending is None:
                run.pending = self._ask(owner, run.asked)
            got = self._fetch(run.asked, owner, run.pending)
            run.shares.extend(got)
            run.asked += len(got)
            run.pending = self._ask(owner, run.asked)
        return run.shares.popleft()

    def _lives(self, step: int) -> Iterator[bool]:
        """Each owner's answer to whether its lanes have a real sample at ``step`` (a dead
        owner is replaced and asked again; one that has not made the step within ``timeout``
        seconds is an ``OwnerError``, as a fetch's: ``_poll``)."""
        for owner in range(len(self._table.lanes)):

            def ask(handle: Any) -> Any:
                return handle.live.remote(step, actors.CALL_WAIT)

            yield bool(self._poll(owner, ask, f"to say whether step {step} has a sample: {_STUCK}"))

    # -- state ---------------------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        return self._step

    def checkpoint(self, step: int | None = None) -> LoaderState:
        """Every lane's state from which ``step`` (default: this rank's next) is the next global
        batch, gathered from the owners: resumes on any owner count, the embedded ``Loader``
        and any world size."""
        at = self._step if step is None else step
        state: LoaderState = self._ask_coordinator(
            f"checkpoint(step={at})", self._coordinator.checkpoint.remote(at)
        )
        return self._saved_form(state)

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        step: int | None = None,
        *,
        base: str | os.PathLike[str] | None = None,
    ) -> str:
        """Writes the checkpoint at ``step`` (default: this rank's next) where it belongs: each
        owner writes its own lanes' part (``<path>.parts/``) and the coordinator a small
        manifest at ``path`` that names the parts and their sha256; ``zf.load_state(path)``
        reads it as any checkpoint. No lane's state passes through this rank or the
        coordinator. ``path`` must be on storage the owners and the coordinator see (a shared
        file system on a cluster). With ``base`` (an earlier checkpoint's manifest) each part
        holds only what changed since that checkpoint's part (load it with its base next to
        it). Returns the manifest's absolute path. (Compact states only: with
        ``state_mode="recipe"``, ``zf.save_state(loader.checkpoint(), path)``.)"""
        if self._recipes is not None:
            raise UsageError(
                "OwnedLoader.save_checkpoint writes compact parts; with state_mode='recipe' use "
                "zf.save_state(loader.checkpoint(), path)"
            )
        at = self._step if step is None else step
        where = os.path.abspath(os.fspath(path))
        on = None if base is None else os.path.abspath(os.fspath(base))
        if on is not None and not os.path.exists(on):
            raise StateError(f"save_checkpoint: its base {on} does not exist (give an earlier manifest)")
        written: str = self._ask_coordinator(
            f"save_checkpoint(step={at})", self._coordinator.write_checkpoint.remote(at, where, on)
        )
        return written

    def _saved_form(self, state: LoaderState) -> LoaderState:
        """``state`` as this loader gives it: recipes with ``state_mode="recipe"``."""
        return state if self._recipes is None else self._recipes(state)

    def state_dict(self) -> dict[str, Any]:
        """Plain data: this rank's lanes, positioned after the last batch yielded (as
        ``zf.Loader.state_dict``; ``zf.merge_states`` joins the ranks'). Asked of the owners
        of this rank's lanes only: no other rank's lanes pass through it or the coordinator."""
        return self.rank_state().to_plain()

    def rank_state(self, step: int | None = None) -> LoaderState:
        """This rank's lanes' state from which ``step`` (default: its next) is the next global
        batch, from the owners of its lanes (a dead one is replaced first)."""
        at = self._step if step is None else step
        lanes: dict[int, Any] = {}
        history: list[Any] = []
        for owner, owned in self._table.groups_for(self._slice.lane_ids):
            snaps, history = self._lanes_snapshot(owner, owned, at)
            lanes.update(snaps)
        spec = self.spec
        return self._saved_form(LoaderState(at, spec.lanes, dict(spec.fingerprint), lanes, history))

    def _lanes_snapshot(self, owner: int, lanes: list[int], step: int) -> tuple[dict[int, Any], list[Any]]:
        """``owner``'s snapshots of ``lanes`` at ``step``, asked again while it has not made
        that step, for up to ``timeout`` s (a dead owner is replaced: ``_poll``)."""

        def ask(handle: Any) -> Any:
            return handle.lanes_snapshot.remote(step, lanes)

        what = f"to hold step {step}: a rank's state is of a step it is at (an owner holds a few steps around its readers)"
        snaps, history = self._poll(owner, ask, what)
        return snaps, history

    def owner_pids(self) -> list[int]:
        """The process id of each owner (for fault tests and monitoring); an owner found dead
        is replaced first (as a fetch would), so the answer names live processes."""
        pids = []
        for owner in range(len(self._table.handles)):
            while True:
                generation = self._table.generations[owner]
                try:
                    pids.append(int(self._call(self._table.handles[owner].pid.remote())))
                    break
                except self._ray.exceptions.RayActorError:
                    self._replace(owner, generation)
        return pids

    def coordinator_pid(self) -> int:
        """The process id of the coordinator (for fault tests and monitoring)."""
        return int(self._ask_coordinator("coordinator_pid()", self._coordinator.pid.remote()))

    def owner_nodes(self) -> list[str]:
        """The id of the Ray node each owner runs on (for monitoring and node-loss tests)."""
        return [str(self._call(h.node.remote())) for h in self._table.handles]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            left = self._call(self._coordinator.leave.remote(self._slice.rank), timeout=30)
            if left == 0:
                self._call(self._coordinator.shutdown.remote(), timeout=60)
                self._ray.kill(self._coordinator)
                self._await_name_released()
        disconnect_if_started(self._started_ray)

    def _await_name_released(self, timeout: float = 10.0) -> None:
        """Waits until the killed coordinator's name is free, so that loaders made next with
        the same name start a new one instead of finding the dying one."""
        for _ in POLL.until(self._clock, timeout):
            try:
                self._ray.get_actor(self.name, namespace=actors.NAMESPACE)
            except ValueError:
                return

    def __enter__(self) -> OwnedLoader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


#: Why an owner does not make the step a rank waits for.
_STUCK = "its other readers (ranks) may have stopped reading, or the owner is stuck; see its status"


def _run_length(prefetch: int, ahead: int) -> int:
    """Steps fetched per call: the rank holds at most this many it has not taken while the
    next run is asked for, and asking moves its position on the owner there, so its steps
    from ``prefetch - 1`` back stay held (``keep``); at most ``ahead``."""
    return max(1, min(prefetch - 1, ahead))


class _Run:
    """One owner's shares for this rank: those fetched and not yet taken, the first step not
    yet asked for, and the call in flight (with the generation of the owner asked)."""

    def __init__(self, step: int) -> None:
        self.shares: deque[Batch] = deque()
        self.asked = step
        self.pending: tuple[Any, int] | None = None


class _Shares:
    """``OwnedLoader``'s carrier of shares (``engine/owned.py``): for each owner of the rank's
    lanes, runs of steps asked of its actor, with the next call always in flight."""

    def __init__(self, loader: OwnedLoader, owners: list[int]) -> None:
        self._loader = loader
        self._runs = {owner: _Run(loader.next_step) for owner in owners}

    def share(self, owner: int, step: int) -> Batch:
        return self._loader._take(owner, self._runs[owner], step)

    def lives(self, step: int) -> Iterator[bool]:
        return self._loader._lives(step)

    def taken(self, step: int) -> None:
        self._loader._taken(step)


def _rank_slice(spec: LoaderSpec, rank: int, world_size: int) -> RankSlice:
    """Rank ``rank``'s rows of ``spec``'s global batches (a spec that is not one is refused)."""
    if not isinstance(spec, LoaderSpec):
        raise SpecError(f"spec must be a zf.LoaderSpec, got {type(spec).__name__}")
    return RankSlice(
        rank=rank, world_size=world_size, lanes=spec.lanes, global_batch_size=spec.global_batch_size
    )


def _check_run(spec: LoaderSpec, lane_owners: int, prefetch: int, keep: int, timeout: float) -> None:
    """Refuses a number of owners ``spec``'s lanes cannot be dealt to, a ``prefetch`` the
    owners cannot hold (they keep ``keep`` steps behind a rank's request), or a ``timeout``
    that is not a number of seconds (this rank's options: the checks of ``core/options.py``)."""
    plan_owners(spec.lanes, lane_owners)
    check_int(prefetch, "prefetch", owner=_NAME)
    if prefetch > keep + 1:
        raise SpecError(
            f"{_NAME}: prefetch must be an integer in [1, keep + 1 = {keep + 1}] (owners keep "
            f"`keep` steps behind a rank's request), got {prefetch!r}"
        )
    check_seconds(timeout, "timeout", owner=_NAME)


def _recipe_writer(spec: LoaderSpec, states: StateOptions) -> recipe.RecipeWriter | None:
    """What writes recipe states (``state_mode="recipe"``), here, from the owners' full
    snapshots: refused at once, by name, for a pipeline whose buffers cannot be stored as
    recipes; None for compact states."""
    return recipe.RecipeWriter(spec.compile()) if states.state_mode == "recipe" else None


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of a Ray error's message (the rest is Ray's traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
