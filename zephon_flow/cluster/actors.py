"""The lane owners and their coordinator as Ray actors (Ray is imported through ``ray_env``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from zephon_flow.cluster.coordinator import Adopted, Coordinator, OwnerTable, Store
from zephon_flow.cluster.owner import LaneOwner, OwnerError, OwnerOptions, OwnerRows
from zephon_flow.cluster.serving import OwnerServer, Serving
from zephon_flow.cluster.snapshots import Held, PackedSnapshot, SnapshotPacker
from zephon_flow.core.batches import Batch
from zephon_flow.core.checkpoint import manifest
from zephon_flow.core.checkpoint.manifest import Part
from zephon_flow.core.checkpoint.state import LaneState, LoaderState
from zephon_flow.core.checkpoint.store import save_state
from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import SpecError, ZephonError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.runners.ray_env import require_ray

FEATURE = "lane owners (lane_owners=N, zephon serve --lane-owners)"
#: Concurrent calls an owner answers (each rank's reads wait on it for their step).
OWNER_CONCURRENCY = 64
#: How long one owner call waits for a step before the caller asks again (seconds).
CALL_WAIT = 2.0
#: How long an owner reported dead has to answer a ping to count as alive (not replaced).
ALIVE_WAIT = 10.0
#: The Ray namespace of every run's coordinator and owners: ranks in separate processes (each
#: its own Ray job, by default each in an anonymous namespace) find the same run by its name.
NAMESPACE = "zephon-flow"
#: How often an owner looks for its coordinator (seconds).
WATCH_EVERY = 1.0


def owner_actor_name(run: str, index: int, generation: int) -> str:
    """The Ray name of owner ``index`` of ``generation`` in the run named ``run``: a coordinator
    started again after its death finds the live owners of its run by it."""
    return f"{run}/owner-{index}/g{generation}"


_OWNER_NAME = re.compile(r"^(?P<run>.+)/owner-(?P<index>\d+)/g(?P<generation>\d+)$")


class OwnerActor:
    """The body of a lane owner's Ray actor: builds a ``LaneOwner`` and answers its calls."""

    def __init__(
        self,
        spec: LoaderSpec,
        lanes: list[int],
        state: LoaderState | None,
        readers: dict[int, int],
        options: OwnerOptions,
        name: str,
        serving: Serving | None = None,
        run: str | None = None,
    ) -> None:
        self._owner = LaneOwner(
            spec,
            lanes,
            state=state,
            readers=readers,
            options=options,
            name=name,
            replay=0 if serving is None else serving.replay,
        ).start()
        self._packer = SnapshotPacker()
        self._server = None if serving is None else OwnerServer(self._owner, serving)
        if run is not None:  # a detached owner: it outlives its coordinator, not its run
            threading.Thread(
                target=self._watch, args=(run, options.orphan_timeout), name="zephon-owner-watch", daemon=True
            ).start()

    def _watch(self, run: str, orphan_timeout: float) -> None:
        """Ends this owner once its run's coordinator has been gone for ``orphan_timeout``
        seconds: not restarting (Ray restarts one that died), but ended with the process that
        made it, or killed for good. Owners outlive their coordinator so that one started
        again takes them over; they do not outlive the run."""
        ray = _ray()

        def present() -> bool | None:
            try:
                ray.get_actor(run, namespace=NAMESPACE)
            except ValueError:
                return False
            except Exception:  # Ray itself unreachable for now: its end ends this process
                return None
            return True

        await_orphaned(present, orphan_timeout)
        with contextlib.suppress(Exception):
            self.close()
        os._exit(0)

    def adoption(self) -> dict[str, Any]:
        """What a coordinator started again needs to take this owner over."""
        status = self._owner.status()
        positions = {**status["expected"], **status["positions"]}
        return {
            "positions": positions,
            "low": status["low"],
            "floor": status["floor"],
            "mix_history": self._owner.mix_history(),
        }

    def address(self) -> str:
        """Where its gRPC ``StreamRows`` listens ("" when it does not serve); an owner listening
        on every interface gives its node's address."""
        if self._server is None:
            return ""
        host, _, port = self._server.address.rpartition(":")
        if host in ("0.0.0.0", "[::]", "::"):
            host = _ray().util.get_node_ip_address()
        return f"{host}:{port}"

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The id of the Ray node it runs on."""
        return str(_ray().get_runtime_context().get_node_id())

    def rows(self, reader: int, step: int, lanes: list[int] | None, timeout: float) -> OwnerRows | None:
        return self._owner.rows(reader, step, lanes, timeout)

    def share(self, rank: int, world_size: int, step: int, timeout: float) -> Batch | None:
        """Rank ``rank`` of ``world_size``'s rows of step ``step`` on this owner's lanes."""
        return self._owner.share(self._rank_slice(rank, world_size), step, timeout)

    def _rank_slice(self, rank: int, world_size: int) -> RankSlice:
        spec = self._owner.spec
        return RankSlice(
            rank=rank, world_size=world_size, lanes=spec.lanes, global_batch_size=spec.global_batch_size
        )

    def shares(self, rank: int, world_size: int, step: int, count: int, timeout: float) -> list[Batch] | None:
        """Rank ``rank`` of ``world_size``'s rows of a run of up to ``count`` steps from ``step``
        (``LaneOwner.shares``): one call and one reply for several steps."""
        return self._owner.shares(self._rank_slice(rank, world_size), step, count, timeout)

    def live(self, step: int, timeout: float) -> bool | None:
        return self._owner.live(step, timeout)

    def snapshot(self, step: int) -> dict[int, LaneState] | None:
        return self._owner.snapshot(step)

    def packed_snapshot(self, step: int, held: Held | None = None) -> PackedSnapshot | None:
        """``snapshot(step)`` packed for the coordinator to keep (``cluster/snapshots.py``):
        the elements it held at the last gather are not pickled again, and those the
        coordinator holds (``held``) not sent again."""
        snaps = self._owner.snapshot(step)
        return None if snaps is None else self._packer.pack(step, snaps, held)

    def lanes_snapshot(self, step: int, lanes: list[int]) -> tuple[dict[int, LaneState], list[Any]] | None:
        """``snapshot(step)`` of ``lanes`` only, with the mixture history (a rank's own state)."""
        snaps = self._owner.snapshot(step)
        if snaps is None:
            return None
        return {lane: snaps[lane] for lane in lanes}, self._owner.mix_history()

    def write_part(self, step: int, manifest_path: str, index: int, base: str | None = None) -> Part | None:
        """Writes its lanes' snapshots at ``step`` as part ``index`` of the checkpoint whose
        manifest is ``manifest_path`` (None while it does not hold that step); with ``base``
        (an earlier manifest), only what changed since its part of the same index."""
        snaps = self._owner.snapshot(step)
        if snaps is None:
            return None
        spec = self._owner.spec
        state = LoaderState(step, spec.lanes, dict(spec.fingerprint), snaps, self._owner.mix_history())
        return manifest.write_part(
            state, manifest_path, index, lambda st, path, on: save_state(st, path, base=on), base=base
        )

    def write_snapshot(self, step: int, path: str) -> str | None:
        """Writes its lanes' snapshots at ``step`` to ``path`` (None while it does not hold
        that step): what its replacement would start from."""
        snaps = self._owner.snapshot(step)
        if snaps is None:
            return None
        spec = self._owner.spec
        state = LoaderState(step, spec.lanes, dict(spec.fingerprint), snaps, self._owner.mix_history())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_state(state, path)
        return path

    def status(self) -> dict[str, Any]:
        return self._owner.status()

    def hold_floor(self, step: int) -> None:
        self._owner.hold_floor(step)

    def hold_mixture(self, step: int) -> int | None:
        return self._owner.hold_mixture(step)

    def change_mixture(self, step: int, mix: Any) -> None:
        self._owner.change_mixture(step, mix)

    def release_mixture(self) -> None:
        self._owner.release_mixture()

    def failure(self) -> str | None:
        """Why its pipeline failed (None while it runs): the run cannot go on from here."""
        try:
            self._owner.check()  # raises the owner's error, if any
        except OwnerError as exc:
            return str(exc)
        return None

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._owner.close()


def await_orphaned(
    present: Callable[[], bool | None],
    orphan_timeout: float,
    clock: Clock = SYSTEM_CLOCK,
    every: float = WATCH_EVERY,
) -> None:
    """Returns once ``present()`` (asked every ``every`` seconds on ``clock``) has said False
    (the coordinator is not found) at every look for ``orphan_timeout`` seconds; None (it
    cannot tell: Ray unreachable for now) neither counts nor restarts the wait."""
    missing_since: float | None = None
    while True:
        clock.sleep(every)
        found = present()
        if found:
            missing_since = None
        elif found is not None:
            missing_since = clock.now() if missing_since is None else missing_since
            if clock.now() - missing_since >= orphan_timeout:
                return


def _ray() -> Any:
    return require_ray(FEATURE)


def _owner_call(handle: Any, method: str, args: tuple[Any, ...]) -> Any:
    """``handle.method(*args)`` on an owner actor, waited for (a minute at most)."""
    return _ray().get(getattr(handle, method).remote(*args), timeout=60)


def owner_launcher(
    spec: LoaderSpec, options: OwnerOptions, serving: Serving | None = None, *, run: str
) -> Any:
    """A ``Launch`` that starts an owner as a Ray actor (spread over the cluster's nodes) and
    waits until it has built its lanes, so a failure to start is raised here. With ``serving``
    the owner also serves its rows over gRPC on ``serving.host``, guarded as ``serving`` says.
    The owner is detached and named after the run ``run`` (``owner_actor_name``): it does not
    die with its coordinator, and ends itself once the coordinator is gone for good."""
    ray = _ray()
    actor = ray.remote(OwnerActor)

    def launch(
        index: int,
        name: str,
        lanes: list[int],
        state: LoaderState | None,
        readers: dict[int, int],
        generation: int,
    ) -> Any:
        handle = actor.options(
            name=owner_actor_name(run, index, generation),
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=options.owner_cpus,
            max_concurrency=OWNER_CONCURRENCY,
            # No record of each call in Ray's GCS (about 4 KB a call, kept up to Ray's cap of
            # 100,000): a run's steady calls (progress, floors, gathers) grew it ~3 MB a minute.
            enable_task_events=False,
            scheduling_strategy="SPREAD",
        ).remote(spec, lanes, state, readers, options, name, serving, run)
        try:
            ray.get(handle.pid.remote(), timeout=options.start_timeout)
        except ray.exceptions.GetTimeoutError:
            ray.kill(handle)
            raise OwnerError(
                f"{name} (lanes {lanes}) did not start within {options.start_timeout:g} s "
                f"(start_timeout): no node of the cluster has room for it (it asks for "
                f"num_cpus={options.owner_cpus:g}), or building its lanes took longer; add nodes, lower "
                f"owner_cpus, or raise start_timeout"
            ) from None
        return handle

    return launch


def snapshot_folder(run: str, folder: str) -> str:
    """Where the owners of the run named ``run`` write their snapshots under ``folder``."""
    return os.path.join(os.path.abspath(folder), run.replace("/", "_"))


def snapshot_store(run: str, folder: str) -> Store:
    """A ``Store``: owner ``index`` writes its snapshot of a step to
    ``folder/<run>/owner-<index>-step-<step>.zfstate``."""

    def store(handle: Any, step: int, index: int) -> str | None:
        path = os.path.join(snapshot_folder(run, folder), f"owner-{index}-step-{step}.zfstate")
        written: str | None = owner_answer(
            handle.write_snapshot.remote(step, path), 60, "writing its snapshot"
        )
        return written

    return store


_SNAPSHOT_FILE = re.compile(r"owner-(?P<index>\d+)-step-(?P<step>\d+)\.zfstate")


def stored_snapshots(run: str, folder: str | None) -> dict[int, list[tuple[int, str]]]:
    """Per owner index, the ``(step, path)`` of the snapshot files ``snapshot_store`` left for
    the run named ``run`` under ``folder`` (what a coordinator started again restarts an owner
    that died meanwhile from)."""
    found: dict[int, list[tuple[int, str]]] = {}
    if folder is None:
        return found
    where = snapshot_folder(run, folder)
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(where):
            match = _SNAPSHOT_FILE.fullmatch(name)
            if match is not None:
                found.setdefault(int(match["index"]), []).append(
                    (int(match["step"]), os.path.join(where, name))
                )
    return found


def owner_address(handle: Any) -> str:
    address: str = _ray().get(handle.address.remote(), timeout=60)
    return address


def gather_snapshot(handle: Any, step: int) -> Mapping[int, LaneState] | None:
    """An owner's lane snapshots at ``step`` (None while it does not hold that step); the
    owner's own failure is raised as itself (an ``OwnerError``), its death as Ray's error."""
    result: Mapping[int, LaneState] | None = owner_answer(handle.snapshot.remote(step), 60, "its snapshot")
    return result


def pack_snapshot(handle: Any, step: int, held: Held | None) -> PackedSnapshot | None:
    """An owner's lane snapshots at ``step``, packed, but for the items of ``held``
    (``OwnerActor.packed_snapshot``); errors as ``gather_snapshot``'s."""
    ref = handle.packed_snapshot.remote(step, held)
    result: PackedSnapshot | None = owner_answer(ref, 60, "its snapshot")
    return result


def owner_answer(ref: Any, timeout: float, what: str) -> Any:
    """An owner call's answer: the owner's own failure (an error of the project's) raised as
    itself, its death as Ray's error (the caller replaces it), anything else raised in it as
    an ``OwnerError`` naming ``what`` it was doing."""
    ray = _ray()
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ZephonError):
            raise cause from None
        if isinstance(exc, ray.exceptions.RayActorError):
            raise
        raise OwnerError(f"a lane owner failed {what}: {exc}") from exc


