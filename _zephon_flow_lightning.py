"""Lightning's ``callbacks_factory`` entry point, kept light for every Trainer that is not ours.

Every ``lightning.pytorch.Trainer`` in an environment with zephon-flow asks this module for
callbacks. It sits outside the ``zephon_flow`` package so that asking costs no import of
zephon-flow (about 3 s with Beam): the callback it gives waits for the fit to start, and only
where ``zephon_flow.torch`` is loaded (a ``ZephonDataset`` exists only then) hands each hook to
``zephon_flow.integrations.lightning.ZephonGuard``.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.pytorch.callbacks import Callback


class LazyZephonGuard(Callback):  # type: ignore[misc]
    """A ``ZephonGuard`` once a fit starts with ``zephon_flow.torch`` loaded; else nothing."""

    def __init__(self) -> None:
        self._guard: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning builds the train dataloader before this hook: a ZephonDataset given to it
        # has loaded zephon_flow.torch by now.
        if self._guard is None and "zephon_flow.torch" in sys.modules:
            from zephon_flow.integrations.lightning import ZephonGuard

            self._guard = ZephonGuard()
        if self._guard is not None:
            self._guard.on_train_start(trainer, pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._guard is not None:
            self._guard.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self._guard is not None:
            self._guard.on_save_checkpoint(trainer, pl_module, checkpoint)


def guard_callbacks() -> list[Callback]:
    """The entry point: one ``LazyZephonGuard`` per Trainer."""
    return [LazyZephonGuard()]
