"""``zephon serve MODULE:SPEC --ray --lane-owners N``: lane owners on Ray, each serving its rows.

The serving process starts (or, with ``--address``, joins) Ray, starts the coordinator actor
and its N owners (each listening for ``StreamRows`` on ``--host``, port chosen freely), and
listens itself on ``--host:--port`` for the coordinator's calls (``Table``, ``Replace``,
``Progress``, ``Checkpoint``). Trainer ranks connect with ``zf.Client(address, rank,
world_size, lane_owners=True)``; their rows never pass through this process.

It is as guarded as ``zephon serve``: ``--token-file`` (or ``$ZEPHON_TOKEN``) and ``--tls-cert``/
``--tls-key`` hold on the coordinator's endpoint and on every owner's; requests are checked
against the run before any work (``serving.py``). When the run cannot go on (an owner lost past
``max_replacements``, the coordinator gone), health turns NOT_SERVING and the process exits
with status 3 (``EXIT_PIPELINE_FAILED``), for a supervisor to restart it with ``--resume``.

``--resume CHECKPOINT --allow-mix-change`` takes a pipeline whose ``Mix`` differs only in its
weights, schedule or interpolation, from the checkpoint's step on (each owner and the
coordinator restore the changed mixture, as ``zf.Loader`` does). A mixture change while the
run goes on (``zephon mix``, the coordinator's ``ChangeMixture``) reaches every owner in two
phases (``Coordinator.change_mixture``).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import uuid
from typing import Any

from zephon_flow.cluster import actors
from zephon_flow.cluster.coordinator import OwnerTable, plan_owners
from zephon_flow.cluster.serving import CoordinatorServer, Serving
from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.checkpoint.store import load_state, to_loader_state
from zephon_flow.core.clock import SYSTEM_CLOCK
from zephon_flow.core.errors import FingerprintMismatchError, SpecError
from zephon_flow.engine.loader import restore_lanes
from zephon_flow.engine.options import (
    CheckpointOptions,
    EndpointOptions,
    HoldOptions,
    OwnerOptions,
    ResumeOptions,
    WorkOptions,
)
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.runners.ray_env import connect, disconnect_if_started, require_ray
from zephon_flow.service import auth
from zephon_flow.service.mixing import naming_the_flag
from zephon_flow.service.server import SERVE, exit_status


class OwnersServer:
    """The coordinator's endpoint and the Ray lane owners behind it (``start``/``stop``)."""

    def __init__(
        self,
        spec: LoaderSpec,
        *,
        owners: int,
        world_size: int,
        ray_address: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        resume: str | None = None,
        checkpoint_dir: str | None = None,
        backend: str = "inline",
        workers: int = 1,
        ahead: int = 8,
        keep: int = 8,
        snapshot_every: int = 8,
        snapshot_dir: str | None = None,
        max_replacements: int = 3,
        owner_cpus: float = 0.0,
        verify_resume: bool = True,
        allow_mix_change: bool = False,
        token: str | None = None,
        tls: tuple[str, str] | None = None,
        stream_timeout: float = 300.0,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
        max_client_calls: int = 16,
    ) -> None:
        # Phases: check, connect to Ray, start the coordinator and its owners, listen.
        _check_topology(spec, owners, world_size)  # refused here, before Ray starts
        endpoint = EndpointOptions(
            host=host, port=port, token=token, tls=tls, stream_timeout=stream_timeout, owner=SERVE
        )
        checkpoints = CheckpointOptions(
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            owner=SERVE,
        )
        options = OwnerOptions.of(
            work=WorkOptions(backend=backend, workers=workers, owner=SERVE),
            hold=HoldOptions(ahead=ahead, keep=keep, owner=SERVE),
            resume=ResumeOptions(verify_resume=verify_resume, allow_mix_change=allow_mix_change, owner=SERVE),
            owner_cpus=owner_cpus,
            snapshot_every=snapshot_every,
            snapshot_dir=snapshot_dir,
            max_replacements=max_replacements,
            owner=SERVE,
        )
        serving = _serving(spec, endpoint, checkpoints, world_size=world_size, calls=max_client_calls)
        self.spec, state = spec, _resumed(spec, resume, allow_mix_change=allow_mix_change)
        self._start_coordinator(
            ray_address, owners=owners, world_size=world_size, state=state, options=options, serving=serving
        )
        self._listen(owners, serving, endpoint.port, checkpoints)

    def _start_coordinator(self, ray_address: str | None, **options: Any) -> None:
        """Connects to Ray (``ray_address``) and starts the coordinator actor, which starts
        the owners (``options``: ``actors.coordinator_handle``'s)."""
        self._ray = require_ray(actors.FEATURE)
        self._started_ray = connect(actors.FEATURE, ray_address)
        self.name = f"zephon-serve-{uuid.uuid4().hex[:12]}"
        self._coordinator = actors.coordinator_handle(self.name, self.spec, **options)

    def _listen(self, owners: int, serving: Serving, port: int, checkpoints: CheckpointOptions) -> None:
        """Once the owners are up, the coordinator's endpoint on ``serving.host:port``; on a
        failure of either, the coordinator and its owners are ended."""
        try:
            self._ray.get(self._coordinator.table.remote())  # the owners are up
        except self._ray.exceptions.RayTaskError as exc:
            self._shutdown()
            raise getattr(exc, "cause", exc) from None
        try:
            self._server = CoordinatorServer(
                self.spec,
                self._coordinator,
                owners=owners,
                serving=serving,
                port=port,
                **checkpoints.kwargs(),
            )
        except BaseException:
            self._shutdown()
            raise
        self.host, self.port = serving.host, self._server.port

    def table(self) -> OwnerTable:
        """Which owner runs which lanes, and each owner's generation (bumped per replacement)."""
        table: OwnerTable = self._ray.get(self._coordinator.table.remote())
        return table

    @property
    def failed(self) -> str | None:
        """Why the run cannot go on (None while it can)."""
        return self._server.failed

    def told_every_rank(self) -> bool:
        """Whether every rank has been answered with the run's failure."""
        return self._server.told_every_rank()

    def poll(self) -> str | None:
        """Checks the coordinator still answers; returns ``failed``."""
        self._server.poll()
        return self._server.failed

    def owner_pids(self) -> list[int]:
        """The process id of each owner (for fault tests and monitoring)."""
        return [int(self._ray.get(h.pid.remote())) for h in self.table().handles]

    def _shutdown(self) -> None:
        with contextlib.suppress(Exception):  # the coordinator is gone already, with its owners
            self._ray.get(self._coordinator.shutdown.remote(), timeout=60)
        self._ray.kill(self._coordinator)
        disconnect_if_started(self._started_ray)

    def stop(self) -> None:
        self._server.stop()
        self._shutdown()