def owner_alive(handle: Any) -> bool:
    """Whether an owner answers a ping within ``ALIVE_WAIT`` seconds (one that does not is
    dead or stuck: either way it is replaced)."""
    try:
        _ray().get(handle.pid.remote(), timeout=ALIVE_WAIT)
    except Exception:
        return False
    return True


def tell_floor(handle: Any, step: int) -> None:
    """Tells an owner actor the run's slowest rank's step, without waiting for it (a dead
    owner's call fails unseen: its replacement is told when it starts)."""
    handle.hold_floor.remote(step)


def stop_owner(handle: Any) -> None:
    ray = _ray()
    with contextlib.suppress(Exception):  # already dead or stuck: killing it is all that is left
        ray.get(handle.close.remote(), timeout=10)
    ray.kill(handle)


class CoordinatorActor:
    """The body of the coordinator's Ray actor: a ``Coordinator`` with Ray owners. Ray starts
    it again if its process dies (``max_restarts``), with the same arguments: it then takes
    over the run's live owners (found by name) instead of starting new ones."""

    def __init__(
        self,
        spec: LoaderSpec,
        owners: int,
        world_size: int,
        state: LoaderState | None,
        options: OwnerOptions,
        serving: Serving | None = None,
        fingerprint: str | None = None,
        run: str = "zephon-owners",
    ) -> None:
        # The fingerprint as its creator computed it: a module shipped by value may fingerprint
        # otherwise in a Ray worker, and ranks compare with their own.
        self._owners, self._fingerprint = owners, fingerprint or spec.fingerprint["total"]
        restarted = bool(_ray().get_runtime_context().was_current_actor_reconstructed)
        found = _live_owners(run, owners)
        if not restarted:  # a new run under a name a dead run used: its owners are not ours,
            for handle in (h for got in found for h in got.values()):
                stop_owner(handle)
            if options.snapshot_dir is not None:  # nor its snapshot files (another timeline)
                shutil.rmtree(snapshot_folder(run, options.snapshot_dir), ignore_errors=True)
        self.restarts = int(restarted)
        self._coordinator = Coordinator(
            spec,
            owners=owners,
            world_size=world_size,
            state=state,
            launch=owner_launcher(spec, options, serving, run=run),
            gather=gather_snapshot,
            address_of=owner_address if serving is not None else None,
            alive=owner_alive,
            stop=stop_owner,
            snapshot_every=options.snapshot_every,
            max_replacements=options.max_replacements,
            allow_mix_change=options.allow_mix_change,
            allow_code_change=options.allow_code_change,
            adopt=_adoptions(found) if restarted else None,
            stored=stored_snapshots(run, options.snapshot_dir) if restarted else None,
            store=None if options.snapshot_dir is None else snapshot_store(run, options.snapshot_dir),
            pack=pack_snapshot,
            hold_floor=tell_floor,
        )
        self._snapshot_folder = (
            None if options.snapshot_dir is None else snapshot_folder(run, options.snapshot_dir)
        )

    def pid(self) -> int:
        return os.getpid()

    def join(self, rank: int, world_size: int, first_step: int) -> OwnerTable:
        return self._coordinator.join(rank, world_size, first_step)

    def node(self) -> str:
        """The id of the Ray node it runs on."""
        return str(_ray().get_runtime_context().get_node_id())

    def describe(self) -> dict[str, Any]:
        """What this run is: its pipeline's fingerprint, owner count, world size, first step."""
        coordinator = self._coordinator
        return {
            "fingerprint": self._fingerprint,
            "owners": self._owners,
            "world_size": coordinator.world_size,
            "first_step": coordinator.first_step,
        }

    def table(self) -> OwnerTable:
        return self._coordinator.table()

    def leave(self, rank: int) -> int:
        return self._coordinator.leave(rank)

    def failure(self) -> str | None:
        """The first owner's pipeline failure, if any (a dead owner is not one: it is replaced)."""
        ray = _ray()
        for handle in self._coordinator.table().handles:
            try:
                why: str | None = ray.get(handle.failure.remote(), timeout=ALIVE_WAIT)
            except Exception:
                continue
            if why is not None:
                return why
        return None

    def served_table(self) -> tuple[OwnerTable, list[str]]:
        """The table and each owner's gRPC address (``zephon serve --ray``)."""
        return self._coordinator.table(), self._coordinator.addresses()

    def replace_served(self, index: int, generation: int) -> tuple[OwnerTable, list[str]]:
        return self._coordinator.replace(index, generation), self._coordinator.addresses()

    def progress(self, rank: int, step: int) -> None:
        self._coordinator.progress(rank, step)

    def replace(self, index: int, generation: int) -> OwnerTable:
        return self._coordinator.replace(index, generation)

    def checkpoint(self, step: int) -> LoaderState:
        return self._coordinator.checkpoint(step)

    def positions(self) -> dict[int, int]:
        return self._coordinator.positions()

    def snapshot_files(self) -> dict[int, str]:
        return self._coordinator.snapshot_files()

    def write_checkpoint(self, step: int, path: str, base: str | None = None) -> str:
        """Has every owner write its lanes' part of the checkpoint at ``step`` next to ``path``
        (``<path>.parts/``; with ``base``, an earlier manifest, incrementally on its parts),
        then writes the manifest that names them at ``path``."""

        def ask(index: int, handle: Any) -> Part | None:
            ref = handle.write_part.remote(step, path, index, base)
            part: Part | None = owner_answer(ref, 120, f"writing its part of the checkpoint at step {step}")
            return part

        parts = self._coordinator.from_owners(step, ask)
        spec = self._coordinator.spec
        manifest.write_manifest(path, step=step, lanes=spec.lanes, fingerprint=self._fingerprint, parts=parts)
        return path

    def change_mixture(
        self, step: int, points: list[tuple[int, list[float]]], interpolation: str
    ) -> list[tuple[int, dict[str, Any]]]:
        """New mixture weights on every owner from ``step`` on (``Coordinator.change_mixture``)."""
        return self._coordinator.change_mixture(step, points, interpolation=interpolation, call=_owner_call)

    def shutdown(self) -> None:
        self._coordinator.shutdown()
        if self._snapshot_folder is not None:  # snapshots a late write left: the run is over
            shutil.rmtree(self._snapshot_folder, ignore_errors=True)


