"""Lane owners on Ray, side by side with their baselines in one run, reported as ratios.

Run from the repository root::

    .venv/bin/python -m bench.owners            # full run
    .venv/bin/python -m bench.owners --quick    # a small smoke run

On the demo pipeline (``zephon_flow.demo``: mix, tokenize, pack to 512, shuffle; 8 lanes,
global batch 32), one trainer rank (world size 1, so it needs every lane) reads:

- ``loader``: the embedded ``zf.Loader`` (inline backend), the reference;
- ``owned1`` / ``owned2``: ``zf.cluster.OwnedLoader`` with 1 and 2 lane owners (rows through
  Ray's object store);
- ``server``: one ``zephon serve`` (a ``BatchServer`` in a spawned process) read by ``zf.Client``;
- ``served2``: ``zephon serve --ray --lane-owners 2`` (``OwnersServer``) read by
  ``zf.Client(lane_owners=True)``: the rank's rows straight from the two owners over gRPC.

Each contender is started, warmed up (its first ``--warmup`` batches untimed), timed over
``--steps`` batches and stopped; each may run ``AHEAD`` = 4 steps ahead of its reader (the
server's window, the owners' ``ahead``; the Loader's prefetch is 2); contenders alternate within each repeat and medians over
repeats are reported. Ray runs locally with 2 CPUs. Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from bench.owners_speed import spawned_server, time_batches
from bench.stats import median

DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "owners.json")
TOKENS_PER_STEP = 32 * 512
#: Steps every contender may make ahead of its reader (server window, owners' ``ahead``): small,
#: so that what was made before the clock starts hardly counts.
AHEAD = 4


def contenders(root: str) -> dict[str, Callable[[], AbstractContextManager[Iterator[tuple[int, Any]]]]]:
    import zephon_flow as zf
    from zephon_flow.cluster.serve import OwnersServer
    from zephon_flow.demo import demo_spec

    spec = demo_spec(root)

    @contextmanager
    def loader() -> Iterator[Iterator[tuple[int, Any]]]:
        with zf.Loader(spec) as ld:
            yield iter(ld)

    def owned(n: int) -> Callable[[], AbstractContextManager[Iterator[tuple[int, Any]]]]:
        @contextmanager
        def run() -> Iterator[Iterator[tuple[int, Any]]]:
            with zf.cluster.OwnedLoader(spec, lane_owners=n, name=f"bench-owned-{n}", ahead=AHEAD) as ld:
                yield iter(ld)

        return run

    @contextmanager
    def server() -> Iterator[Iterator[tuple[int, Any]]]:
        with spawned_server(root, AHEAD, "inline", 1) as port, zf.Client(f"127.0.0.1:{port}", 0, 1) as client:
            yield iter(client)

    @contextmanager
    def served2() -> Iterator[Iterator[tuple[int, Any]]]:
        owners = OwnersServer(spec, owners=2, world_size=1, ahead=AHEAD, keep=AHEAD)
        try:
            with zf.Client(f"127.0.0.1:{owners.port}", 0, 1, lane_owners=True) as client:
                yield iter(client)
        finally:
            owners.stop()

    return {"loader": loader, "owned1": owned(1), "owned2": owned(2), "server": server, "served2": served2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="10 steps, 1 repeat")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 10, 2, 1

    from zephon_flow.demo_data import build_demo_data
    from zephon_flow.runners.ray_env import connect, disconnect_if_started

    data = build_demo_data(progress=True)
    started = connect("bench.owners", None, num_cpus=2)
    try:
        runs = contenders(data.root)
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for repeat in range(args.repeats):
            order = list(runs)
            order = order[repeat % len(order) :] + order[: repeat % len(order)]
            for name in order:
                with runs[name]() as batches:
                    seconds[name].append(time_batches(batches, args.warmup, args.steps))
                print(f"repeat {repeat}: {name}: {args.steps / seconds[name][-1]:.2f} batches/s", flush=True)
    finally:
        disconnect_if_started(started)
    rate = {name: args.steps / median(s) for name, s in seconds.items()}
    ratios = {
        "owned2_over_owned1": rate["owned2"] / rate["owned1"],
        "owned1_over_loader": rate["owned1"] / rate["loader"],
        "served2_over_server": rate["served2"] / rate["server"],
        "server_over_loader": rate["server"] / rate["loader"],
    }
    result = {
        "config": vars(args),
        "cpus": os.cpu_count(),
        "batches_per_second": rate,
        "tokens_per_second": {k: v * TOKENS_PER_STEP for k, v in rate.items()},
        "seconds": seconds,
        "ratios": ratios,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({"batches_per_second": rate, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
