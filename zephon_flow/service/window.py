"""Deprecated module name: the server's held global batches live in ``service/held.py``."""

from __future__ import annotations

import warnings
from typing import Any

from zephon_flow.service import held

_MOVED = {"StepWindow": "HeldSteps", "WindowError": "HeldStepsError", "WindowStatus": "HeldStatus"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"zephon_flow.service.window.{name} is now zephon_flow.service.held.{_MOVED[name]}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(held, _MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
