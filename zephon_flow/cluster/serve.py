"""``zephon serve MODULE:SPEC --ray --lane-owners N``: lane owners on Ray, each serving its rows.

The serving process starts (or, with ``--address``, joins) Ray, starts the coordinator actor
and its N owners (each listening for ``StreamRows`` on ``--host``, port chosen freely), and
listens itself on ``--host:--port`` for the coordinator's calls (``Table``, ``Replace``,
``Progress``, ``Checkpoint``). Trainer ranks connect with ``zf.Client(address, rank,
world_size, lane_owners=True)``; their rows never pass through this process.
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
from zephon_flow.cluster.owner import OwnerOptions
from zephon_flow.cluster.serving import CoordinatorServer
from zephon_flow.core.errors import SpecError
from zephon_flow.core.state import load_state, to_loader_state
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.runners.ray_env import connect, disconnect_if_started, require_ray


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
        max_replacements: int = 3,
        owner_cpus: float = 0.0,
        verify_resume: bool = True,
    ) -> None:
        # Phases: check, connect to Ray, start the coordinator and its owners, listen.
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise SpecError(
                f"zephon serve --lane-owners needs --world-size (the trainer ranks), got {world_size!r}"
            )
        plan_owners(spec.lanes, owners)  # refused here, before Ray starts
        self.spec = spec
        state = None if resume is None else to_loader_state(load_state(resume))
        self._ray = require_ray(actors.FEATURE)
        self._started_ray = connect(actors.FEATURE, ray_address)
        self.name = f"zephon-serve-{uuid.uuid4().hex[:12]}"
        self._coordinator = actors.coordinator_handle(
            self.name,
            spec,
            owners=owners,
            world_size=world_size,
            state=state,
            options=OwnerOptions(
                backend=backend, workers=workers, ahead=ahead, keep=keep, verify_resume=verify_resume
            ),
            owner_cpus=owner_cpus,
            snapshot_every=snapshot_every,
            max_replacements=max_replacements,
            serve_host=host,
        )
        try:
            self._ray.get(self._coordinator.table.remote())  # the owners are up
        except self._ray.exceptions.RayTaskError as exc:
            self._shutdown()
            raise getattr(exc, "cause", exc) from None
        self._server = CoordinatorServer(
            spec,
            self._coordinator,
            world_size=world_size,
            host=host,
            port=port,
            checkpoint_dir=checkpoint_dir,
        )
        self.host, self.port = host, self._server.port

    def table(self) -> OwnerTable:
        """Which owner runs which lanes, and each owner's generation (bumped per replacement)."""
        table: OwnerTable = self._ray.get(self._coordinator.table.remote())
        return table

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


def serve(args: argparse.Namespace, spec: LoaderSpec) -> int:
    """Runs ``OwnersServer`` from ``zephon serve``'s arguments until SIGTERM or SIGINT."""
    refused = [
        name
        for name in ("tls_cert", "token_file", "checkpoint_every", "held_bytes")
        if getattr(args, name, None)
    ]
    if refused:
        raise SpecError(
            f"zephon serve --ray does not support --{refused[0].replace('_', '-')} yet: drop it, or "
            f"serve without --ray"
        )
    server = OwnersServer(
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
    )
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
    while not done.wait(0.2):
        pass
    server.stop()
    return 0