def _check_topology(spec: LoaderSpec, owners: int, world_size: int) -> None:
    """Refuses a world size or an owner count that cannot run ``spec``'s lanes."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise SpecError(
            f"zephon serve --lane-owners needs --world-size (the trainer ranks), got {world_size!r}"
        )
    plan_owners(spec.lanes, owners)


def _serving(
    spec: LoaderSpec,
    endpoint: EndpointOptions,
    checkpoints: CheckpointOptions,
    *,
    world_size: int,
    calls: int,
) -> Serving:
    """How the coordinator's and the owners' endpoints serve: ``endpoint`` with the TLS files
    read here (they are shipped to the owners, which may run on other nodes), at most ``calls``
    open calls per client; ranks may come back ``--checkpoint-every`` steps past a resumed
    checkpoint."""
    cert, key = (None, None) if endpoint.tls is None else auth.read_tls(*endpoint.tls)
    return Serving(
        host=endpoint.host,
        world_size=world_size,
        token=None if endpoint.token is None else auth.clean_token(endpoint.token, SERVE),
        tls_cert=cert,
        tls_key=key,
        stream_timeout=endpoint.stream_timeout,
        max_client_calls=calls,
        fingerprint=spec.fingerprint["total"],
        replay=checkpoints.checkpoint_every or 0,
    )


def _resumed(spec: LoaderSpec, resume: str | None, *, allow_mix_change: bool) -> LoaderState | None:
    """The state of checkpoint ``resume`` (None: the start), refused here, before Ray starts,
    if it is another pipeline's (``_check_resume``)."""
    state = (
        None if resume is None else to_loader_state(load_state(resume, codecs=spec.compile().derived_codecs))
    )
    _check_resume(spec, state, allow_mix_change=allow_mix_change)
    return state


