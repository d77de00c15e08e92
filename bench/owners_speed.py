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
from contextlib import AbstractContextManager, ExitStack, contextmanager
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
}

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
        yield int(ports.get(timeout=300))
    finally:
        if proc.pid is not None:
            os.kill(proc.pid, 15)
        proc.join(timeout=10)


def time_batches(batches: Iterator[tuple[int, Any]], warmup: int, steps: int) -> float:
    """Seconds for ``steps`` batches after ``warmup`` untimed ones."""
    for _ in range(warmup):
        next(batches)
    start = time.perf_counter()
    for _ in range(steps):
        next(batches)
    return time.perf_counter() - start


def contenders(
    root: str, *, backend: str, workers: int, ahead: int, snapshot_every: int = 8
) -> dict[str, Contender]:
    import zephon_flow as zf
    from zephon_flow.cluster.serve import OwnersServer
    from zephon_flow.demo import demo_spec

    spec = demo_spec(root)

    @contextmanager
    def loader() -> Iterator[Iterator[tuple[int, Any]]]:
        with zf.Loader(spec, backend=backend, workers=workers) as ld:
            yield iter(ld)

    @contextmanager
    def owned1() -> Iterator[Iterator[tuple[int, Any]]]:
        with zf.cluster.OwnedLoader(
            spec,
            lane_owners=1,
            name="bench-owners-speed",
            ahead=ahead,
            backend=backend,
            workers=workers,
            snapshot_every=snapshot_every,
        ) as ld:
            yield iter(ld)

    @contextmanager
    def server() -> Iterator[Iterator[tuple[int, Any]]]:
        with (
            spawned_server(root, ahead, backend, workers) as port,
            zf.Client(f"127.0.0.1:{port}", 0, 1) as client,
        ):
            yield iter(client)

    def served(n: int) -> Contender:
        @contextmanager
        def run() -> Iterator[Iterator[tuple[int, Any]]]:
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
                with zf.Client(f"127.0.0.1:{owners.port}", 0, 1, lane_owners=True) as client:
                    yield iter(client)
            finally:
                owners.stop()

        return run

    return {"loader": loader, "owned1": owned1, "server": server, "served1": served(1), "served2": served(2)}


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
        )
        if args.only:
            runs = {name: runs[name] for name in args.only.split(",")}
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        with ExitStack() as stack:
            batches = {name: stack.enter_context(run()) for name, run in runs.items()}
            for round_ in range(args.rounds):
                order = list(runs)
                order = order[round_ % len(order) :] + order[: round_ % len(order)]
                for name in order:
                    seconds[name].append(time_batches(batches[name], args.warmup, args.steps))
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
    result = {
        "config": vars(args),
        "cpus": os.cpu_count(),
        "batches_per_second": rate,
        "tokens_per_second": {k: v * TOKENS_PER_STEP for k, v in rate.items()},
        "seconds": seconds,
        "ratios_per_round": per_round,
        "ratios": ratios,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({"batches_per_second": rate, "ratios": ratios, "per_round": per_round}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
