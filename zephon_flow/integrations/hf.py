"""Hugging Face ``Trainer`` and ``accelerate``: zephon-flow's batches, the trained step's loader
state in every checkpoint, and a resume that loads it instead of replaying batches.

``ZephonTrainer`` (or ``ZephonTrainerMixin`` in front of another ``Trainer`` subclass) trains
on a ``ZephonDataset``: one zephon step per micro-step (``gradient_accumulation_steps`` steps per
optimizer step), this rank's rows of each global batch, as int64 ``input_ids``, ``labels`` and
``position_ids``. Each checkpoint folder gets ``zephon_state.zfstate``: every rank's lanes,
merged, after the last micro-step trained; ``train(resume_from_checkpoint=...)`` loads it, at
any world size. Without the Trainer (a plain ``accelerate`` loop), ``save_data_state`` and
``load_data_state`` do the same for a folder of your own.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

import zephon_flow as zf
from zephon_flow.core.errors import SpecError, StateError
from zephon_flow.torch import ZephonDataset, gather_states, to_hf_inputs

__all__ = [
    "DATA_STATE_NAME",
    "ZephonTrainer",
    "ZephonTrainerMixin",
    "load_data_state",
    "save_data_state",
]

_log = logging.getLogger("zephon_flow")

#: The loader state's file in a checkpoint folder (``zf.save_state``'s format).
DATA_STATE_NAME = "zephon_state.zfstate"
#: Fields a batch carries for the record, not for the model: left out unless asked for.
PROVENANCE = ("documents", "documents_count", "segment_ids")


# -- batches ----------------------------------------------------------------------------------
class _TrainBatches:
    """What the Trainer iterates: the dataset's batches as model inputs, one per micro-step,
    handed out when asked (no read-ahead of its own; the saved state is chosen by step anyway)."""

    def __init__(self, dataset: ZephonDataset, convert: Any) -> None:
        self.dataset = dataset
        self.convert = convert

    def __iter__(self) -> Any:
        for _, batch in self.dataset:
            yield self.convert(batch)


# -- the loader state in a folder ---------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def save_data_state(
    dataset: ZephonDataset,
    folder: str | os.PathLike[str],
    *,
    step: int | None = None,
    write: bool | None = None,
) -> str:
    """Writes ``folder/zephon_state.zfstate``: every rank's lanes merged, so that the resumed run
    yields global batch ``step`` first (default: the one after the last batch yielded; give the
    step explicitly when something reads ahead of training, as ``accelerator.prepare``'s
    dataloaders do). Under torch.distributed every rank must call it (it gathers); the process
    with ``write`` (default: rank 0) writes. Returns the file's path."""
    state = gather_states(dataset, step)
    if not state:
        raise StateError(
            f"save_data_state({os.fspath(folder)!r}): the dataset has not yielded a batch yet, so there "
            f"is no loader state to save; a run that has trained nothing resumes from a fresh dataset"
        )
    path = os.path.join(os.fspath(folder), DATA_STATE_NAME)
    if write is None:
        write = not _distributed() or dist.get_rank() == 0
    if write:
        os.makedirs(os.fspath(folder), exist_ok=True)
        zf.save_state(zf.decode_state(state), path)
    return path


def load_data_state(
    dataset: ZephonDataset, folder: str | os.PathLike[str], *, expected_step: int | None = None
) -> int:
    """Positions ``dataset`` at the state in ``folder/zephon_state.zfstate`` (written by
    ``save_data_state`` or ``ZephonTrainer``, at any world size); returns the step the dataset
    yields next. Reads no data: the time does not grow with the step. ``expected_step``: the
    step the trainer resumes at by its own count; a state at another step is loaded as it is,
    with a ``StepMismatchWarning`` naming both."""
    path = os.path.join(os.fspath(folder), DATA_STATE_NAME)
    if not os.path.isfile(path):
        raise StateError(
            f"{os.fspath(folder)} has no {DATA_STATE_NAME}: it was not written by ZephonTrainer or "
            f"save_data_state, so the data's position cannot be restored without replaying batches; "
            f"resume from a checkpoint folder that has it"
        )
    loaded = zf.load_state(path)
    step = loaded.step
    state = {"step": step, "loader_state": zf.encode_state(loaded)}
    dataset.load_state_dict(state, expected_step=expected_step)
    return step


