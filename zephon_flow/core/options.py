"""The checks of every entry point's options, written once: integers, seconds, flags, choices.

An option refused here is a ``SpecError`` naming it. ``owner`` says whose option it is: empty
(``workers must be ...``), an entry point (``Client: rank must be ...``), or a command
(``zephon serve``), whose options are named by their flags (``zephon serve: --ahead must
be ...``). The option groups that use these live in ``zephon_flow.engine.options``.
"""

from __future__ import annotations

from collections.abc import Sequence

from zephon_flow.core.errors import SpecError


def option_name(owner: str, name: str) -> str:
    """How a message names option ``name`` of ``owner`` (see the module's docstring)."""
    if owner.startswith("zephon "):
        return f"{owner}: --{name.replace('_', '-')}"
    return f"{owner}: {name}" if owner else name


def flag_or_name(owner: str, name: str) -> str:
    """``name`` as ``owner``'s users write it: ``--flag`` for a command, else the name."""
    return f"--{name.replace('_', '-')}" if owner.startswith("zephon ") else name


def check_int(value: object, name: str, *, low: int = 1, owner: str = "") -> None:
    """Refuses ``value`` unless it is an integer (not a bool) of at least ``low``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise SpecError(f"{option_name(owner, name)} must be {what}, got {value!r}")


def check_rank(rank: object, world_size: object, *, owner: str = "") -> None:
    """Refuses a ``world_size`` that is not a positive integer, or a ``rank`` outside it."""
    check_int(world_size, "world_size", owner=owner)
    assert isinstance(world_size, int)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise SpecError(f"{option_name(owner, 'rank')} must be in [0, {world_size}), got {rank!r}")


def check_seconds(value: object, name: str, *, owner: str = "", default: float | None = None) -> None:
    """Refuses ``value`` unless it is a number of seconds above 0; ``default`` is said too."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        said = "" if default is None else f" (the default is {default:g})"
        raise SpecError(
            f"{option_name(owner, name)} must be a positive number of seconds, got {value!r}{said}"
        )


def check_flag(value: object, name: str, *, owner: str = "") -> None:
    """Refuses ``value`` unless it is True or False."""
    if not isinstance(value, bool):
        raise SpecError(f"{option_name(owner, name)} must be True or False, got {value!r}")


def check_choice(value: object, name: str, choices: Sequence[str], *, owner: str = "") -> None:
    """Refuses ``value`` unless it is one of ``choices``."""
    if value not in choices:
        raise SpecError(f"{option_name(owner, name)} must be one of {', '.join(choices)}, got {value!r}")
