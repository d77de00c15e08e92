"""The roles operators declare so that the runner knows them without importing them.

An operator says what it is to the deterministic runner with a class attribute
``zephon_role``: ``"source"`` (a ``Source``: dealt to lanes by splits) or ``"mix"`` (interleaves
its inputs per lane). A mix also meets ``MixOperator``, and what it hands the lane to draw
from meets ``MixPolicy``. The runner reads roles with ``role_of``; operators never need the
runner, and the runner never names an operator class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

Role = Literal["source", "mix"]


def role_of(transform: Any) -> Role | None:
    """The role a transform declares, or None for an ordinary Beam transform."""
    role = getattr(type(transform), "zephon_role", None)
    return role if role in ("source", "mix") else None


class MixPolicy(Protocol):
    """What a lane draws the source of its next record from (and what a checkpoint stores)."""

    exhausted: str

    def choose(
        self, seed: int, lane: int, position: int, *, step: int, exhausted: Sequence[int] = ()
    ) -> int | None: ...

    def history(self) -> list[tuple[int, dict[str, Any]]]: ...


class MixOperator(Protocol):
    """A transform with ``zephon_role = "mix"``, as the runner and the plan see it."""

    @property
    def n_inputs(self) -> int: ...

    def params(self) -> dict[str, Any]: ...

    def can_end(self, finite: Sequence[bool]) -> bool: ...

    def mixture(self) -> MixPolicy: ...
