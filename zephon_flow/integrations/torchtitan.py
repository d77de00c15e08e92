"""torchtitan face: a ``BaseDataLoader`` whose checkpoint resumes at another data-parallel degree.

In a torchtitan config (a function of a ``--module`` registry returning ``Trainer.Config``)::

    from zephon_flow.integrations.torchtitan import ZephonTitanDataLoader

    config.dataloader = ZephonTitanDataLoader.Config(spec="my_pipelines:spec")

The trainer builds it with its data-parallel ("batch" mesh) rank and degree; each batch is
``({"input": ..., "positions": ...}, labels)``, ``local_batch_size x seq_len``. Its state, saved
by torchtitan's checkpointer (DCP) under ``dataloader``, is one entry per lane, never per rank:
ranks that hold the same lanes (tensor, context or pipeline parallel peers) write the same
bytes under the same keys, so DCP's one copy per key is exact, no collective is needed, and a
checkpoint resumes under any data-parallel degree. ``docs/frameworks.md`` has the recipe.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.dataloader import BaseDataLoader  # type: ignore[import-untyped]
from torchtitan.components.loss import IGNORE_INDEX  # type: ignore[import-untyped]

from zephon_flow.core.errors import SpecError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.engine.endsync import TorchEndSync
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.torch import TorchBatch, ZephonDataset

TitanBatch = tuple[dict[str, torch.Tensor], torch.Tensor]
WHO = "ZephonTitanDataLoader"


class ZephonTitanDataLoader(BaseDataLoader):  # type: ignore[misc]
    """A torchtitan dataloader over a ``zf.LoaderSpec``: this data-parallel rank's rows of each
    global batch, as ``({"input": ids[:, :-1], "positions": ...}, labels)``.

    The pipeline's sequences are ``seq_len + 1`` tokens (``Pack(seq_len=S + 1)`` for
    ``--training.seq_len S``): the input and its labels shifted by one. Labels of padding
    (``segment_ids == -1``) are ``IGNORE_INDEX``. One training step may take several batches
    (gradient accumulation, pipeline microbatches); each is one global batch of the pipeline.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):  # type: ignore[misc]
        spec: str = ""
        """Where the pipeline is: ``"package.module:name"``, a ``zf.LoaderSpec`` or a function
        of no arguments returning one."""

        backend: str = "inline"
        """The loader's backend for stateless work: inline, threads, processes or ray."""

        workers: int = 1
        """Workers of the backend."""

        tokens: str = "input_ids"
        """The batch field holding the token ids (``seq_len + 1`` per row)."""

        positions: str = "position_ids"
        """The batch field passed to the model as ``positions`` (per-document positions, which
        torchtitan's flex and varlen attention turn into document masks); ``""`` for none."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        tokenizer: Any = None,
        snapshot_every_n_steps: int | None = None,
        spec: LoaderSpec | None = None,
    ) -> None:
        """``spec`` (a ``zf.LoaderSpec``) stands for ``config.spec`` when given; ``tokenizer`` and
        ``snapshot_every_n_steps`` are torchtitan's and unused: the pipeline tokenizes, and its
        state after any batch is always at hand."""
        self.config = config
        self.spec = spec if spec is not None else resolve_spec(config.spec)
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        _check_geometry(self.spec, dp_world_size=dp_world_size, local_batch_size=local_batch_size)
        self._slice = RankSlice(
            rank=dp_rank,
            world_size=dp_world_size,
            lanes=self.spec.lanes,
            global_batch_size=self.spec.global_batch_size,
        )
        options: dict[str, Any] = {"backend": config.backend, "workers": config.workers}
        end_sync = _end_sync(dp_rank, dp_world_size)
        if end_sync is not None:
            options["end_sync"] = end_sync
        self.dataset = ZephonDataset.from_loader(self.spec, rank=dp_rank, world_size=dp_world_size, **options)

    @property
    def lane_ids(self) -> list[int]:
        """The lanes under this data-parallel rank's rows: the keys its state holds."""
        return list(self._slice.lane_ids)

    # -- batches ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[TitanBatch]:
        for step, batch in self.dataset:
            yield self._titan_batch(step, batch)

    def _titan_batch(self, step: int, batch: TorchBatch) -> TitanBatch:
        field = self.config.tokens
        if field not in batch:
            raise SpecError(
                f"{WHO}: the pipeline's batches have no field {field!r} (they have "
                f"{', '.join(sorted(batch))}); set tokens= in ZephonTitanDataLoader.Config"
            )
        ids = batch[field]
        want = (self.local_batch_size, self.seq_len + 1)
        if tuple(ids.shape) != want:
            raise SpecError(
                f"{WHO}: step {step}'s {field!r} is {tuple(ids.shape)}, torchtitan needs {want} "
                f"(local batch size x training.seq_len + 1: the input and its labels shifted by "
                f"one); pack the pipeline to Pack(seq_len={self.seq_len + 1}), or set "
                f"--training.seq_len {ids.shape[-1] - 1}"
            )
        ids = ids.long()
        labels = ids[:, 1:].clone()
        segments = batch.get("segment_ids")
        if segments is not None:
            labels[segments[:, 1:] < 0] = IGNORE_INDEX
        inputs = {"input": ids[:, :-1]}
        if self.config.positions and self.config.positions in batch:
            inputs["positions"] = batch[self.config.positions][:, :-1].long()
        return inputs, labels

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``ZephonDataset.state_dict()``: ``{"step", "lane_states": {lane: bytes}}``, positioned
        after the last batch yielded, one entry per lane of this rank (before the first batch,
        per lane of the pipeline: the template DCP loads into). Cheap and not collective."""
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Positions the loader at a saved state, whatever the data-parallel degree it was saved
        at (``ZephonDataset.load_state_dict``: checks the pipeline and the lanes by name)."""
        self.dataset.load_state_dict(state_dict)

    def close(self) -> None:
        """Stops the loader's work (its threads, processes or actors)."""
        self.dataset.close()


