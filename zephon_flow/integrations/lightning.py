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
refuses by name a resume where a ``ZephonDataset`` reached Lightning some other way (a plain
``DataLoader``, a ``StatefulDataLoader``, the dataset itself) and would not continue at the step
Lightning continues at.
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


class ZephonDataModule(pl.LightningDataModule):
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
class ZephonGuard(Callback):
    """Refuses a fit whose first ``(step, batch)`` is not the step Lightning resumes at.

    A ``ZephonDataset`` given to Lightning as a plain ``DataLoader`` has no saved state (a
    resume would start the data again at step 0); as the dataset itself or in a
    ``StatefulDataLoader``, Lightning saves its state after the batch it read ahead (a resume
    would skip one batch). Either way the first batch of the resumed fit is not the one
    Lightning counts on; this stops the fit before training on it. A fresh fit is warned.
    """

    def __init__(self) -> None:
        self._expect: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = _flat(trainer.train_dataloader)
        self._expect = _processed(trainer) if any(_unmanaged(x) for x in loaders) else None
        if self._expect == 0:
            warnings.warn(
                f"ZephonGuard: a ZephonDataset reached Lightning as {_kinds(loaders)}: Lightning's "
                f"checkpoints will not resume its data at the step they resume the model (a resume "
                f"is refused); use trainer.fit(model, "
                f"datamodule=zephon_flow.integrations.lightning.ZephonDataModule(spec, ...))",
                UserWarning,
                stacklevel=2,
            )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        expect, self._expect = self._expect, None
        if expect is None or not isinstance(batch, StepBatch) or int(batch.step) == expect:
            return
        why = (
            "Lightning saved no data state (a plain DataLoader has none)"
            if batch.step == 0
            else "Lightning saved the dataset's state after the batch its fit loop read ahead"
        )
        raise StateError(
            f"ZephonGuard: Lightning resumes after {expect} trained batches, but the ZephonDataset "
            f"starts at step {batch.step}: {why}, so training would continue on other batches. "
            f"Train and resume with trainer.fit(model, "
            f"datamodule=zephon_flow.integrations.lightning.ZephonDataModule(spec, ...))"
        )


def _flat(loaders: Any) -> list[Any]:
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return [x for v in loaders.values() for x in _flat(v)]
    if isinstance(loaders, list | tuple):
        return [x for v in loaders for x in _flat(v)]
    return [loaders]


def _unmanaged(loader: Any) -> bool:
    return isinstance(loader, ZephonDataset) or isinstance(getattr(loader, "dataset", None), ZephonDataset)


def _kinds(loaders: list[Any]) -> str:
    return " and ".join(
        "the dataset itself" if isinstance(x, ZephonDataset) else f"a {type(x).__name__}"
        for x in loaders
        if _unmanaged(x)
    )


def guard_callbacks() -> list[Callback]:
    """Lightning's ``callbacks_factory`` entry point: a ``ZephonGuard`` for every Trainer (it
    does nothing where no ``ZephonDataset`` is trained on)."""
    return [ZephonGuard()]
