"""PyTorch face: an ``IterableDataset`` over a ``Loader`` or a service ``Client``, with checkpointable state.

``import zephon_flow`` never imports this module (nor torch); torch users import it themselves::

    from zephon_flow.torch import ZephonDataset, gather_states, to_hf_inputs
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

from zephon_flow._torch_state import FRESH, LaneBytes, Snapshot, lane_parts
from zephon_flow.core.checkpoint.merge import merge_states
from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.checkpoint.store import encode_state, to_loader_state
from zephon_flow.core.errors import CorruptStateError, SpecError, StateConflictError, StateError
from zephon_flow.core.lanes import RankRows
from zephon_flow.core.options import check_int
from zephon_flow.engine.loader import Loader
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.runners.backends.base import BACKENDS

TorchBatch = dict[str, torch.Tensor]
Group = Any  # a torch.distributed ProcessGroup (or None: the default group)

__all__ = [
    "FRESH",
    "LaneBytes",
    "StepBatch",
    "StepMismatchWarning",
    "ZephonDataset",
    "gather_states",
    "to_hf_inputs",
]


class StepBatch(NamedTuple):
    """What ``ZephonDataset`` yields: ``(step, batch)``, this rank's rows of global batch ``step``."""

    step: int
    batch: TorchBatch


Item = StepBatch


class StepMismatchWarning(UserWarning):
    """A loader state loaded at another step than the trainer's own count says it resumes at."""


def _refuse_collate(batch: list[StepBatch], *, collate_fn_map: Any = None) -> Any:
    raise SpecError(
        f"ZephonDataset yields whole batches (this rank's rows of one global batch per step), but "
        f"the DataLoader collated {len(batch)} of them (steps {batch[0].step}..{batch[-1].step}) "
        f"into one: use DataLoader(dataset, batch_size=None, num_workers=0); set the batch size "
        f"with zf.LoaderSpec(global_batch_size=...)"
    )


# DataLoader(batch_size=N) collates N items with default_collate, which looks their type up here
# (torch's documented extension point); batch_size=None never collates.
default_collate_fn_map[StepBatch] = _refuse_collate


class ClientLike(Protocol):
    """What the dataset needs of ``zf.Client``: iteration by step, ``checkpoint``, ``close``."""

    def __iter__(self) -> Iterator[tuple[int, Any]]: ...

    def checkpoint(self, step: int) -> str: ...

    def close(self) -> None: ...


ClientFactory = Callable[..., ClientLike]
Connect = Callable[[int, int, int], ClientLike]  # (rank, world_size, start_step)


def _to_tensors(batch: dict[str, Any]) -> TorchBatch:
    # The loader's arrays are freshly stacked and writable, so from_numpy shares their memory.
    return {
        k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v)) for k, v in batch.items()
    }


def _need(state: Any, key: str) -> Any:
    if not isinstance(state, Mapping) or key not in state:
        raise CorruptStateError(
            f"ZephonDataset state is missing {key!r}: pass what ZephonDataset.state_dict() returned"
        )
    return state[key]