def resolve_spec(where: str) -> LoaderSpec:
    """The ``zf.LoaderSpec`` named by ``"package.module:name"`` (the spec, or a function of no
    arguments returning one)."""
    module_name, _, attr = where.partition(":")
    if not module_name or not attr:
        raise SpecError(
            f"{WHO}.Config(spec={where!r}): give the pipeline as 'package.module:name', naming a "
            f"zf.LoaderSpec or a function of no arguments returning one"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"{WHO}.Config(spec={where!r}): cannot import {module_name!r}: {exc}") from exc
    found = getattr(module, attr, None)
    if found is None:
        raise SpecError(f"{WHO}.Config(spec={where!r}): module {module_name!r} has no {attr!r}")
    spec = found if isinstance(found, LoaderSpec) else found() if callable(found) else found
    if not isinstance(spec, LoaderSpec):
        raise SpecError(
            f"{WHO}.Config(spec={where!r}): {attr!r} gave a {type(spec).__name__}, not a zf.LoaderSpec"
        )
    return spec


def _check_geometry(spec: LoaderSpec, *, dp_world_size: int, local_batch_size: int) -> None:
    rows = local_batch_size * dp_world_size
    if rows != spec.global_batch_size:
        raise SpecError(
            f"{WHO}: torchtitan asks for {local_batch_size} rows per batch (training.local_batch_size, "
            f"or parallelism.pipeline_parallel_microbatch_size under pipeline parallelism) on "
            f"{dp_world_size} data-parallel rank(s), {rows} rows in all, but the pipeline's "
            f"global_batch_size is {spec.global_batch_size}: make them equal (zf.LoaderSpec("
            f"global_batch_size={rows}), or --training.local_batch_size "
            f"{spec.global_batch_size // dp_world_size if spec.global_batch_size % dp_world_size == 0 else '?'})"
        )


def _end_sync(dp_rank: int, dp_world_size: int) -> TorchEndSync | None:
    """How the ranks of a finite pass agree on its last step: over the data-parallel group
    when torch.distributed's world is larger than the data-parallel degree (tensor, context or
    pipeline parallelism); else the loader's own default (the world, or none for one rank)."""
    if dp_world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() == dp_world_size:
        return None
    return TorchEndSync(group=data_parallel_group(dp_rank, dp_world_size))


def data_parallel_group(dp_rank: int, dp_world_size: int) -> Any:
    """A gloo group holding this rank and one rank of each other data-parallel rank: with
    torchtitan's layout, this rank's group of its "batch" mesh (which the trainer does not hand
    its dataloader). Found from what every rank says its data-parallel rank is (one all-gather
    over the world) while every rank builds its dataloader, as making a group is collective;
    the ranks must agree on the degree and each data-parallel rank must have as many peers."""
    world = dist.get_world_size()
    told: list[Any] = [None] * world
    dist.all_gather_object(told, (dp_rank, dp_world_size))
    degrees = sorted({size for _, size in told})
    if degrees != [dp_world_size]:
        raise SpecError(
            f"{WHO}: the ranks were built with data-parallel degrees {degrees}; every rank's "
            f"dataloader must be built with the same dp_world_size"
        )
    ranks_of = [[r for r, (d, _) in enumerate(told) if d == dp] for dp in range(dp_world_size)]
    peers = world // dp_world_size
    uneven = {dp: ranks for dp, ranks in enumerate(ranks_of) if len(ranks) != peers}
    if world % dp_world_size or uneven:
        raise SpecError(
            f"{WHO}: {world} ranks cannot be {dp_world_size} data-parallel ranks of {peers} peers "
            f"each: torch.distributed ranks per data-parallel rank {dict(enumerate(ranks_of))}"
        )
    layout = [[ranks_of[dp][k] for dp in range(dp_world_size)] for k in range(peers)]
    group, _ = dist.new_subgroups_by_enumeration(layout, backend="gloo")  # type: ignore[no-untyped-call]
    return group
