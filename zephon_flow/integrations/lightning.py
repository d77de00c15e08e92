"""PyTorch Lightning face: a data module whose checkpointed data state is the step the model trained on.

::

    from zephon_flow.integrations.lightning import ZephonDataModule

    trainer.fit(model, datamodule=ZephonDataModule(spec, backend="threads", workers=4))
    trainer.fit(model, datamodule=ZephonDataModule(spec), ckpt_path="last.ckpt")  # exact resume

Lightning's fit loop reads one batch ahead of training, so a state taken from the dataset at
checkpoint time is one batch late. ``ZephonDataModule`` asks the dataset for the state of the
step after the last batch the model trained on (Lightning's batch progress), merged over all
ranks (the one collective, at checkpoint time), and loads it before the first batch of a
resumed fit, under any world size and worker count.

``ZephonGuard`` (added to every Trainer through Lightning's ``callbacks_factory`` entry point)
covers a ``ZephonDataset`` that reached Lightning some other way: as the dataset itself or in
a ``StatefulDataLoader`` it saves the trained step's state in place of Lightning's read-ahead
one (exact resume); through a plain ``DataLoader`` (no state to save) it warns, and refuses the
resume by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from zephon_flow.core.errors import CorruptStateError, SpecError, StateError
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.torch import StepBatch, ZephonDataset, gather_states

#: Names this module's entry in a Lightning checkpoint's data-module state.
FORMAT = "zephon_flow.lightning/1"
_KEYS = ("format", "data", "trained_batches")


class ZephonDataModule(pl.LightningDataModule):  # type: ignore[misc]
    """A ``LightningDataModule`` over ``ZephonDataset.from_loader(spec, ...)``.

    ``training_step`` receives ``(step, batch)`` (a ``StepBatch``): this rank's rows of global
    batch ``step``. Rank and world size come from the process group Lightning sets up.
    ``loader_options`` (``backend``, ``workers``, ``keep_states``, ...) go to
    ``ZephonDataset.from_loader``; ``group`` is the process group the state is gathered over
    at checkpoint time (default: the world).
    """

    def __init__(
        self,
        spec: LoaderSpec,
        *,
        backend: str = "inline",
        workers: int = 1,
        group: dist.ProcessGroup | None = None,
        **loader_options: Any,
    ) -> None:
        super().__init__()
        if not isinstance(spec, LoaderSpec):
            raise SpecError(f"ZephonDataModule: spec must be a zf.LoaderSpec, got {type(spec).__name__}")
        self.spec = spec
        self._group = group
        self._options: dict[str, Any] = {"backend": backend, "workers": workers, **loader_options}
        self._dataset: ZephonDataset | None = None
        self._loaded: dict[str, Any] | None = None  # a checkpoint's state, for the next dataset
        self._offset = 0  # data step minus Lightning's trained batches, fixed when the dataset is made

    @property
    def dataset(self) -> ZephonDataset | None:
        """The dataset of the current fit (None before ``train_dataloader``)."""
        return self._dataset

    # -- Lightning's hooks ---------------------------------------------------------------------
    def train_dataloader(self) -> Iterable[StepBatch]:
        """This rank's batches, from the loaded checkpoint's step when resuming."""
        if self._dataset is None:
            dataset = ZephonDataset.from_loader(self.spec, group=self._group, **self._options)
            trained = self._trained_batches()
            if self._loaded is not None:
                saved_offset = self._loaded["data"]["step"] - self._loaded["trained_batches"]
                dataset.load_state_dict(self._loaded["data"], expected_step=trained + saved_offset)
            elif trained:
                raise StateError(
                    f"ZephonDataModule: Lightning resumes after {trained} trained batches, but the "
                    f"checkpoint holds no ZephonDataModule state, so the data would start again at "
                    f"step 0. Resume from a checkpoint saved with this data module, or start a new fit "
                    f"(load only the weights) to train on the stream from its start"
                )
            self._offset = dataset.next_step - trained
            self._dataset = dataset
        return _Batches(self._dataset)

    def state_dict(self) -> dict[str, Any]:
        """The state after the last batch trained on, all ranks merged (collective: every rank of
        a fit calls it when Lightning saves a checkpoint)."""
        dataset = self._dataset
        if dataset is None:  # no fit yet: what was loaded, if anything (Lightning skips {})
            return dict(self._loaded) if self._loaded is not None else {}
        trained = self._trained_batches()
        step = trained + self._offset
        data = gather_states(dataset, step=step, group=self._group)
        return {"format": FORMAT, "data": {"step": step, "loader_state": data}, "trained_batches": trained}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keeps a checkpoint's state; the next ``train_dataloader`` starts from it."""
        missing = [key for key in _KEYS if not isinstance(state_dict, dict) or key not in state_dict]
        if missing:
            raise CorruptStateError(
                f"ZephonDataModule state is missing {', '.join(map(repr, missing))}: pass what "
                f"ZephonDataModule.state_dict() returned (Lightning stores it under the checkpoint's "
                f"{type(self).__qualname__!r} key)"
            )
        data, trained = state_dict["data"], state_dict["trained_batches"]
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("step"), int)
            or not isinstance(trained, int)
        ):
            raise CorruptStateError(
                "ZephonDataModule state should hold 'data' {'step': int, 'loader_state': bytes} and "
                f"'trained_batches' int, found {type(data).__name__} and {type(trained).__name__}"
            )
        if state_dict["format"] != FORMAT:
            raise CorruptStateError(
                f"ZephonDataModule state has format {state_dict['format']!r}; this zephon-flow reads {FORMAT!r}"
            )
        self.close()
        self._dataset = None
        self._loaded = dict(state_dict)

    def teardown(self, stage: str) -> None:
        """Stops the loader's workers; the dataset keeps its position for a next fit."""
        self.close()

    def close(self) -> None:
        """Stops the dataset's loader, if any."""
        if self._dataset is not None:
            self._dataset.close()

    def _trained_batches(self) -> int:
        trainer = self.trainer
        if trainer is None:
            raise StateError("ZephonDataModule: use it in trainer.fit(model, datamodule=...)")
        return _processed(trainer)