class ZephonDataset(IterableDataset[Item]):
    """Yields ``(step, batch)``: this rank's rows of global batch ``step`` as CPU tensors.

    Build it with ``from_loader`` (embedded: runs this rank's lanes in the trainer) or
    ``from_client`` (served: a ``zephon serve`` process does the work). Use it with
    ``DataLoader(ds, batch_size=None, num_workers=0)``: batches are already global-batch
    slices, and the loader parallelises itself (``backend``/``workers``); DataLoader worker
    processes would each replay the same stream, so they are refused.

    Rank and world size are resolved at the first iteration (explicit ``rank``/``world_size``
    win; else ``group``'s, else torch.distributed's default group's, else 0 of 1), so a dataset
    built before ``init_process_group`` reads its own rows.

    ``state_dict(step)`` is cheap (references to snapshots the loader takes anyway; encoded
    only when pickled) and needs no collective: call it every batch. It holds one entry per
    lane this rank runs, so ``torch.distributed.checkpoint`` (which keeps one copy per key)
    stores every rank's lanes, and a fresh dataset asks for every lane when it loads one.
    """

    def __init__(
        self,
        *,
        spec: LoaderSpec | None = None,
        loader_options: dict[str, Any] | None = None,
        connect: Connect | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        group: Group = None,
        keep_states: int = 8,
    ) -> None:
        if (spec is None) == (connect is None):
            raise SpecError("ZephonDataset: give exactly one of spec (embedded) or connect (served)")
        check_int(keep_states, "keep_states", owner="ZephonDataset")
        self._spec = spec
        self._loader_options = dict(loader_options or {})
        self._connect = connect
        self._explicit = (rank, world_size)
        self._group = group
        self._topology: tuple[int, int] | None = None  # frozen at the first iteration
        if rank is not None and world_size is not None:
            self._check_topology(rank, world_size)
        self._next_step = 0
        # Embedded: the states from which the next steps resume, oldest first (None: fresh).
        self._kept: deque[Snapshot] = deque(maxlen=keep_states)
        self._source: Loader | ClientLike | None = None

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_loader(
        cls,
        spec: LoaderSpec,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        group: Group = None,
        backend: str = "inline",
        workers: int = 1,
        keep_states: int = 8,
        **loader_options: Any,
    ) -> ZephonDataset:
        """Embedded: a ``zf.Loader(spec, rank=..., world_size=..., backend=..., workers=...)``.

        ``rank`` and ``world_size`` default to ``group``'s (the data-parallel group, e.g. a
        device mesh's) or torch.distributed's, resolved at the first iteration, else 0 and 1.
        ``keep_states``: how many of the last steps ``state_dict(step)`` can still give.
        ``loader_options`` go to the ``Loader``; with ``balance=`` (``"tokens"``,
        ``"attention"``, ``"images"`` or a function of a row) each batch holds the rows that
        even out that cost across ranks and a ``rows`` tensor, their global indices; every
        rank then runs every lane, and ``state_dict`` holds every lane.
        """
        if not isinstance(spec, LoaderSpec):
            raise SpecError(
                f"ZephonDataset.from_loader: spec must be a zf.LoaderSpec, got {type(spec).__name__}"
            )
        if backend not in BACKENDS:
            raise SpecError(
                f"ZephonDataset.from_loader: backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
            )
        check_int(workers, "workers", owner="ZephonDataset.from_loader")
        options = {"backend": backend, "workers": workers, **loader_options}
        if "state" in options:
            raise SpecError("ZephonDataset.from_loader: pass a state with load_state_dict, not state=")
        return cls(
            spec=spec,
            loader_options=options,
            rank=rank,
            world_size=world_size,
            group=group,
            keep_states=keep_states,
        )

    @classmethod
    def from_client(
        cls,
        address: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        group: Group = None,
        client_factory: ClientFactory | None = None,
        keep_states: int = 8,
        **client_options: Any,
    ) -> ZephonDataset:
        """Served: a ``zf.Client(address, rank, world_size, start_step, as_torch=True, ...)``.

        ``client_options`` (``fingerprint``, ``token``, ``root_certificates``) go to the client;
        ``client_factory`` replaces ``zf.Client`` (tests use a fake with the same interface).
        """
        if "start_step" in client_options:
            raise SpecError(
                "ZephonDataset.from_client: pass a start step with load_state_dict, not start_step="
            )
        factory: ClientFactory = client_factory if client_factory is not None else _zf_client()

        def connect(rank: int, world_size: int, start_step: int) -> ClientLike:
            return factory(address, rank, world_size, start_step, as_torch=True, **client_options)

        return cls(connect=connect, rank=rank, world_size=world_size, group=group, keep_states=keep_states)

    @property
    def spec(self) -> LoaderSpec | None:
        """The pipeline an embedded dataset runs (None over a service ``Client``)."""
        return self._spec

    @property
    def served(self) -> bool:
        """True for a dataset over a service ``Client``, False for an embedded ``Loader``."""
        return self._connect is not None

    @property
    def next_step(self) -> int:
        """The step of the next batch this dataset will yield."""
        return self._next_step

    # -- topology -----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This dataset's rank: fixed at the first iteration (before it, what it would be now)."""
        return (self._topology or self._current_topology())[0]

    @property
    def world_size(self) -> int:
        """The number of ranks sharing each global batch (see ``rank``)."""
        return (self._topology or self._current_topology())[1]

    @property
    def group(self) -> Group:
        """The process group given at construction (None: torch.distributed's default group)."""
        return self._group

    def _current_topology(self) -> tuple[int, int]:
        rank, world = self._explicit
        if rank is not None and world is not None:
            return rank, world
        if _distributed():
            if rank is None:
                rank = dist.get_rank(self._group)
            if world is None:
                world = dist.get_world_size(self._group)
        elif self._group is not None:
            raise SpecError(
                "ZephonDataset: built with group=, but torch.distributed is not initialised; "
                "initialise it before iterating, or pass rank= and world_size="
            )
        return (0 if rank is None else rank), (1 if world is None else world)

    def _check_topology(self, rank: int, world_size: int) -> RankRows | None:
        if self._spec is None:
            if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
                raise SpecError(f"ZephonDataset.from_client: rank must be in [0, {world_size}), got {rank}")
            return None
        return RankRows(  # a schedule's sizes are checked by the Loader, from its first step
            rank=rank,
            world_size=world_size,
            lanes=self._spec.lanes,
            schedule=self._spec.batch_schedule,
        )

    def _resolve(self) -> tuple[int, int]:
        """The topology, fixed at the first iteration; a later one refuses a changed one."""
        now = self._current_topology()
        if self._topology is None:
            self._check_topology(*now)
            self._topology = now
        elif now != self._topology:
            rank, world = self._topology
            raise StateError(
                f"ZephonDataset: its first iteration ran as rank {rank} of {world}, but "
                f"torch.distributed now says rank {now[0]} of {now[1]}: build or first iterate the "
                f"dataset after init_process_group, or pass rank= and world_size="
            )
        return self._topology

    def _lanes_of(self, topology: tuple[int, int]) -> list[int]:
        slice_ = self._check_topology(*topology)
        assert slice_ is not None
        if self._loader_options.get("balance") is not None:  # a balanced rank runs every lane
            return list(range(slice_.lanes))
        return list(slice_.lane_ids)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Item]:
        if get_worker_info() is not None:
            raise SpecError(
                "ZephonDataset: use DataLoader(..., num_workers=0); each DataLoader worker would run "
                "the whole stream again. Parallelise with from_loader(backend='processes', workers=N) "
                "or serve the pipeline with `zephon serve`"
            )
        self.close()  # a new iteration continues from the last batch yielded
        topology = self._resolve()
        source = self._open(topology)
        self._source = source
        loader = source if isinstance(source, Loader) else None
        if loader is not None and (not self._kept or self._kept[-1].step != self._next_step):
            self._kept.append(Snapshot(loader.snapshot(), loader.saved_form))
        for step, batch in source:
            if step != self._next_step:
                raise StateError(
                    f"ZephonDataset: expected step {self._next_step}, the source gave step {step}"
                )
            self._next_step = step + 1
            if loader is not None:  # a reference to the snapshot the loader took anyway
                self._kept.append(Snapshot(loader.snapshot(), loader.saved_form))
            yield StepBatch(step, _to_tensors(batch))

    def _open(self, topology: tuple[int, int]) -> Loader | ClientLike:
        rank, world = topology
        if self._connect is not None:
            return self._connect(rank, world, self._next_step)
        assert self._spec is not None
        resume = self._kept[-1] if self._kept else None
        if resume is not None:
            self._check_lanes(resume.state, self._lanes_of(topology), topology)
        return Loader(
            self._spec,
            rank=rank,
            world_size=world,
            state=None if resume is None else resume.saved(),
            keep_states=self._kept.maxlen or 1,
            **self._loader_options,
        )

    def close(self) -> None:
        """Stops the loader or client; the dataset keeps its position and can iterate again."""
        source, self._source = self._source, None
        if source is not None:
            source.close()

    # -- state --------------------------------------------------------------------------------
    def _snapshot(self, step: int | None, who: str) -> Snapshot | None:
        """The kept state from which ``step`` (default: the next step) is next; None: fresh."""
        target = self._next_step if step is None else step
        if not self._kept:
            if target == 0:
                return None
            raise StateError(f"{who}: nothing was yielded or loaded, so only step 0 can be asked for")
        first, last = self._kept[0].step, self._kept[-1].step
        if not first <= target <= last:
            raise StateError(
                f"{who}(step={target}): the dataset keeps the states from which steps {first}..{last} "
                f"are next (keep_states={self._kept.maxlen}); save within that range or raise "
                f"keep_states"
            )
        return self._kept[target - first]

    def _check_served_step(self, step: int | None, who: str) -> int:
        target = self._next_step if step is None else step
        first = max(0, self._next_step - (self._kept.maxlen or 1) + 1)
        if not first <= target <= self._next_step:
            raise StateError(
                f"{who}(step={target}): the dataset can give steps {first}..{self._next_step} "
                f"(keep_states={self._kept.maxlen})"
            )
        return target

    def local_state(self, step: int | None = None) -> bytes:
        """This rank's loader state as checkpoint bytes (``b""`` for a fresh start at step 0),
        positioned so that ``step`` (default: the next step) is next.

        Not collective. Resumes this rank of this topology only; ``gather_states`` makes one
        that resumes any topology.
        """
        if self.served:
            raise StateError(
                "ZephonDataset over a service Client has no loader state: the server holds it "
                "(see checkpoint_on_server)"
            )
        snap = self._snapshot(step, "ZephonDataset.local_state")
        return FRESH if snap is None else snap.encoded()

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """``{"step", "lane_states": {lane: LaneBytes}}`` (embedded) or ``{"step"}`` (served).

        ``step`` is the step the resumed run yields first (the state after batch ``step - 1``;
        default: after the last batch yielded); one of the last ``keep_states`` steps. Cheap
        and not collective: the values reference snapshots and are encoded to checkpoint bytes
        only when pickled (``torch.save``, DCP) or asked (``bytes(value)``).

        One key per lane this rank runs, so DCP (one copy per key of a non-tensor value)
        stores every rank's lanes; before its first iteration a dataset gives every lane's key
        (empty where it has no state), so loading a DCP checkpoint reads every lane.
        """
        who = "ZephonDataset.state_dict"
        if self.served:
            return {"step": self._check_served_step(step, who)}
        snap = self._snapshot(step, who)
        target = 0 if snap is None else snap.step
        assert self._spec is not None
        # Not started: every lane (a template DCP loads every rank's lanes into).
        lanes = (
            self._lanes_of(self._topology) if self._topology is not None else list(range(self._spec.lanes))
        )
        return {"step": target, "lane_states": lane_parts(snap, lanes)}

    def load_state_dict(self, state_dict: Mapping[str, Any], *, expected_step: int | None = None) -> None:
        """Positions the dataset at a saved state; the next iteration resumes there.

        ``expected_step``: the step the trainer resumes at by its own count; a state at another
        step is loaded as it is, with a ``StepMismatchWarning`` naming both (integrations pass it).
        Takes what ``state_dict`` gave (``lane_states``) or ``{"step", "loader_state": bytes}``
        (``gather_states``).
        """
        step = _step_of(_need(state_dict, "step"))
        if expected_step is not None and expected_step != step:
            warnings.warn(
                f"zephon_flow: the loader state is at step {step} but the trainer resumes at step "
                f"{expected_step}: the data continues at step {step}, so "
                + (
                    f"steps {expected_step}..{step - 1} are never trained on"
                    if step > expected_step
                    else f"steps {step}..{expected_step - 1} are trained on again"
                )
                + "; save the data state with state_dict(step=<the step the trainer resumes at>) "
                "(frameworks read batches ahead of the one they train on)",
                StepMismatchWarning,
                stacklevel=2,
            )
        if self.served:
            self.close()
            self._next_step = step
            return
        loaded = self._loaded_state(state_dict, step)
        if loaded is not None and self._topology_known():
            topology = self._topology or self._current_topology()
            self._check_lanes(loaded, self._lanes_of(topology), topology)
        self.close()
        self._kept.clear()
        if loaded is not None:
            self._kept.append(Snapshot(loaded, None))
        self._next_step = step

    def _topology_known(self) -> bool:
        return self._topology is not None or None not in self._explicit or _distributed()

    def _loaded_state(self, state_dict: Mapping[str, Any], step: int) -> LoaderState | None:
        assert self._spec is not None
        if "lane_states" in state_dict:
            lanes = state_dict["lane_states"]
            if not isinstance(lanes, Mapping):
                raise CorruptStateError(
                    f"ZephonDataset state's 'lane_states' should be a mapping, found {type(lanes).__name__}"
                )
            parts: list[Any] = []
            for key, value in lanes.items():
                part = _lane_value(value, f"'lane_states'[{key!r}]")
                if part != FRESH:
                    parts.append(part)
        else:
            parts = [_lane_value(_need(state_dict, "loader_state"), "'loader_state'")]
            parts = [p for p in parts if p != FRESH]
        if not parts:
            if step != 0:
                raise CorruptStateError(f"ZephonDataset state is at step {step} but holds no loader state")
            return None
        loaded = to_loader_state(parts[0] if len(parts) == 1 else merge_states(parts))
        loaded.check_compatible(lanes=self._spec.lanes, fingerprint=self._spec.fingerprint)
        if loaded.step != step:
            raise CorruptStateError(
                f"ZephonDataset state says step {step}, its loader state step {loaded.step}"
            )
        return loaded

    def _check_lanes(self, loaded: LoaderState, lanes: list[int], topology: tuple[int, int]) -> None:
        missing = [lane for lane in lanes if lane not in loaded.lane_states]
        if missing:
            raise StateError(
                f"ZephonDataset: the state has no entry for lane(s) {missing}, which rank "
                f"{topology[0]} of {topology[1]} runs; save state_dict() on every rank into one "
                f"torch.distributed.checkpoint, or merge every rank's state with gather_states"
            )

    def checkpoint_on_server(self, step: int | None = None) -> str:
        """Served: asks the server to write its state from which ``step`` (default: the next
        step) is the next batch; returns the path to restart the server from (``--resume``)."""
        if self._connect is None:
            raise StateError("ZephonDataset.checkpoint_on_server needs a dataset built with from_client")
        target = self._next_step if step is None else step
        if self._source is not None and not isinstance(self._source, Loader):
            return self._source.checkpoint(target)
        client = self._connect(*(self._topology or self._current_topology()), self._next_step)
        try:
            return client.checkpoint(target)
        finally:
            client.close()


