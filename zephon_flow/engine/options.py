"""The entry points' options in groups: frozen, keyword-only, each checked once when built.

``zf.Loader``, ``BatchServer`` (``zephon serve``), ``zf.Client`` and the lane owners' server
take their options as keyword arguments of the same names as these fields, and build the
groups from them: a value out of range is refused by the group, whichever entry point it was
given to. ``kwargs()`` turns a group back into those keyword arguments, so one group can be
handed to several entry points (``zf.Loader(spec, **work.kwargs())``). ``owner`` names the
entry point in the messages (``zephon_flow.core.options``); it is not part of the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import SpecError
from zephon_flow.core.options import (
    check_choice,
    check_flag,
    check_int,
    check_rank,
    check_seconds,
    flag_or_name,
    option_name,
)
from zephon_flow.runners.backends import BACKENDS, DEFAULT_CHUNK_TIMEOUT, make_backend
from zephon_flow.runners.backends.base import Backend
from zephon_flow.runners.segment import FrontSegment
from zephon_flow.runners.streams import CHUNK_RECORDS

__all__ = [
    "CheckpointOptions",
    "EndpointOptions",
    "HoldOptions",
    "ResumeOptions",
    "StateOptions",
    "TopologyOptions",
    "WorkOptions",
]

#: What ``Loader.state_dict`` stores: buffered sequences' tokens, or where they came from.
STATE_MODES = ("compact", "recipe")


class _Group:
    """What every group does: its fields as keyword arguments."""

    def kwargs(self) -> dict[str, Any]:
        """The group's values as the entry points' keyword arguments (``owner`` left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "owner"}  # type: ignore[arg-type]


def _owner() -> Any:
    return field(default="", compare=False, repr=False)


@dataclass(frozen=True, kw_only=True)
class TopologyOptions(_Group):
    """Which trainer rank (``rank``) of how many (``world_size``)."""

    rank: int = 0
    world_size: int = 1
    owner: str = _owner()

    def __post_init__(self) -> None:
        check_rank(self.rank, self.world_size, owner=self.owner)


@dataclass(frozen=True, kw_only=True)
class WorkOptions(_Group):
    """Where the stateless work runs: ``backend`` (``"inline"``, ``"threads"``,
    ``"processes"``, ``"ray"``) with ``workers``; ``ray_address`` the Ray cluster of
    ``"ray"`` (None: the one this process is connected to, or a local one); ``prefetch``
    batches made ahead; each lane's ``prefetch_chunks`` chunks in flight of at most
    ``chunk_records`` records; ``chunk_timeout`` seconds for one chunk's work."""

    backend: str = "inline"
    workers: int = 1
    prefetch: int = 2
    chunk_records: int = CHUNK_RECORDS
    prefetch_chunks: int = 8
    chunk_timeout: float = DEFAULT_CHUNK_TIMEOUT
    ray_address: str | None = None
    owner: str = _owner()

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            prefix = f"{self.owner}: " if self.owner else ""
            raise SpecError(f"{prefix}unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        for name in ("workers", "prefetch", "chunk_records", "prefetch_chunks"):
            check_int(getattr(self, name), name, owner=self.owner)
        check_seconds(self.chunk_timeout, "chunk_timeout", owner=self.owner, default=DEFAULT_CHUNK_TIMEOUT)
        address = self.ray_address
        if address is not None and (self.backend != "ray" or not isinstance(address, str) or not address):
            raise SpecError(
                f"{option_name(self.owner, 'ray_address')}={address!r} goes with backend='ray' and must be "
                f"a non-empty address such as 'ray://HOST:10001' or 'HOST:6379' (got backend={self.backend!r})"
            )

    def make_backend(self, segment: FrontSegment, clock: Clock = SYSTEM_CLOCK) -> Backend:
        """The backend running ``segment`` as these options say, its ``chunk_timeout`` on ``clock``."""
        return make_backend(
            self.backend,
            workers=self.workers,
            segment=segment,
            chunk_timeout=self.chunk_timeout,
            ray_address=self.ray_address,
            clock=clock,
        )


@dataclass(frozen=True, kw_only=True)
class ResumeOptions(_Group):
    """What a resumed state may differ in (``allow_*_change``: the pipeline's ``Mix``, its
    code, its ``global_batch_size``), and whether the lanes' first windows are verified
    against the state (``verify_resume``)."""

    verify_resume: bool = True
    allow_mix_change: bool = False
    allow_code_change: bool = False
    allow_batch_change: bool = False
    owner: str = _owner()

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "owner":
                check_flag(getattr(self, f.name), f.name, owner=self.owner)


@dataclass(frozen=True, kw_only=True)
class StateOptions(_Group):
    """The states a loader writes: ``state_mode`` (``"compact"``: buffered sequences' tokens;
    ``"recipe"``: where they came from) and how many it keeps (``keep_states``)."""

    state_mode: str = "compact"
    keep_states: int = 8
    owner: str = _owner()

    def __post_init__(self) -> None:
        check_choice(self.state_mode, "state_mode", STATE_MODES, owner=self.owner)
        check_int(self.keep_states, "keep_states", owner=self.owner)


@dataclass(frozen=True, kw_only=True)
class HoldOptions(_Group):
    """The steps a server holds for its readers: up to ``ahead`` past the slowest one's
    acknowledged step, ``keep`` behind it, and at most ``held_bytes`` bytes (None: no bound)."""

    ahead: int = 32
    keep: int = 8
    held_bytes: int | None = None
    owner: str = _owner()

    def __post_init__(self) -> None:
        check_int(self.ahead, "ahead", owner=self.owner)
        check_int(self.keep, "keep", low=0, owner=self.owner)
        if self.held_bytes is not None:
            check_int(self.held_bytes, "held_bytes", owner=self.owner)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions(_Group):
    """Where a server writes checkpoints (``checkpoint_dir``), every how many steps of its
    slowest rank (``checkpoint_every``; None: only when asked), keeping the newest
    ``keep_checkpoints``."""

    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 3
    owner: str = _owner()

    def __post_init__(self) -> None:
        check_int(self.keep_checkpoints, "keep_checkpoints", owner=self.owner)
        if self.checkpoint_every is not None:
            check_int(self.checkpoint_every, "checkpoint_every", owner=self.owner)
            if self.checkpoint_dir is None:
                raise SpecError(
                    f"{option_name(self.owner, 'checkpoint_every')} needs "
                    f"{flag_or_name(self.owner, 'checkpoint_dir')} (where to write them)"
                )


@dataclass(frozen=True, kw_only=True)
class EndpointOptions(_Group):
    """Where a server listens (``host``, ``port``; 0: any free port) and how it is guarded:
    the shared ``token`` (None: none), TLS as ``(cert_path, key_path)``, and how long a stream
    may wait on a client that takes nothing (``stream_timeout`` seconds)."""

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    tls: tuple[str, str] | None = None
    stream_timeout: float = 300.0
    owner: str = _owner()

    def __post_init__(self) -> None:
        port = self.port
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise SpecError(f"{option_name(self.owner, 'port')} must be in [0, 65535], got {port!r}")
        check_seconds(self.stream_timeout, "stream_timeout", owner=self.owner)
        if self.tls is not None and len(self.tls) != 2:
            raise SpecError(
                f"{option_name(self.owner, 'tls')} must be (cert_path, key_path), got {self.tls!r}"
            )