class _Batches(Iterable[StepBatch]):
    """The dataset's batches with no ``state_dict`` of their own, so that Lightning's fit loop
    leaves the data state to ``ZephonDataModule`` (its own would be one read-ahead batch late)."""

    def __init__(self, dataset: ZephonDataset) -> None:
        self._dataset = dataset

    def __iter__(self) -> Iterator[StepBatch]:
        return iter(self._dataset)


def _processed(trainer: pl.Trainer) -> int:
    # Batches whose training_step has finished, over the whole fit (restored on resume): the
    # count Lightning itself resumes after. A batch fetched ahead is not counted.
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)


# -- the guard against a ZephonDataset given to Lightning without the data module ----------------
class ZephonGuard(Callback):  # type: ignore[misc]
    """Makes a ``ZephonDataset`` given to Lightning without ``ZephonDataModule`` resume exactly,
    or refuses the resume by name.

    As the dataset itself or in a torchdata ``StatefulDataLoader``, Lightning saves the
    dataset's state, but after the batch its fit loop read ahead (a resume would skip it): the
    guard replaces that entry with the state of the step after the last batch trained, merged
    over all ranks. A plain ``DataLoader`` has no state for Lightning to save (a resume would
    start the data again at step 0): a fresh fit is warned. Whatever the way in, a resumed fit
    whose first batch is not the step Lightning resumes at is stopped before training on it.
    """

    def __init__(self) -> None:
        self._first = False  # the next training batch is the first of this fit
        self._offset = 0  # data step minus Lightning's trained batches

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = [x for x in _flat(trainer.train_dataloader) if _dataset_of(x) is not None]
        self._first = bool(loaders)
        plain = [x for x in loaders if not _stateful(x)]
        if plain and _processed(trainer) == 0:
            warnings.warn(
                f"ZephonGuard: a ZephonDataset reached Lightning through a {type(plain[0]).__name__}, "
                f"which has no state for Lightning's checkpoints: a resume from them would start the "
                f"data again at step 0, so it will be refused. Use trainer.fit(model, "
                f"datamodule=zephon_flow.integrations.lightning.ZephonDataModule(spec, ...))",
                UserWarning,
                stacklevel=2,
            )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._first:
            return
        self._first = False
        if not isinstance(batch, StepBatch):
            return
        trained, step = _processed(trainer), int(batch.step)
        if trained == 0:  # a fresh fit: the data may start anywhere
            self._offset = step
            return
        if step != trained:
            raise StateError(
                f"ZephonGuard: Lightning resumes after {trained} trained batches, but the "
                f"ZephonDataset starts at step {step}"
                + (" (Lightning saved no state for it)" if step == 0 else "")
                + f": steps {trained}.. would train on other batches. Train and resume with "
                f"trainer.fit(model, "
                f"datamodule=zephon_flow.integrations.lightning.ZephonDataModule(spec, ...))"
            )
        self._offset = 0

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Replaces the fit loop's read-ahead state of each ZephonDataset with the trained step's
        (collective: every rank saves a checkpoint)."""
        loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        entries = loop.get("combined_loader")  # the fit loop's own state (Loop.on_save_checkpoint)
        stateful = [x for x in _flat(trainer.train_dataloader) if _stateful(x)]
        if not entries or len(entries) != len(stateful):
            return
        step = _processed(trainer) + self._offset
        for index, loader in enumerate(stateful):
            dataset = _dataset_of(loader)
            if dataset is None:
                continue
            data = {"step": step, "loader_state": gather_states(dataset, step=step)}
            if loader is dataset:
                entries[index] = data
            elif isinstance(entries[index], dict) and "dataset_state" in entries[index]:
                entries[index] = {**entries[index], "dataset_state": data}  # StatefulDataLoader's


def _flat(loaders: Any) -> list[Any]:
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return [x for v in loaders.values() for x in _flat(v)]
    if isinstance(loaders, list | tuple):
        return [x for v in loaders for x in _flat(v)]
    return [loaders]


def _dataset_of(loader: Any) -> ZephonDataset | None:
    """The ZephonDataset a loader given to Lightning holds (not one a ZephonDataModule manages)."""
    if isinstance(loader, ZephonDataset):
        return loader
    dataset = getattr(loader, "dataset", None)
    return dataset if isinstance(dataset, ZephonDataset) else None


def _stateful(loader: Any) -> bool:
    # What Lightning's fit loop saves and loads (its _Stateful protocol).
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def guard_callbacks() -> list[Callback]:
    """Lightning's ``callbacks_factory`` entry point: a ``ZephonGuard`` for every Trainer (it
    does nothing where no ``ZephonDataset`` is trained on)."""
    return [ZephonGuard()]