def _step_of(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer | torch.Tensor):
        raise CorruptStateError(f"ZephonDataset state's 'step' should be an integer, found {value!r}")
    step = int(value)
    if step < 0:
        raise CorruptStateError(f"ZephonDataset state's 'step' is {step}, it cannot be negative")
    return step


def _lane_value(value: Any, where: str) -> LoaderState | bytes:
    """A ``lane_states`` or ``loader_state`` value: a ``LaneBytes`` (not yet pickled: its
    state, no encoding) or checkpoint bytes (``b""``: nothing)."""
    if isinstance(value, LaneBytes):
        return value.state()
    if not isinstance(value, bytes | bytearray | memoryview):
        raise CorruptStateError(
            f"ZephonDataset state's {where} should be bytes, found {type(value).__name__}"
        )
    return bytes(value)


def gather_states(dataset: ZephonDataset, step: int | None = None, group: Group = None) -> bytes:
    """Every rank's loader state at ``step`` merged (``zf.merge_states``) into checkpoint bytes.

    Collective over ``group`` (default: the dataset's group, else torch.distributed's default
    group) when torch.distributed is initialised: every rank of it must call it, and each gets
    the same bytes, which any world size can load (``load_state_dict({"step": s,
    "loader_state": b})``). Ranks holding the same lanes (tensor-parallel replicas of one
    data-parallel rank) agree and merge into one. Without torch.distributed (or on a group of
    one), returns ``dataset.local_state(step)``.
    """
    local = dataset.local_state(step)
    group = dataset.group if group is None else group
    if not _distributed() or dist.get_world_size(group) == 1:
        return local
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    fresh = [i for i, p in enumerate(parts) if p == FRESH]
    if len(fresh) == len(parts):
        return FRESH
    if fresh:
        raise StateConflictError(
            f"gather_states: rank(s) {fresh} of the group have not yielded a batch yet while "
            f"others have; save states when every rank is at the same step"
        )
    merged = to_loader_state(merge_states(parts))
    missing = [lane for lane in range(merged.lanes) if lane not in merged.lane_states]
    if missing:
        raise StateError(
            f"gather_states: the {len(parts)} rank(s) of the group hold no state for lane(s) "
            f"{missing}; gather over the data-parallel group (every rank reading distinct rows), "
            f"as the dataset's rank and world size count it"
        )
    return encode_state(merged)


