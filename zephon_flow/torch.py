"""PyTorch face: an ``IterableDataset`` over a ``Loader`` or a service ``Client``, with checkpointable state.

``import zephon_flow`` never imports this module (nor torch); torch users import it themselves::

    from zephon_flow.torch import ZephonDataset, gather_states
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

from zephon_flow.core.errors import CorruptStateError, SpecError, StateConflictError, StateError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.core.state import encode_state, merge_states, to_loader_state
from zephon_flow.engine.loader import Loader
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.runners.backends.base import BACKENDS

TorchBatch = dict[str, torch.Tensor]


class StepBatch(NamedTuple):
    """What ``ZephonDataset`` yields: ``(step, batch)``, this rank's rows of global batch ``step``."""

    step: int
    batch: TorchBatch


Item = StepBatch


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

# A fresh start (nothing yielded, nothing loaded) has no lane states to save: b"" says so.
FRESH = b""


class ClientLike(Protocol):
    """What the dataset needs of ``zf.Client``: iteration by step, ``checkpoint``, ``close``."""

    def __iter__(self) -> Iterator[tuple[int, Any]]: ...

    def checkpoint(self, step: int) -> str: ...

    def close(self) -> None: ...


ClientFactory = Callable[..., ClientLike]


def _to_tensors(batch: dict[str, Any]) -> TorchBatch:
    # The loader's arrays are freshly stacked and writable, so from_numpy shares their memory.
    return {
        k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v)) for k, v in batch.items()
    }


def _need(state: Any, key: str) -> Any:
    if not isinstance(state, dict) or key not in state:
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

    ``state_dict()`` is positioned after the last batch yielded (``load_state_dict`` before
    iterating resumes there) and is a valid ``torch.distributed.checkpoint`` entry; see
    ``state_dict`` for why it gathers every rank's state.
    """

    def __init__(
        self,
        *,
        spec: LoaderSpec | None = None,
        loader_options: dict[str, Any] | None = None,
        client_factory: Callable[[int], ClientLike] | None = None,
        rank: int,
        world_size: int,
    ) -> None:
        if (spec is None) == (client_factory is None):
            raise SpecError("ZephonDataset: give exactly one of spec (embedded) or client_factory (served)")
        self.rank = rank
        self.world_size = world_size
        self._spec = spec
        self._loader_options = dict(loader_options or {})
        self._client_factory = client_factory
        self._next_step = 0
        # Embedded mode: the state to start the next Loader from (FRESH or checkpoint bytes).
        self._resume: bytes = FRESH
        self._source: Loader | ClientLike | None = None
        self._opened_at = 0
        if spec is not None:
            self._slice: RankSlice | None = RankSlice(
                rank=rank, world_size=world_size, lanes=spec.lanes, global_batch_size=spec.global_batch_size
            )
        else:
            self._slice = None

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_loader(
        cls,
        spec: LoaderSpec,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        backend: str = "inline",
        workers: int = 1,
        **loader_options: Any,
    ) -> ZephonDataset:
        """Embedded: a ``zf.Loader(spec, rank=..., world_size=..., backend=..., workers=...)``.

        ``rank`` and ``world_size`` default to torch.distributed's when it is initialised, else 0 and 1.
        """
        if not isinstance(spec, LoaderSpec):
            raise SpecError(
                f"ZephonDataset.from_loader: spec must be a zf.LoaderSpec, got {type(spec).__name__}"
            )
        rank, world_size = _topology(rank, world_size)
        if backend not in BACKENDS:
            raise SpecError(
                f"ZephonDataset.from_loader: backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
            )
        if not isinstance(workers, int) or workers < 1:
            raise SpecError(f"ZephonDataset.from_loader: workers must be a positive integer, got {workers!r}")
        options = {"backend": backend, "workers": workers, **loader_options}
        if "state" in options:
            raise SpecError("ZephonDataset.from_loader: pass a state with load_state_dict, not state=")
        return cls(spec=spec, loader_options=options, rank=rank, world_size=world_size)

    @classmethod
    def from_client(
        cls,
        address: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        client_factory: ClientFactory | None = None,
        **client_options: Any,
    ) -> ZephonDataset:
        """Served: a ``zf.Client(address, rank, world_size, start_step, as_torch=True, ...)``.

        ``client_options`` (``fingerprint``, ``token``, ``root_certificates``) go to the client;
        ``client_factory`` replaces ``zf.Client`` (tests use a fake with the same interface).
        """
        rank, world_size = _topology(rank, world_size)
        if not 0 <= rank < world_size:
            raise SpecError(f"ZephonDataset.from_client: rank must be in [0, {world_size}), got {rank}")
        if "start_step" in client_options:
            raise SpecError(
                "ZephonDataset.from_client: pass a start step with load_state_dict, not start_step="
            )
        factory: ClientFactory = client_factory if client_factory is not None else _zf_client()

        def connect(start_step: int) -> ClientLike:
            return factory(address, rank, world_size, start_step, as_torch=True, **client_options)

        return cls(client_factory=connect, rank=rank, world_size=world_size)

    @property
    def served(self) -> bool:
        """True for a dataset over a service ``Client``, False for an embedded ``Loader``."""
        return self._client_factory is not None

    @property
    def next_step(self) -> int:
        """The step of the next batch this dataset will yield."""
        return self._next_step

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Item]:
        if get_worker_info() is not None:
            raise SpecError(
                "ZephonDataset: use DataLoader(..., num_workers=0); each DataLoader worker would run "
                "the whole stream again. Parallelise with from_loader(backend='processes', workers=N) "
                "or serve the pipeline with `zephon serve`"
            )
        self.close()  # a new iteration continues from the last batch yielded
        source = self._open()
        self._source, self._opened_at = source, self._next_step
        for step, batch in source:
            if step != self._next_step:
                raise StateError(
                    f"ZephonDataset: expected step {self._next_step}, the source gave step {step}"
                )
            self._next_step = step + 1
            yield StepBatch(step, _to_tensors(batch))

    def _open(self) -> Loader | ClientLike:
        if self._client_factory is not None:
            return self._client_factory(self._next_step)
        assert self._spec is not None
        state = None if self._resume == FRESH else self._resume
        return Loader(
            self._spec, rank=self.rank, world_size=self.world_size, state=state, **self._loader_options
        )

    def close(self) -> None:
        """Stops the loader or client; the dataset keeps its position and can iterate again."""
        source, self._source = self._source, None
        if source is None:
            return
        if isinstance(source, Loader):
            self._resume = self._loader_bytes(source)
        source.close()

    def _loader_bytes(self, loader: Loader) -> bytes:
        if self._next_step == self._opened_at:  # nothing yielded since the loader was opened
            return self._resume
        return encode_state(loader.state_dict())

    # -- state --------------------------------------------------------------------------------
    def local_state(self) -> bytes:
        """This rank's loader state as checkpoint bytes (``b""`` before anything was yielded).

        Not collective. Resumes this rank of this topology only; ``gather_states`` makes one
        that resumes any topology.
        """
        if self.served:
            raise StateError(
                "ZephonDataset over a service Client has no loader state: the server holds it "
                "(see checkpoint_on_server)"
            )
        if isinstance(self._source, Loader):
            return self._loader_bytes(self._source)
        return self._resume

    def state_dict(self) -> dict[str, Any]:
        """``{"step": next step, "loader_state": bytes}`` (embedded) or ``{"step": next step}``.

        Embedded, with torch.distributed initialised, this is collective: every rank must call
        it (``torch.distributed.checkpoint.save`` does), and every rank gets the merged state of
        all ranks. That is what makes it safe in a DCP state dict, which keeps only one copy of
        a non-tensor value per key, and what lets it resume under another world size. The
        state is ``bytes`` (DCP stores non-tensor values as objects and loads them whole): a
        uint8 tensor would need its size known before loading.
        """
        if self.served:
            return {"step": self._next_step}
        return {"step": self._next_step, "loader_state": gather_states(self)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Positions the dataset at a saved state; the next iteration resumes there."""
        step = int(_need(state_dict, "step"))
        if self.served:
            self.close()
            self._next_step = step
            return
        data = _need(state_dict, "loader_state")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise CorruptStateError(
                f"ZephonDataset state's 'loader_state' should be bytes, found {type(data).__name__}"
            )
        data = bytes(data)
        if data != FRESH:
            self._check_resumable(data, step)
        elif step != 0:
            raise CorruptStateError(f"ZephonDataset state is at step {step} but holds no loader state")
        self.close()
        self._resume = data
        self._next_step = step

    def _check_resumable(self, data: bytes, step: int) -> None:
        assert self._spec is not None and self._slice is not None
        loaded = to_loader_state(data)
        loaded.check_compatible(lanes=self._spec.lanes, fingerprint=self._spec.fingerprint)
        if loaded.step != step:
            raise CorruptStateError(
                f"ZephonDataset state says step {step}, its loader state step {loaded.step}"
            )
        missing = [lane for lane in self._slice.lane_ids if lane not in loaded.lane_states]
        if missing:
            raise StateError(
                f"ZephonDataset: the state has no entry for lane(s) {missing}, which rank {self.rank} "
                f"of {self.world_size} runs; save state_dict() with torch.distributed initialised on "
                f"every rank, or merge every rank's local_state() with gather_states"
            )

    def checkpoint_on_server(self, step: int | None = None) -> str:
        """Served: asks the server to write its state from which ``step`` (default: the next
        step) is the next batch; returns the path to restart the server from (``--resume``)."""
        if self._client_factory is None:
            raise StateError("ZephonDataset.checkpoint_on_server needs a dataset built with from_client")
        target = self._next_step if step is None else step
        if self._source is not None and not isinstance(self._source, Loader):
            return self._source.checkpoint(target)
        client = self._client_factory(self._next_step)
        try:
            return client.checkpoint(target)
        finally:
            client.close()