def _live_owners(run: str, owners: int) -> list[dict[int, Any]]:
    """Per owner index, the live owner actors of the run named ``run`` by generation."""
    ray = _ray()
    found: list[dict[int, Any]] = [{} for _ in range(owners)]
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != NAMESPACE:
            continue
        match = _OWNER_NAME.match(entry.get("name", ""))
        if match is None or match["run"] != run or not int(match["index"]) < owners:
            continue
        with contextlib.suppress(ValueError):  # ended since it was listed
            handle = ray.get_actor(entry["name"], namespace=NAMESPACE)
            found[int(match["index"])][int(match["generation"])] = handle
    return found


def _adoptions(found: list[dict[int, Any]]) -> list[Adopted | None]:
    """Per owner index, its newest live generation that answers (older ones are stopped: a
    replacement was made), as a coordinator started again takes it over."""
    ray, out = _ray(), []
    adopted: Adopted | None
    for generations in found:
        adopted = None
        for generation in sorted(generations, reverse=True):
            handle = generations[generation]
            if adopted is None:
                try:
                    info = ray.get(handle.adoption.remote(), timeout=ALIVE_WAIT)
                except Exception:
                    stop_owner(handle)
                    continue
                adopted = Adopted(
                    handle, generation, info["positions"], info["low"], info["mix_history"], info["floor"]
                )
            else:
                stop_owner(handle)
        out.append(adopted)
    return out