def to_hf_inputs(
    batch: Mapping[str, torch.Tensor], *, keep: Iterable[str] = (), labels: bool = True
) -> TorchBatch:
    """A batch as a ``transformers`` causal LM takes it: int64 ``input_ids``, ``labels`` and
    ``position_ids`` (or ``attention_mask`` when the batch has no positions).

    ``labels`` is the batch's own ``labels`` when it has them (``Pack`` can give them), else
    ``input_ids`` with ``-100`` (ignored) wherever ``position_ids`` is 0: the first token of
    each document in a packed row (nothing before it in that document predicts it, as
    ``DataCollatorWithFlattening`` does) and the padding at a row's end. Rows of a finite
    pass's padding (``valid`` false) are all ``-100``. ``labels=False`` leaves them out.
    Fields in ``keep`` (e.g. ``"documents"``, ``"segment_ids"``) are passed on as they are;
    the others (provenance, ``segment_ids``, ``valid``) are dropped.
    """
    if "input_ids" not in batch:
        raise SpecError(f"to_hf_inputs: the batch has no 'input_ids' (it has {', '.join(sorted(batch))})")
    ids = batch["input_ids"].long()
    out: TorchBatch = {"input_ids": ids}
    positions = batch.get("position_ids")
    if positions is not None:
        out["position_ids"] = positions.long()
    else:
        segments = batch.get("segment_ids")
        out["attention_mask"] = torch.ones_like(ids) if segments is None else (segments >= 0).long()
    if labels:
        if "labels" in batch:
            target = batch["labels"].long().clone()
        else:
            target = ids.clone()
            if positions is not None:
                target[positions == 0] = -100
        if "valid" in batch:
            target[~batch["valid"].bool()] = -100
        out["labels"] = target
    for name in keep:
        if name not in batch:
            raise SpecError(f"to_hf_inputs: keep names {name!r}, which the batch does not have")
        out[name] = batch[name]
    return out


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _zf_client() -> ClientFactory:
    import zephon_flow

    client = getattr(zephon_flow, "Client", None)
    if client is None:
        raise SpecError("ZephonDataset.from_client: this zephon-flow has no zf.Client (the gRPC service)")
    factory: ClientFactory = client
    return factory