# -- the Trainer --------------------------------------------------------------------------------
class _DataStateCallback(TrainerCallback):  # type: ignore[misc]
    """Writes the loader state of the trained step into each checkpoint folder: the state from
    which micro-step ``base + global_step * gradient_accumulation_steps`` is next, whatever the
    Trainer has read ahead (the dataset keeps the last ``keep_states`` steps' states)."""

    def __init__(self, trainer: ZephonTrainerMixin) -> None:
        self.trainer = trainer
        self.base = 0  # the data step at global step 0 (0 unless the dataset was positioned first)

    def _per_step(self, args: Any) -> int:
        return int(args.gradient_accumulation_steps)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        dataset = self.trainer._zephon_dataset()
        self.base = dataset.next_step - state.global_step * self._per_step(args)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        dataset = self.trainer._zephon_dataset()
        step = self.base + state.global_step * self._per_step(args)
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        save_data_state(dataset, folder, step=step, write=bool(args.should_save))


def _check_max_steps(args: Any) -> None:
    if args is None or args.max_steps is None or args.max_steps <= 0:
        raise SpecError(
            "ZephonTrainer: set TrainingArguments(max_steps=N): the stream has no length, so the "
            "number of optimizer steps cannot come from num_train_epochs"
        )


class ZephonTrainerMixin:
    """Put in front of ``transformers.Trainer`` or a subclass of it (``ZephonTrainer`` is
    ``ZephonTrainerMixin, Trainer``): ``train_dataset`` is a ``ZephonDataset``.

    One zephon step is one micro-step: an optimizer step trains ``gradient_accumulation_steps``
    global batches. ``per_device_train_batch_size`` must be the spec's ``global_batch_size`` /
    world size (checked); ``max_steps`` must be set (the stream has no length). The batches
    bypass accelerate's dataloader (no ``dispatch_batches``, ``split_batches`` or read-ahead);
    ``provenance=True`` keeps ``documents``, ``documents_count`` and ``segment_ids`` in the
    inputs (with ``remove_unused_columns=False``, for a ``compute_loss`` that reads them).

    A resume compares the checkpoint's data step with ``global_step *
    gradient_accumulation_steps`` from its ``trainer_state.json`` and warns
    (``StepMismatchWarning``) when they differ: after a change of
    ``gradient_accumulation_steps``, or when the first run's dataset did not start at step 0.
    The data always continues from the checkpoint's state.
    """

    def __init__(self, *args: Any, provenance: bool = False, **kwargs: Any) -> None:
        # Trainer(model, args, data_collator, train_dataset, ...): refused before Trainer's own check
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        dataset = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
        if isinstance(dataset, ZephonDataset):
            _check_max_steps(given)
        super().__init__(*args, **kwargs)
        self._zephon_provenance = provenance
        self._zephon_resume: str | None = None
        trainer: Any = self
        if trainer.train_dataset is not None:
            self._zephon_check_args()
        trainer.add_callback(_DataStateCallback(self))

    # -- checks, before any work ----------------------------------------------------------------
    def _zephon_dataset(self) -> ZephonDataset:
        dataset = getattr(self, "train_dataset", None)
        if not isinstance(dataset, ZephonDataset):
            raise SpecError(
                f"ZephonTrainer: train_dataset must be a zephon_flow.torch.ZephonDataset "
                f"(ZephonDataset.from_loader(spec)), got {type(dataset).__name__}"
            )
        if dataset.served:
            raise SpecError(
                "ZephonTrainer: train_dataset is over a zephon serve Client; ZephonTrainer trains on an "
                "embedded loader (ZephonDataset.from_loader(spec)), whose state it saves in checkpoints"
            )
        return dataset

    def _zephon_check_args(self) -> None:
        trainer: Any = self
        args = trainer.args
        dataset = self._zephon_dataset()
        config = args.accelerator_config
        for option in ("split_batches", "dispatch_batches"):
            if getattr(config, option, None):
                raise SpecError(
                    f"ZephonTrainer: accelerator_config {option}=True does not apply: each rank reads its own "
                    f"rows of each global batch from the dataset, never through accelerate's dataloader; "
                    f"leave {option} unset"
                )
        if args.dataloader_num_workers:
            raise SpecError(
                f"ZephonTrainer: dataloader_num_workers={args.dataloader_num_workers}: each DataLoader worker "
                f"would run the whole stream again; leave it 0 and parallelise the loader with "
                f"ZephonDataset.from_loader(spec, backend='processes', workers=N)"
            )
        if args.auto_find_batch_size:
            raise SpecError(
                "ZephonTrainer: auto_find_batch_size=True would change the batch size, which is the spec's "
                "global_batch_size; leave it False"
            )
        _check_max_steps(args)
        for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
            size = getattr(trainer, name)() if hasattr(trainer, name) else 1
            if size != 1:
                raise SpecError(
                    f"ZephonTrainer: {name[4:6]}_size={size}: the ranks of a tensor, context or sequence "
                    f"parallel group need the same rows; ZephonTrainer gives each rank its own (data "
                    f"parallel only)"
                )
        spec = dataset._spec
        assert spec is not None
        world = int(args.world_size)  # starts torch.distributed under torchrun
        self._zephon_check_topology(dataset)
        rows, gpus = spec.global_batch_size // world, max(1, int(args.n_gpu))
        if spec.global_batch_size % world:
            raise SpecError(
                f"ZephonTrainer: the spec's global_batch_size {spec.global_batch_size} does not divide among "
                f"{world} ranks; use a world size that divides it"
            )
        if int(args.train_batch_size) != rows:
            raise SpecError(
                f"ZephonTrainer: per_device_train_batch_size={args.per_device_train_batch_size} but each of the "
                f"{world} rank(s) gets {rows} rows of the spec's global_batch_size {spec.global_batch_size}: "
                f"set TrainingArguments(per_device_train_batch_size={rows // gpus}) (the global batch size "
                f"is the spec's; an optimizer step takes gradient_accumulation_steps of them)"
            )
        if args.ignore_data_skip:
            _log.warning(
                "ZephonTrainer: ignore_data_skip=True is not needed and is turned off: a resume loads the "
                "checkpoint's loader state (no batch is replayed), and the RNG state is restored as usual"
            )
            args.ignore_data_skip = False

    def _zephon_check_topology(self, dataset: ZephonDataset) -> None:
        args: Any = getattr(self, "args")  # noqa: B009
        rank, world = dataset.rank, dataset.world_size  # as resolved at the first iteration
        if (rank, world) != (int(args.process_index), int(args.world_size)):
            raise SpecError(
                f"ZephonTrainer: the train_dataset is rank {rank} of {world} but this Trainer process is rank "
                f"{args.process_index} of {args.world_size}: build it with ZephonDataset.from_loader(spec) "
                f"without rank= or world_size= (they are read from torch.distributed at the first batch)"
            )

    # -- Trainer's hooks ------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a resume also loads the checkpoint's loader state (no replay)."""
        trainer: Any = self
        if resume_from_checkpoint is True:
            found = get_last_checkpoint(trainer.args.output_dir)
            resume_from_checkpoint = found if found is not None else True
        self._zephon_resume = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._zephon_resume = None
            if isinstance(trainer.train_dataset, ZephonDataset):
                trainer.train_dataset.close()  # keeps its position; stops the loader's threads/workers

    def get_train_dataloader(self) -> Any:
        """The dataset's batches as model inputs, one per micro-step, positioned at the
        checkpoint's loader state on a resume."""
        self._zephon_check_args()
        dataset = self._zephon_dataset()
        if self._zephon_resume is not None:
            load_data_state(
                dataset, self._zephon_resume, expected_step=self._zephon_trained(self._zephon_resume)
            )
        return _TrainBatches(dataset, self._zephon_inputs)

    def _zephon_trained(self, folder: str) -> int | None:
        """The micro-steps trained by the checkpoint's own count (its ``trainer_state.json``)."""
        trainer: Any = self
        try:
            with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as f:
                global_step = int(json.load(f)["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # Trainer itself says what is wrong with the checkpoint
        return global_step * int(trainer.args.gradient_accumulation_steps)

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """No skipping: the dataloader already starts at the checkpoint's loader state."""
        return dataloader

    def _zephon_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        trainer: Any = self
        keep = [k for k in PROVENANCE if k in batch] if self._zephon_provenance else []
        inputs = to_hf_inputs(batch, keep=keep)
        if trainer.args.remove_unused_columns:
            trainer._set_signature_columns_if_needed()
            accepted = set(trainer._signature_columns)
            inputs = {k: v for k, v in inputs.items() if k in accepted}
        return inputs


class ZephonTrainer(ZephonTrainerMixin, Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` over a ``ZephonDataset``: see ``ZephonTrainerMixin``."""