def gather_states(dataset: ZephonDataset) -> bytes:
    """Every rank's loader state merged (``zf.merge_states``) into checkpoint bytes.

    With torch.distributed initialised (and more than one process) this all-gathers: every rank
    must call it, and each gets the same bytes, which any new topology can load. Without it,
    returns ``dataset.local_state()``.
    """
    local = dataset.local_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    if (dist.get_rank(), dist.get_world_size()) != (dataset.rank, dataset.world_size):
        raise StateError(
            f"gather_states: the dataset is rank {dataset.rank} of {dataset.world_size}, torch.distributed "
            f"says rank {dist.get_rank()} of {dist.get_world_size()}"
        )
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    fresh = [i for i, p in enumerate(parts) if p == FRESH]
    if len(fresh) == len(parts):
        return FRESH
    if fresh:
        raise StateConflictError(
            f"gather_states: rank(s) {fresh} have not yielded a batch yet while others have; "
            f"save states when every rank is at the same step"
        )
    return encode_state(merge_states(parts))


def _topology(rank: int | None, world_size: int | None) -> tuple[int, int]:
    distributed = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if distributed else 0
    if world_size is None:
        world_size = dist.get_world_size() if distributed else 1
    return rank, world_size


def _zf_client() -> ClientFactory:
    import zephon_flow

    client = getattr(zephon_flow, "Client", None)
    if client is None:
        raise SpecError("ZephonDataset.from_client: this zephon-flow has no zf.Client (the gRPC service)")
    factory: ClientFactory = client
    return factory