def ship_user_code(spec: LoaderSpec) -> None:
    """Has Ray pickle the module defining ``spec``'s pipeline by value (with its functions and
    DoFns), unless it is installed: a pipeline file (``examples/pipeline.py``), a script or a
    test helper cannot be imported by Ray's worker processes, which start elsewhere."""
    name = getattr(spec.build, "__module__", None) or ""
    module = sys.modules.get(name)
    if module is None or name == "__main__" or name.split(".")[0] == "zephon_flow":
        return
    where = Path(getattr(module, "__file__", None) or "").parts
    if "site-packages" in where or "dist-packages" in where:
        return
    _ray().cloudpickle.register_pickle_by_value(module)


def coordinator_handle(
    name: str,
    spec: LoaderSpec,
    *,
    owners: int,
    world_size: int,
    state: LoaderState | None,
    options: OwnerOptions,
    serving: Serving | None = None,
) -> Any:
    """The coordinator actor named ``name``: the running one, or a new one with these options
    (every rank calls this; the first creates it). A running one of another pipeline (another
    fingerprint: data, code, seed, lanes or batch size) or another owner count is refused by
    name: its batches are not this rank's."""
    ray = _ray()
    ship_user_code(spec)
    actor = ray.remote(CoordinatorActor)
    # On this process's node, not on an owner's: losing an owner's node then costs that owner,
    # which is replaced, never the coordinator with it. (Not soft: Ray's soft affinity moves an
    # actor off a node whose CPUs are all taken, even one that asks for none.)
    here = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
        node_id=ray.get_runtime_context().get_node_id(), soft=False
    )
    # Started again by Ray if its process dies (it then takes over the live owners), and its
    # calls retried meanwhile (each is safe to repeat: a replacement names the generation).
    handle = actor.options(
        name=name,
        namespace=NAMESPACE,
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=OWNER_CONCURRENCY,
        enable_task_events=False,  # as the owners' (owner_launcher): no GCS record per call
        max_restarts=-1,
        max_task_retries=-1,
        scheduling_strategy=here,
    ).remote(
        spec,
        owners,
        world_size,
        state,
        options,
        serving,
        spec.fingerprint["total"],
        name,
    )
    _check_run(handle, name, spec, owners)
    return handle


def _check_run(handle: Any, name: str, spec: LoaderSpec, owners: int) -> None:
    """Refuses to join the run ``handle`` (named ``name``) when it runs another pipeline or
    another owner count than this rank asks for."""
    ray = _ray()
    try:
        run = ray.get(handle.describe.remote(), timeout=600)
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError):
        return  # it failed to start: the caller's first call says why
    mine = spec.fingerprint["total"]
    if run["fingerprint"] != mine or run["owners"] != owners:
        raise SpecError(
            f"lane owners: the run named {name!r} runs pipeline fingerprint {run['fingerprint']} on "
            f"{run['owners']} owners, but this rank asks for fingerprint {mine} on {owners} owners: "
            f"every rank of a run passes the same spec (data, seed, lanes, batch size) and "
            f"lane_owners; give another run another name="
        )
