"""The lane owners' coordinator: assigns lanes to owners, gathers checkpoints, replaces dead owners.

The coordinator is off the data path: trainer ranks fetch their rows from the owners of their
lanes directly. It holds the owner table (which owner runs which lanes, and each owner's
generation: a replacement bumps it), the ranks' reported positions, and, per owner, the last
snapshot of its lanes that it gathered (every ``snapshot_every`` steps of the slowest rank).
A checkpoint at a step is the owners' lane snapshots at that step, joined into one ordinary
``LoaderState``: it resumes on any number of owners, on the embedded ``Loader``, and under any
world size. It runs as a named Ray actor (``coordinator_actor``), or in-process with any
``launch`` function (the scale simulation uses instant fake owners).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from zephon_flow.cluster.snapshots import Held, PackedSnapshot
from zephon_flow.core.checkpoint.state import LaneState, LoaderState
from zephon_flow.core.checkpoint.store import load_state
from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import OwnerLostError as OwnerLostError  # also imported from here
from zephon_flow.core.errors import SpecError, ZephonError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.core.options import check_int
from zephon_flow.core.retry import POLL
from zephon_flow.engine.loader import apply_mix_change, checked_mix_change, refused_mix_step, restore_lanes
from zephon_flow.engine.spec import LoaderSpec

#: Owners asked at once for their snapshots (a gather is bounded by the slowest of a batch).
GATHER_THREADS = 16
_T = TypeVar("_T")
_log = logging.getLogger("zephon_flow.cluster")


def plan_owners(lanes: int, owners: int) -> list[list[int]]:
    """Lanes ``0..lanes-1`` cut into ``owners`` contiguous groups of sizes differing by at most
    one (owner ``i`` runs lanes ``[i*L//N, (i+1)*L//N)``): a rank's rows, contiguous lanes,
    come from as few owners as possible."""
    if not isinstance(owners, int) or isinstance(owners, bool) or not 1 <= owners <= lanes:
        raise SpecError(
            f"lane_owners must be an integer in [1, lanes={lanes}] (an owner runs at least one "
            f"lane), got {owners!r}"
        )
    return [list(range(i * lanes // owners, (i + 1) * lanes // owners)) for i in range(owners)]


def readers_of(lanes: list[int], spec: LoaderSpec, world_size: int) -> list[int]:
    """The ranks of ``world_size`` whose rows fall on any of ``lanes`` (contiguous lanes: the
    ranks whose row ranges meet ``[lanes[0]*B/L, (lanes[-1]+1)*B/L)``)."""
    if not lanes:
        return []
    per_lane = spec.global_batch_size // spec.lanes
    per_rank = spec.global_batch_size // world_size
    if lanes != list(range(lanes[0], lanes[-1] + 1)):
        return sorted({r for lane in lanes for r in readers_of([lane], spec, world_size)})
    first_row, end_row = lanes[0] * per_lane, (lanes[-1] + 1) * per_lane
    return list(range(first_row // per_rank, (end_row - 1) // per_rank + 1))


@dataclass(frozen=True)
class OwnerTable:
    """Which owner runs which lanes, each owner's handle and generation (bumped per
    replacement): what a rank needs to fetch its rows."""

    lanes: tuple[tuple[int, ...], ...]
    handles: tuple[Any, ...]
    generations: tuple[int, ...]

    def owner_of(self, lane: int) -> int:
        for i, group in enumerate(self.lanes):
            if group and group[0] <= lane <= group[-1]:
                return i
        raise SpecError(f"no owner runs lane {lane}; the owners run lanes {[list(g) for g in self.lanes]}")

    def groups_for(self, lane_ids: range) -> list[tuple[int, list[int]]]:
        """``(owner, its lanes among lane_ids)`` in lane order, for a rank's lanes."""
        out: list[tuple[int, list[int]]] = []
        for lane in lane_ids:
            owner = self.owner_of(lane)
            if out and out[-1][0] == owner:
                out[-1][1].append(lane)
            else:
                out.append((owner, [lane]))
        return out


#: Starts one owner: (index, name, lanes, state or None, readers {rank: first step},
#: generation) -> handle.
Launch = Callable[[int, str, list[int], LoaderState | None, dict[int, int], int], Any]
#: Asks an owner for its lanes' snapshots at a step: (handle, step) -> {lane: state} or None.
Gather = Callable[[Any, int], Mapping[int, LaneState] | None]


#: Asks an owner for its lanes' snapshots at a step packed (``cluster/snapshots.py``: each
#: buffered element pickled once, not at every gather, and not sent again while the
#: coordinator holds it): (handle, step, what it holds of that owner's snapshot or None) ->
#: the packed snapshots, or None while it does not hold that step.
Pack = Callable[[Any, int, Held | None], PackedSnapshot | None]
#: One gather's answer: the lanes' states, packed, or the file they were written to.
Snapshot = Mapping[int, LaneState] | PackedSnapshot | str


#: Has an owner write its lanes' snapshots at a step to a file: (handle, step, index) -> the
#: file's path, or None while it does not hold that step.
Store = Callable[[Any, int, int], str | None]


@dataclass(frozen=True)
class Adopted:
    """A live owner that a restarted coordinator takes over instead of starting one: its
    handle and generation, where its readers are (rank -> the step it asks for next), the
    oldest step it holds, its mixture history (changes made while the run went on), and the
    slowest rank's step the coordinator before last told it (every rank was at least there)."""

    handle: Any
    generation: int
    positions: Mapping[int, int]
    low: int
    mix_history: list[tuple[int, dict[str, Any]]]
    floor: int | None = None


class Coordinator:
    """Coordinates ``owners`` lane owners of ``spec`` for trainer ranks of ``world_size``,
    starting from ``state`` (None: the start). ``launch`` starts an owner, ``gather`` asks one
    for snapshots, ``stop`` ends one, ``address_of`` says where one serves and ``alive`` whether
    one still answers (the Ray ones are in ``actors``).
    At most ``max_replacements`` dead owners are replaced over the run; an owner reported dead
    that still answers (``alive``) is not replaced, and counts for nothing. ``clock`` is what
    a checkpoint's wait for the owners' snapshots reads. ``adopt`` (a coordinator started
    again after its own death) gives, per owner, the live one to take over (None: start it
    again, from the newest of its snapshot files in ``stored`` that loads, else from its lanes
    in ``state``: a replay from the run's first step). With ``store`` the owners write their
    snapshots to files (``store(handle, step, index)`` -> the file, or None while the step is
    not held) and the coordinator keeps only their names, not every lane's state; else with
    ``pack`` the periodic gathers ask for packed snapshots (``pack(handle, step, held)``),
    which it keeps as bytes and unpacks only to start a replacement; an owner sends only the
    items that the snapshot kept before does not hold. ``gather`` is what a
    checkpoint asks."""

    def __init__(
        self,
        spec: LoaderSpec,
        *,
        owners: int,
        world_size: int,
        state: LoaderState | None,
        launch: Launch,
        gather: Gather,
        stop: Callable[[Any], None] = lambda handle: None,
        address_of: Callable[[Any], str] | None = None,
        alive: Callable[[Any], bool] | None = None,
        snapshot_every: int = 8,
        max_replacements: int = 3,
        allow_mix_change: bool = False,
        allow_code_change: bool = False,
        clock: Clock = SYSTEM_CLOCK,
        adopt: Sequence[Adopted | None] | None = None,
        stored: Mapping[int, Sequence[tuple[int, str]]] | None = None,
        store: Store | None = None,
        pack: Pack | None = None,
        hold_floor: Callable[[Any, int], None] | None = None,
    ) -> None:
        # Phases: check the topology, restore where the lanes start, launch (or adopt) the owners.
        self._clock = clock
        check_int(snapshot_every, "snapshot_every", owner="lane owners")
        RankSlice(rank=0, world_size=world_size, lanes=spec.lanes, global_batch_size=spec.global_batch_size)
        self.spec, self.world_size = spec, world_size
        self._groups = plan_owners(spec.lanes, owners)
        start = restore_lanes(
            spec,
            spec.compile(),
            state,
            list(range(spec.lanes)),
            who="the lane owners",
            allow_mix_change=allow_mix_change,
            allow_code_change=allow_code_change,
            rebuild_recipes=False,  # the owners rebuild their own lanes
        )
        self._track(start.step, owners, recipe=state is not None and state.recipe)
        self._launch, self._gather, self._stop = launch, gather, stop
        self._store, self._pack = store, pack
        # Tells an owner the run's slowest rank's step (it holds steps from there), without
        # waiting: every owner keeps what a checkpoint or snapshot at that step needs.
        self._hold_floor = hold_floor
        self._floor = -1  # the last floor the owners were told
        self._packed: dict[int, PackedSnapshot] = {}  # owner -> its last snapshot, packed (pack)
        self._snap_files: dict[int, str] = {}  # owner -> the file of its last snapshot (store)
        self._recovered: dict[int, LoaderState] = {}  # owner -> its file found at a restart, read
        self._closed = False
        self._gathering: set[int] = set()  # owners whose snapshot is being gathered
        self._address_of, self._alive = address_of, alive
        self._snapshot_every, self._max_replacements = snapshot_every, max_replacements
        self._mix_history = [] if start.mixture is None else start.mixture.history()
        self._mixture = start.mixture  # changed from a step on by change_mixture
        self._snaps: dict[int, LaneState | None] = dict(start.lanes)
        if adopt is None:
            self._handles = [self._start_owner(i) for i in range(owners)]
        else:
            self._handles = self._adopt(list(adopt), stored or {})

    def _track(self, first_step: int, owners: int, *, recipe: bool) -> None:
        """The bookkeeping of a run that starts at ``first_step`` (no owner started yet)."""
        world_size = self.world_size
        self.first_step = first_step
        self._addresses = [""] * owners
        self._lock = threading.RLock()
        self._snap_steps = [first_step] * owners
        # A recipe state's lanes are rebuilt by the owners that run them (not here): an owner
        # starts from the state as given, recipes and all, until a snapshot of it is gathered.
        self._recipe = [recipe] * owners
        self._positions = dict.fromkeys(range(world_size), first_step)
        # How many ranks are at each position: the slowest is the least key, found without a
        # pass over every rank (ranks report in strides, so there are few distinct positions).
        self._at = Counter({first_step: world_size})
        self._joined: set[int] = set()
        self._replaced = 0
        self._generations = [0] * owners
        #: Calls received and bytes of snapshots gathered (for the scale simulation).
        self.messages = 0
        self.gathers = 0

    # -- owners --------------------------------------------------------------------------------
    def _owner_name(self, index: int) -> str:
        return f"lane owner {index}"

    def _state_of(self, index: int) -> LoaderState | None:
        """The last gathered snapshot of owner ``index``'s lanes, as a state to start from."""
        if index in self._snap_files:  # written by the owner: read only to start its replacement
            recovered = self._recovered.pop(index, None)  # (read once already when it was found)
            if recovered is not None:
                return recovered
            return load_state(self._snap_files[index], codecs=self.spec.compile().derived_codecs)
        lanes = self._groups[index]
        states: dict[int, LaneState | None]
        if index in self._packed:  # kept packed: unpacked only to start its replacement
            states = dict(self._packed[index].unpack())
        else:
            states = {lane: self._snaps[lane] for lane in lanes}
        if all(s is None for s in states.values()):
            return None  # a fresh start: the lanes start at step 0 with no state
        return LoaderState(
            self._snap_steps[index],
            self.spec.lanes,
            dict(self.spec.fingerprint),
            {lane: s for lane, s in states.items() if s is not None},
            list(self._mix_history),
            recipe=self._recipe[index],
        )

    def _start_owner(self, index: int, generation: int = 0) -> Any:
        lanes = self._groups[index]
        at = self._snap_steps[index]
        readers = {r: max(at, self._positions[r]) for r in readers_of(lanes, self.spec, self.world_size)}
        state = self._state_of(index)
        handle = self._launch(index, self._owner_name(index), lanes, state, readers, generation)
        if self._hold_floor is not None:
            self._hold_floor(handle, min(self._at))
        if self._address_of is not None:
            self._addresses[index] = self._address_of(handle)
        return handle

    def _adopt(
        self, found: list[Adopted | None], stored: Mapping[int, Sequence[tuple[int, str]]]
    ) -> list[Any]:
        """Takes over the live owners ``found`` (this coordinator was started again): their
        generations, their readers' positions (the least each owner reports: a replacement
        holds from there), the mixture history they run, and their lanes' snapshots at the
        oldest step they hold. An owner not found (it died while no coordinator ran) is
        replaced from its newest snapshot file in ``stored`` that loads, else from the run's
        start; a rank whose position no live owner knows is placed at the least step every
        rank was at (the floor the owners were told, or that snapshot's step)."""
        if len(found) != len(self._groups):
            raise SpecError(
                f"lane owners: {len(found)} owners to adopt, but this run has {len(self._groups)}"
            )
        live = [a for a in found if a is not None]
        if live and live[0].mix_history != self._mix_history and self._mixture is not None:
            self._mixture = type(self._mixture).from_history(live[0].mix_history)  # type: ignore[attr-defined]
            self._mix_history = list(live[0].mix_history)
        for i, got in enumerate(found):
            if got is None:
                self._recover_snapshot(i, stored.get(i, ()))
        floors = [a.floor for a in live if a.floor is not None]
        every_rank_at = max([self.first_step, *floors, *(self._snap_steps[i] for i in self._snap_files)])
        for rank in self._positions:
            seen = [a.positions[rank] for a in live if rank in a.positions]
            self._set_position(rank, min(seen, default=every_rank_at))
        self._joined = set(range(self.world_size))  # who had left is not known: all may read
        handles: list[Any] = []
        for i, got in enumerate(found):
            if got is None:
                self._generations[i] = 1 + max((a.generation for a in live), default=0)
                self._replaced += 1
                if i not in self._snap_files and self.first_step < every_rank_at:
                    _log.warning(
                        "%s (lanes %s) died while the coordinator was down and no snapshot file holds "
                        "its lanes (snapshot_dir unset): its replacement recomputes them from the "
                        "run's first step %d to step %d",
                        self._owner_name(i),
                        self._groups[i],
                        self.first_step,
                        every_rank_at,
                    )
                handles.append(self._start_owner(i, self._generations[i]))
                continue
            self._generations[i] = got.generation
            self._replaced += got.generation
            if got.low > self._snap_steps[i]:
                self._keep_snapshot(i, got.low, self._snapshot(i, got.handle, got.low))
            if self._address_of is not None:
                self._addresses[i] = self._address_of(got.handle)
            handles.append(got.handle)
        return handles

    def _recover_snapshot(self, index: int, files: Sequence[tuple[int, str]]) -> None:
        """Owner ``index``'s newest snapshot file (``(step, path)`` of ``files``) at or past the
        run's first step that loads, kept to start its replacement from; a file that does not
        load (cut short, damaged) is passed over, with a warning naming it."""
        codecs = self.spec.compile().derived_codecs
        for step, path in sorted(files, reverse=True):
            if step < self.first_step:
                continue
            try:
                self._recovered[index] = load_state(path, codecs=codecs)
            except Exception as exc:
                _log.warning(
                    "%s: snapshot file %s does not load, passed over: %s", self._owner_name(index), path, exc
                )
                continue
            self._snap_files[index], self._snap_steps[index] = path, step
            self._snaps.update(dict.fromkeys(self._groups[index]))  # held in the file, not here
            self._recipe[index] = False
            return

    def addresses(self) -> list[str]:
        """Each owner's serving address ("" for owners that do not serve over gRPC)."""
        with self._lock:
            return list(self._addresses)

    def table(self) -> OwnerTable:
        with self._lock:
            return OwnerTable(
                tuple(tuple(g) for g in self._groups), tuple(self._handles), tuple(self._generations)
            )

    def join(self, rank: int, world_size: int, first_step: int) -> OwnerTable:
        """Rank ``rank`` of ``world_size`` starts reading at ``first_step``; the owner table."""
        with self._lock:
            self.messages += 1
            if world_size != self.world_size:
                raise SpecError(
                    f"these lane owners serve world_size={self.world_size}, not {world_size}: a new "
                    f"world size resumes from a checkpoint (Coordinator.checkpoint) on new owners"
                )
            if first_step != self.first_step:
                raise SpecError(
                    f"rank {rank} starts at step {first_step}, but these lane owners started at step "
                    f"{self.first_step}: every rank must pass the same state"
                )
            self._joined.add(rank)
            return self.table()

    def leave(self, rank: int) -> int:
        """Rank ``rank`` is done; returns how many ranks are still reading."""
        with self._lock:
            self.messages += 1
            self._joined.discard(rank)
            return len(self._joined)

    def progress(self, rank: int, step: int) -> None:
        """Rank ``rank`` has taken every step before ``step``. Once the slowest rank is
        ``snapshot_every`` steps past an owner's last gathered snapshot, gathers a new one."""
        with self._lock:
            self.messages += 1
            old = self._positions.get(rank)
            if old is not None and step > old:
                self._set_position(rank, step)
            slowest = min(self._at)
            if self._closed:
                return
            if self._hold_floor is not None and slowest > self._floor:
                self._floor = slowest
                for handle in self._handles:
                    self._hold_floor(handle, slowest)
            due = [
                i
                for i, at in enumerate(self._snap_steps)
                if slowest >= at + self._snapshot_every and i not in self._gathering
            ]
            self._gathering.update(due)  # one gather per owner at a time, whoever reports
            handles = [(i, self._handles[i], self._generations[i]) for i in due]

        def ask(item: tuple[int, Any, int]) -> Snapshot | None:
            try:
                return self._snapshot(item[0], item[1], slowest)
            except Exception:  # a dead owner: its replacement restores from the last snapshot
                return None

        try:
            gathered = self._parallel(ask, handles)
        finally:
            with self._lock:
                self._gathering.difference_update(due)
        for (i, _, generation), snaps in zip(handles, gathered, strict=True):
            if snaps is None:
                continue  # not held (or dead): the next report brings another chance
            with self._lock:
                stale = self._closed or self._generations[i] != generation
                if stale or slowest <= self._snap_steps[i]:
                    if isinstance(snaps, str) and snaps != self._snap_files.get(i):
                        _remove(snaps)  # another report kept a newer one meanwhile
                    continue
                self._keep_snapshot(i, slowest, snaps)
                self.gathers += 1

    def snapshot_files(self) -> dict[int, str]:
        """Per owner, the file of the snapshot its replacement would start from (``store``)."""
        with self._lock:
            return dict(self._snap_files)

    def _snapshot(self, index: int, handle: Any, step: int) -> Snapshot | None:
        """Owner ``index``'s snapshots at ``step``: with ``store`` the file it wrote them to,
        with ``pack`` packed, else its lanes' states (None while it does not hold the step)."""
        if self._store is not None:
            return self._store(handle, step, index)
        if self._pack is not None:
            with self._lock:
                before = self._packed.get(index)
            return self._pack(handle, step, None if before is None else before.held())
        return self._gather(handle, step)

    def _keep_snapshot(self, index: int, step: int, snaps: Snapshot | None) -> None:
        """Keeps owner ``index``'s snapshot of ``step`` (``_snapshot``'s answer) to restart it
        from; a file replaces (and removes) the one before. A snapshot older than the one kept
        (gathers answered out of order) is dropped, its file with it: the kept one's file stays."""
        if snaps is None:
            return
        if step < self._snap_steps[index]:
            if isinstance(snaps, str) and snaps != self._snap_files.get(index):
                _remove(snaps)
            return
        if isinstance(snaps, str):
            before = self._snap_files.get(index)
            self._snap_files[index] = snaps
            self._snaps.update(dict.fromkeys(self._groups[index]))  # held in the file, not here
            if before is not None and before != snaps:
                _remove(before)
        elif isinstance(snaps, PackedSnapshot):
            try:  # with the items the owner did not send again, from the snapshot kept before
                self._packed[index] = snaps.complete(self._packed.get(index))
            except KeyError:
                return  # not told of what is held here (cannot be): the next gather sends all
            self._snaps.update(dict.fromkeys(self._groups[index]))  # held packed, not here
        else:
            self._snaps.update(snaps)
        self._snap_steps[index] = step
        self._recipe[index] = False

    def _set_position(self, rank: int, step: int) -> None:
        old = self._positions[rank]
        self._positions[rank] = step
        self._at[old] -= 1
        if not self._at[old]:
            del self._at[old]
        self._at[step] += 1

    def replace(self, index: int, generation: int) -> OwnerTable:
        """Owner ``index`` of ``generation`` died: starts a new one from its lanes' last
        snapshot (it catches up to the ranks' steps by recomputing, so the bytes are the same).
        A replacement already made for that generation is returned as it is, and so is the
        table when the owner still answers (``alive``: a broken stream, not a dead owner)."""
        with self._lock:
            self.messages += 1
            if not isinstance(index, int) or not 0 <= index < len(self._groups):
                raise SpecError(f"no lane owner {index!r}: this run's owners are 0..{len(self._groups) - 1}")
            if self._generations[index] != generation:
                return self.table()
            handle = self._handles[index]
        if self._alive is not None and self._alive(handle):
            return self.table()
        with self._lock:
            if self._generations[index] != generation:
                return self.table()
            lanes, step = self._groups[index], min(self._at)
            if self._replaced >= self._max_replacements:
                raise OwnerLostError(
                    f"{self._owner_name(index)} (lanes {lanes}) died at step {step} and cannot be "
                    f"restarted: max_replacements={self._max_replacements} owners were already "
                    f"replaced; resume from the last checkpoint, or allow more replacements"
                )
            with_snapshot = self._snap_steps[index]
            try:
                handle = self._start_owner(index, generation + 1)
            except Exception as exc:
                raise OwnerLostError(
                    f"{self._owner_name(index)} (lanes {lanes}) died at step {step} and cannot be "
                    f"restarted from its snapshot of step {with_snapshot}: {type(exc).__name__}: {exc}"
                ) from exc
            self._replaced += 1
            self._handles[index] = handle
            self._generations[index] += 1
            return self.table()

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, step: int, timeout: float = 120.0) -> LoaderState:
        """The state from which ``step`` is the next global batch: every owner's lane snapshots
        at ``step``, in one ordinary ``LoaderState`` (waits up to ``timeout`` s for them)."""
        lanes: dict[int, LaneState] = {}
        for snaps in self.from_owners(step, lambda _, handle: self._gather(handle, step), timeout):
            lanes.update(snaps)
        return LoaderState(step, self.spec.lanes, dict(self.spec.fingerprint), lanes, list(self._mix_history))

    def from_owners(
        self, step: int, ask: Callable[[int, Any], _T | None], timeout: float = 120.0
    ) -> list[_T]:
        """``ask(index, handle)`` of every owner, for a checkpoint at ``step``: asked again while
        it answers None (the owner does not hold the step yet), for up to ``timeout`` s. An
        owner that died is replaced first (its replacement recomputes up to ``step``), so a
        checkpoint taken just after a death is the same checkpoint; an owner's own failure
        (an error of the project's) is raised as it is."""
        with self._lock:
            self.messages += 1
            owners = list(range(len(self._handles)))
            # A checkpoint is of a step the ranks are at: an owner replaced from here on holds
            # (and so makes) the steps from there, not from their last reports.
            for rank, at in list(self._positions.items()):
                if at < step:
                    self._set_position(rank, step)

        def one(i: int) -> _T:
            for _ in POLL.until(self._clock, timeout):
                with self._lock:
                    handle, generation = self._handles[i], self._generations[i]
                try:
                    got = ask(i, handle)
                except ZephonError:
                    raise
                except Exception:
                    self.replace(i, generation)  # alive after all: asked again; else replaced
                    got = None
                if got is not None:
                    return got
            raise OwnerLostError(
                f"checkpoint at step {step}: {self._owner_name(i)} (lanes {self._groups[i]}) "
                f"does not hold that step within {timeout:g} s: checkpoint a step the ranks "
                f"are at (an owner holds a few steps around its readers)"
            )

        return self._parallel(one, owners)

    def _parallel(self, ask: Callable[[Any], _T], items: list[Any]) -> list[_T]:
        """``ask`` of every item, at most ``GATHER_THREADS`` at a time (owners answer in
        parallel, so a gather takes about one round trip, not one per owner)."""
        if len(items) <= 1:
            return [ask(item) for item in items]
        with ThreadPoolExecutor(max_workers=min(GATHER_THREADS, len(items))) as pool:
            return list(pool.map(ask, items))

    # -- mixture changes while running ---------------------------------------------------------
    def change_mixture(
        self,
        step: int,
        points: Sequence[tuple[int, Sequence[float]]],
        *,
        interpolation: str = "constant",
        call: Callable[[Any, str, tuple[Any, ...]], Any],
    ) -> list[tuple[int, dict[str, Any]]]:
        """Puts new mixture weights in force on every owner from ``step`` on (``points`` as in
        ``Mix.starting_at``), in two phases: each owner holds its production before ``step``
        and says whether it has begun it; if none has, each takes the change and goes on,
        else each goes on unchanged and the change is refused naming the first step still
        open. ``call(handle, method, args)`` calls an owner. Checkpoints and replacements
        from then on carry the new mixture history, which is returned. The table does not
        change meanwhile (no replacement runs during a change)."""
        mix = checked_mix_change(self._mixture, step, points, interpolation=interpolation)
        with self._lock:
            self.messages += 1
            handles = list(self._handles)
            held: list[Any] = []
            try:
                begun = []
                for handle in handles:
                    first = call(handle, "hold_mixture", (step,))
                    held.append(handle)
                    if first is not None:
                        begun.append(int(first))
                if begun:
                    raise refused_mix_step(step, max(begun), "the lane owners")
                self._mix_history = apply_mix_change(self._mixture, step, mix)
                while held:
                    call(held[0], "change_mixture", (step, mix))
                    held.pop(0)
            finally:
                for handle in held:  # refused, or an owner failed: the others go on unchanged
                    call(handle, "release_mixture", ())
            return list(self._mix_history)

    def positions(self) -> dict[int, int]:
        with self._lock:
            return dict(self._positions)

    def shutdown(self) -> None:
        with self._lock:
            handles, self._handles = list(self._handles), []
            files, self._snap_files = list(self._snap_files.values()), {}
            self._closed = True
        for handle in handles:
            self._stop(handle)
        for path in files:  # the run is over: nothing will start from them
            _remove(path)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
