"""Lane owners against one process, side by side in one run, reported as ratios (issue 29, item 5).

Run from the repository root::

    .venv/bin/python -m bench.owners_speed                      # inline backend, 1 worker
    .venv/bin/python -m bench.owners_speed --backend threads --workers 2
    .venv/bin/python -m bench.owners_speed --quick              # a small smoke run

On the demo pipeline (``zephon_flow.demo``: mix, tokenize, pack to 512, shuffle; 8 lanes,
global batch 32), one trainer rank (world size 1: every lane) reads, with the same
``--backend`` and ``--workers`` everywhere:

- ``loader``: the embedded ``zf.Loader``, the reference of ``owned1``;
- ``owned1``: ``zf.cluster.OwnedLoader(lane_owners=1)``: the same lanes in one Ray actor;
- ``server``: one ``zephon serve`` (a ``BatchServer`` in a spawned process) read by
  ``zf.Client``, the reference of the served owners;
- ``served1`` / ``served2``: ``zephon serve --ray --lane-owners 1 / 2`` (``OwnersServer``) read
  by ``zf.Client(lane_owners=True)``: the rank's rows straight from the owners over gRPC.

Every contender may run ``--ahead`` steps past its reader. The owners' coordinator gathers
every lane's snapshot every ``--snapshot-every`` steps (what a dead owner is replaced from; the
embedded ``Loader`` and ``zephon serve`` pay no such cost): a larger value shows what the
gathers cost. All are started first and stay open;
then, in each of ``--rounds`` rounds, each contender in turn (the order rotating between rounds)
is read for a window: ``--warmup`` batches untimed (more than it can have made ahead, so the
window times its steady rate, not a buffer), then ``--steps`` batches timed. So the contenders
of one ratio are timed seconds apart, many times over; the machine is shared and its speed
drifts, so each ratio reported is the median over rounds of that round's ratio. Ray runs
locally with 2 CPUs. Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from bench.stats import median

DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "owners_speed.json")
TOKENS_PER_STEP = 32 * 512
#: (numerator, denominator) of each reported ratio.
RATIOS = {
    "owned1_over_loader": ("owned1", "loader"),
    "served1_over_server": ("served1", "server"),
    "served2_over_server": ("served2", "server"),
    "owned1_pickled_over_loader": ("owned1_pickled", "loader"),
    "served1_pickled_over_server": ("served1_pickled", "server"),
    "owned1_over_owned1_pickled": ("owned1", "owned1_pickled"),
    "served1_over_served1_pickled": ("served1", "served1_pickled"),
}

#: pid -> what it is (``owned1 owner 0``, ``server``...): the contenders' processes, by name.
LABELS: dict[int, str] = {}

Contender = Callable[[], AbstractContextManager[Iterator[tuple[int, Any]]]]


def _serve_loader(root: str, ahead: int, backend: str, workers: int, ports: Any) -> None:
    from zephon_flow.demo import demo_spec
    from zephon_flow.service.server import BatchServer

    server = BatchServer(demo_spec(root), ahead=ahead, backend=backend, workers=workers).start()
    ports.put(server.port)
    server.wait()


@contextmanager
def spawned_server(root: str, ahead: int, backend: str, workers: int) -> Iterator[int]:
    ctx = get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_serve_loader, args=(root, ahead, backend, workers, ports), daemon=True)
    proc.start()
    try:
        port = int(ports.get(timeout=300))
        if proc.pid is not None:
            LABELS[proc.pid] = "server"
        yield port
    finally:
        if proc.pid is not None:
            os.kill(proc.pid, 15)
        proc.join(timeout=10)


def time_batches(
    batches: Iterator[tuple[int, Any]], warmup: int, steps: int, cpu: CpuMeter | None = None
) -> float:
    """Seconds for ``steps`` batches after ``warmup`` untimed ones (with ``cpu``, the CPU time
    each process spent over the same window is read from ``/proc`` before and after)."""
    for _ in range(warmup):
        next(batches)
    before = cpu.read() if cpu is not None else None
    start = time.perf_counter()
    for _ in range(steps):
        next(batches)
    seconds = time.perf_counter() - start
    if cpu is not None and before is not None:
        cpu.add(before, cpu.read())
    return seconds


class CpuMeter:
    """CPU time (user + system, from ``/proc``) of every process in this one's tree (Ray's
    daemons and workers, a spawned server), grouped by role: ``rank`` (this process), the
    processes the contenders named in ``LABELS`` (``owned1 owner 0``, ``served1 coordinator``,
    ``server``...) with their worker processes, and ``ray`` (Ray's daemons and idle workers).
    Idle contenders' processes are in the tree too: their share shows what waiting costs."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self._roles: dict[int, str] = {}
        self.totals: list[dict[str, float]] = []

    def _role(self, proc: Any) -> str:
        role = self._roles.get(proc.pid)
        if role is not None and role != "ray":
            return role
        try:
            parent = proc.ppid()
        except self._psutil.Error:
            return role or "ray"
        if proc.pid == self._me.pid:
            role = "rank"
        elif proc.pid in LABELS:
            role = LABELS[proc.pid]
        elif self._roles.get(parent, "ray") not in ("ray", "rank"):
            role = self._roles[parent]  # a worker process of an owner or of the server
        else:
            role = "ray"
        self._roles[proc.pid] = role
        return role

    def read(self) -> dict[int, tuple[str, float]]:
        out: dict[int, tuple[str, float]] = {}
        for proc in [self._me, *self._me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                out[proc.pid] = (self._role(proc), t.user + t.system)
            except self._psutil.Error:
                continue
        return out

    def add(self, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> None:
        by_role: dict[str, float] = {}
        for pid, (role, seconds) in after.items():
            spent = seconds - before.get(pid, (role, 0.0))[1]
            by_role[role] = by_role.get(role, 0.0) + spent
        self.totals.append(by_role)


@contextmanager
def snapshots_pickled() -> Iterator[None]:
    """Coordinators started meanwhile gather their owners' snapshots as before packed
    snapshots (``cluster/snapshots.py``): every lane's ``LaneState``s pickled by Ray in the owner
    and unpickled in the coordinator at each gather (a subclass with no ``pack``; the owners
    and everything else are the same)."""
    from zephon_flow.cluster import actors

    base = actors.CoordinatorActor

    class PickledSnapshots(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._coordinator._pack = None

    actors.CoordinatorActor = PickledSnapshots  # type: ignore[misc]
    try:
        yield
    finally:
        actors.CoordinatorActor = base  # type: ignore[misc]


def contenders(
    root: str, *, backend: str, workers: int, ahead: int, snapshot_every: int = 8, before: bool = False
) -> dict[str, Contender]:
    """The contenders by name; with ``before``, also ``owned1_pickled`` and ``served1_pickled``:
    ``owned1`` and ``served1`` with the snapshot gathers as they were (``snapshots_pickled``)."""
    import zephon_flow as zf
    from zephon_flow.cluster.serve import OwnersServer
    from zephon_flow.demo import demo_spec

    spec = demo_spec(root)

    @contextmanager
    def loader() -> Iterator[Iterator[tuple[int, Any]]]:
        with zf.Loader(spec, backend=backend, workers=workers) as ld:
            yield iter(ld)

    def owned(pickled: bool) -> Contender:
        label = "owned1_pickled" if pickled else "owned1"

        @contextmanager
        def run() -> Iterator[Iterator[tuple[int, Any]]]:
            with snapshots_pickled() if pickled else nullcontext():
                ld = zf.cluster.OwnedLoader(
                    spec,
                    lane_owners=1,
                    name=f"bench-owners-speed-{label}",
                    ahead=ahead,
                    backend=backend,
                    workers=workers,
                    snapshot_every=snapshot_every,
                )
            with ld:
                _label(label, ld._coordinator, ld._table.handles)
                yield iter(ld)

        return run

    @contextmanager
    def server() -> Iterator[Iterator[tuple[int, Any]]]:
        with (
            spawned_server(root, ahead, backend, workers) as port,
            zf.Client(f"127.0.0.1:{port}", 0, 1) as client,
        ):
            yield iter(client)

    def served(n: int, pickled: bool = False) -> Contender:
        label = f"served{n}_pickled" if pickled else f"served{n}"

        @contextmanager
        def run() -> Iterator[Iterator[tuple[int, Any]]]:
            with snapshots_pickled() if pickled else nullcontext():
                owners = OwnersServer(
                    spec,
                    owners=n,
                    world_size=1,
                    ahead=ahead,
                    keep=ahead,
                    backend=backend,
                    workers=workers,
                    snapshot_every=snapshot_every,
                )
            try:
                _label(label, owners._coordinator, owners.table().handles)
                with zf.Client(f"127.0.0.1:{owners.port}", 0, 1, lane_owners=True) as client:
                    yield iter(client)
            finally:
                owners.stop()

        return run

    runs = {
        "loader": loader,
        "owned1": owned(False),
        "server": server,
        "served1": served(1),
        "served2": served(2),
    }
    if before:
        runs["owned1_pickled"] = owned(True)
        runs["served1_pickled"] = served(1, True)
    return runs


def _label(contender: str, coordinator: Any, owners: Any) -> None:
    """Names a contender's coordinator and owner processes in ``LABELS``."""
    import ray

    LABELS[int(ray.get(coordinator.pid.remote()))] = f"{contender} coordinator"
    for i, handle in enumerate(owners):
        LABELS[int(ray.get(handle.pid.remote()))] = f"{contender} owner {i}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ahead", type=int, default=8)
    parser.add_argument("--backend", default="inline")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--snapshot-every",
        type=int,
        default=8,
        help="steps between the coordinator's gathers of the owners' lane snapshots (the owners' default 8)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="also report CPU ms per step of each process group (from /proc) over the timed windows",
    )
    parser.add_argument(
        "--before",
        action="store_true",
        help="also owned1_pickled and served1_pickled: the snapshot gathers as before packed snapshots",
    )
    parser.add_argument("--only", default="", help="comma-separated contenders (default: all)")
    parser.add_argument("--quick", action="store_true", help="10 steps, 2 rounds")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds = 10, 12, 2

    from zephon_flow.demo_data import build_demo_data
    from zephon_flow.runners.ray_env import connect, disconnect_if_started

    data = build_demo_data(progress=True)
    started = connect("bench.owners_speed", None, num_cpus=2)
    try:
        runs = contenders(
            data.root,
            backend=args.backend,
            workers=args.workers,
            ahead=args.ahead,
            snapshot_every=args.snapshot_every,
            before=args.before,
        )
        if args.only:
            runs = {name: runs[name] for name in args.only.split(",")}
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        meter = CpuMeter() if args.cpu else None
        cpu: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
        with ExitStack() as stack:
            batches = {name: stack.enter_context(run()) for name, run in runs.items()}
            for round_ in range(args.rounds):
                order = list(runs)
                order = order[round_ % len(order) :] + order[: round_ % len(order)]
                for name in order:
                    seconds[name].append(time_batches(batches[name], args.warmup, args.steps, meter))
                    if meter is not None:
                        cpu[name].append(meter.totals[-1])
                print(
                    f"round {round_}: "
                    + ", ".join(f"{name} {args.steps / seconds[name][-1]:.1f}" for name in runs)
                    + " batches/s",
                    flush=True,
                )
    finally:
        disconnect_if_started(started)
    rate = {name: args.steps / median(s) for name, s in seconds.items()}
    per_round = {
        key: [den_s / num_s for num_s, den_s in zip(seconds[num], seconds[den], strict=True)]
        for key, (num, den) in RATIOS.items()
        if num in seconds and den in seconds
    }
    ratios = {key: median(values) for key, values in per_round.items()}
    # Per contender and process group: the median over rounds of CPU ms per timed step.
    cpu_ms = {
        name: {
            role: round(median([r.get(role, 0.0) for r in rounds]) * 1e3 / args.steps, 2)
            for role in sorted({role for r in rounds for role in r})
        }
        for name, rounds in cpu.items()
        if rounds
    }
    result = {
        "config": vars(args),
        "cpus": os.cpu_count(),
        "batches_per_second": rate,
        "tokens_per_second": {k: v * TOKENS_PER_STEP for k, v in rate.items()},
        "seconds": seconds,
        "ratios_per_round": per_round,
        "ratios": ratios,
        "cpu_ms_per_step": cpu_ms,
        "load_average": os.getloadavg(),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({"batches_per_second": rate, "ratios": ratios, "per_round": per_round}, indent=2))
    for name, roles in cpu_ms.items():
        shown = {role: ms for role, ms in roles.items() if ms >= 0.05}
        print(f"cpu ms/step {name}: total {sum(roles.values()):.2f}; {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