def _check_resume(spec: LoaderSpec, state: LoaderState | None, *, allow_mix_change: bool) -> None:
    """Refuses a checkpoint of another pipeline (a changed mixture without
    ``allow_mix_change``: the error names ``--allow-mix-change``) in this process, as the
    coordinator would in its actor."""
    if state is None:
        return
    try:
        restore_lanes(
            spec,
            spec.compile(),
            state,
            [],
            who="zephon serve --ray",
            allow_mix_change=allow_mix_change,
            rebuild_recipes=False,
            verify=False,
            quiet=True,
        )
    except FingerprintMismatchError as exc:
        raise naming_the_flag(exc, "zephon serve --ray") from exc


#: How often ``serve`` checks that the coordinator still answers (seconds).
POLL_SECONDS = 5.0


def _server_of(args: argparse.Namespace, spec: LoaderSpec) -> OwnersServer:
    """``OwnersServer`` from ``zephon serve --ray``'s arguments (refusing those it cannot take)."""
    if getattr(args, "held_bytes", None):
        raise SpecError(
            "zephon serve --ray does not support --held-bytes: each owner holds --ahead steps past its "
            "slowest reader and --keep behind it; bound memory with those"
        )
    if (getattr(args, "tls_cert", None) is None) != (getattr(args, "tls_key", None) is None):
        raise SpecError("zephon serve: --tls-cert and --tls-key go together")
    return OwnersServer(
        spec,
        owners=args.lane_owners,
        world_size=args.world_size,
        ray_address=args.ray_address,
        host=args.host,
        port=args.port,
        resume=args.resume,
        checkpoint_dir=args.checkpoint_dir,
        backend=args.backend,
        workers=args.workers,
        ahead=args.ahead,
        keep=args.keep,
        verify_resume=not getattr(args, "no_verify_resume", False),
        allow_mix_change=getattr(args, "allow_mix_change", False),
        token=auth.read_token(getattr(args, "token_file", None)),
        tls=(args.tls_cert, args.tls_key) if getattr(args, "tls_cert", None) else None,
        stream_timeout=getattr(args, "stream_timeout", 300.0),
        checkpoint_every=getattr(args, "checkpoint_every", None),
        keep_checkpoints=getattr(args, "keep_checkpoints", 3),
        max_replacements=getattr(args, "max_replacements", 3),
        snapshot_dir=getattr(args, "snapshot_dir", None),
    )


def serve(args: argparse.Namespace, spec: LoaderSpec) -> int:
    """Runs ``OwnersServer`` from ``zephon serve``'s arguments until SIGTERM or SIGINT (status
    0), or until the run cannot go on (status ``EXIT_PIPELINE_FAILED``)."""
    server = _server_of(args, spec)
    done = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    print(f"zephon serve: listening on {server.host}:{server.port}", flush=True)
    print(
        f"zephon serve: {args.lane_owners} lane owners on Ray; clients: zf.Client(address, rank, "
        f"world_size={args.world_size}, lane_owners=True); fingerprint {spec.fingerprint['total']}",
        file=sys.stderr,
        flush=True,
    )
    # Waits for a signal (real time: it comes from outside), and asks the coordinator every
    # POLL_SECONDS on the clock; what the server's own calls find (``failed``) is seen at once.
    failed, asked = None, SYSTEM_CLOCK.now()
    while failed is None and not done.wait(0.2):
        if SYSTEM_CLOCK.now() - asked >= POLL_SECONDS:
            failed, asked = server.poll(), SYSTEM_CLOCK.now()
        else:
            failed = server.failed
    # Asked once more before stopping, whatever ended the wait: a signal that came after a
    # failure this loop had not seen yet still exits as a failure (as zephon serve does).
    return exit_status(
        failed or server.failed, "the run cannot go on", done, server.stop, told=server.told_every_rank
    )
