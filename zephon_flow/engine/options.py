"""The entry points' options in groups: frozen, keyword-only, each checked once when built.

``zf.Loader``, ``BatchServer`` (``zephon serve``), ``zf.Client``, ``OwnedLoader`` and the lane
owners' server take their options as keyword arguments of the same names as these fields, and
build the groups from them (a lane owner's, ``OwnerOptions``, is made of the work, hold and
resume groups and checked by them): a value out of range is refused by the group, whichever entry point it was
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
    "OwnerOptions",
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


@dataclass(frozen=True, kw_only=True)
class OwnerOptions(_Group):
    """How each lane owner runs its lanes, made of the shared groups and checked by them: its
    stateless work (``work``: ``WorkOptions``' ``backend``, ``workers``, ``chunk_records``,
    ``prefetch_chunks``, ``chunk_timeout``), the steps it holds for its readers (``hold``:
    ``ahead`` past the slowest, ``keep`` behind), what a state it resumes from may differ in
    (``resume``: ``verify_resume``, ``allow_mix_change``, ``allow_code_change``); and the
    owners' own: how long one may take to be placed and build its lanes (``start_timeout``
    seconds), how long one goes on once its run's coordinator is gone for good
    (``orphan_timeout``), where they write the snapshots a replacement starts from
    (``snapshot_dir``, a folder every node sees; None: handed to the coordinator), the CPUs
    each reserves (``owner_cpus``), every how many steps of the slowest rank their snapshots
    are gathered (``snapshot_every``) and how many dead owners are replaced over a run
    (``max_replacements``). ``of`` builds one from the groups."""

    backend: str = "inline"
    workers: int = 1
    chunk_records: int = CHUNK_RECORDS
    prefetch_chunks: int = 8
    chunk_timeout: float = DEFAULT_CHUNK_TIMEOUT
    ahead: int = 4
    keep: int = 4
    verify_resume: bool = True
    allow_mix_change: bool = False
    allow_code_change: bool = False
    start_timeout: float = 120.0
    orphan_timeout: float = 60.0
    snapshot_dir: str | None = None
    owner_cpus: float = 0.0
    snapshot_every: int = 8
    max_replacements: int = 3
    owner: str = field(default="lane owners", compare=False, repr=False)

    def __post_init__(self) -> None:
        _ = (self.work, self.hold, self.resume)  # each group checks its fields as it is built
        check_seconds(self.start_timeout, "start_timeout", owner=self.owner)
        check_seconds(self.orphan_timeout, "orphan_timeout", owner=self.owner)
        check_int(self.snapshot_every, "snapshot_every", owner=self.owner)
        check_int(self.max_replacements, "max_replacements", low=0, owner=self.owner)
        cpus = self.owner_cpus
        if isinstance(cpus, bool) or not isinstance(cpus, int | float) or not cpus >= 0:
            raise SpecError(
                f"{option_name(self.owner, 'owner_cpus')} must be a number of CPUs >= 0, got {cpus!r}"
            )
        if self.snapshot_dir is not None and (
            not isinstance(self.snapshot_dir, str) or not self.snapshot_dir
        ):
            raise SpecError(
                f"{option_name(self.owner, 'snapshot_dir')} must be a folder every node sees (or None), "
                f"got {self.snapshot_dir!r}"
            )

    @property
    def work(self) -> WorkOptions:
        """The owner's stateless work (``prefetch`` and ``ray_address`` are its readers' and
        its cluster's, not its own: left at their defaults)."""
        return WorkOptions(
            backend=self.backend,
            workers=self.workers,
            chunk_records=self.chunk_records,
            prefetch_chunks=self.prefetch_chunks,
            chunk_timeout=self.chunk_timeout,
            owner=self.owner,
        )

    @property
    def hold(self) -> HoldOptions:
        """The steps the owner holds (no byte bound: ``ahead`` and ``keep`` bound it)."""
        return HoldOptions(ahead=self.ahead, keep=self.keep, owner=self.owner)

    @property
    def resume(self) -> ResumeOptions:
        """What a state the owner resumes from may differ in (never the batch size: the
        owners' lanes are cut for one)."""
        return ResumeOptions(
            verify_resume=self.verify_resume,
            allow_mix_change=self.allow_mix_change,
            allow_code_change=self.allow_code_change,
            owner=self.owner,
        )

    @classmethod
    def of(
        cls,
        *,
        work: WorkOptions,
        hold: HoldOptions,
        resume: ResumeOptions,
        start_timeout: float = 120.0,
        orphan_timeout: float = 60.0,
        snapshot_dir: str | None = None,
        owner_cpus: float = 0.0,
        snapshot_every: int = 8,
        max_replacements: int = 3,
        owner: str = "lane owners",
    ) -> OwnerOptions:
        """An owner's options from an entry point's groups (its ``work``, ``hold`` and
        ``resume``); what an owner cannot do is refused by name: a byte bound on its held steps
        (``held_bytes``), another batch size on resume (``allow_batch_change``), a Ray address
        for its workers (they run on the owner's cluster)."""
        refused = {
            "held_bytes": (
                hold.held_bytes,
                f"each owner holds {flag_or_name(owner, 'ahead')} steps past its slowest reader and "
                f"{flag_or_name(owner, 'keep')} behind it: bound its memory with those",
            ),
            "allow_batch_change": (
                resume.allow_batch_change or None,
                "owners resume at the checkpoint's global_batch_size (resume on zf.Loader to change it)",
            ),
            "ray_address": (work.ray_address, "an owner's workers run on the Ray cluster the owner runs on"),
        }
        for name, (given, why) in refused.items():
            if given is not None:
                raise SpecError(f"{option_name(owner, name)} does not go with lane owners: {why}")
        return cls(
            backend=work.backend,
            workers=work.workers,
            chunk_records=work.chunk_records,
            prefetch_chunks=work.prefetch_chunks,
            chunk_timeout=work.chunk_timeout,
            ahead=hold.ahead,
            keep=hold.keep,
            verify_resume=resume.verify_resume,
            allow_mix_change=resume.allow_mix_change,
            allow_code_change=resume.allow_code_change,
            start_timeout=start_timeout,
            orphan_timeout=orphan_timeout,
            snapshot_dir=snapshot_dir,
            owner_cpus=owner_cpus,
            snapshot_every=snapshot_every,
            max_replacements=max_replacements,
            owner=owner,
        )
