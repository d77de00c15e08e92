"""Lane owners scale where the work does: a stage that waits per record, on 1, 2 and 4 owners
spread over Ray's multi-node test cluster, against the embedded Loader (issue 29, item 5).

Run from the repository root::

    .venv/bin/python -m bench.owners_scaling            # 8 lanes, 4 threads per owner, owners 1,2,4
    .venv/bin/python -m bench.owners_scaling --quick    # a small smoke run

The pipeline reads JSONL records of ``--record-bytes`` characters and runs one stateless DoFn
that stands for a read from remote storage: it sleeps ``--wait`` seconds (20 ms) per record,
using no CPU, then yields the record's number and a CRC of its text. Each owner runs its lanes'
stateless work on ``--workers`` threads, so one owner waits for ``--workers`` records at a time
and ``n`` owners for ``n`` times as many: the ideal rate of ``n`` owners is
``n * workers / wait`` records a second. Records are 8 KB so that a chunk (closed at 128 KB of
input) holds 16 records, about a third of a second of waiting on one thread: steps arrive
steadily, and the read-ahead of each lane (8 chunks) keeps every thread of its owner busy.

Ray's multi-node test cluster (``ray.cluster_utils.Cluster``): a head with no CPU (the rank,
this process, and the coordinator) and ``--nodes`` worker nodes of ``--node-cpus`` logical
CPUs, every raylet on this machine and on loopback; each owner reserves one CPU, so Ray
spreads them over the nodes. One trainer rank (world size 1: every lane) reads
``zf.cluster.OwnedLoader(lane_owners=n)`` for each ``n`` of ``--owners``, the embedded
``zf.Loader`` with the same threads (``loader``, the reference of one owner), and the embedded
Loader with as many threads as the most owners have in all (``loader_wide``: what one process
gets when waiting is all the work there is). In each of
``--rounds`` rounds every contender in turn (the order rotating) is started, read for
``--warmup`` untimed steps and ``--steps`` timed ones, and closed; the digest of every step
read is kept, and all contenders must give the same digests (the promise: the bytes do not
depend on the owner count). Efficiency of ``n`` owners is ``rate(n) / (n * rate(1))``, the
median of the rounds' values, against the goal >= 0.8. Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np

from bench.stats import loadavg, machine, median, rotated

DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "owners_scaling.json")
#: Efficiency ``rate(n) / (n * rate(1))`` that issue 29 asks of the owners.
GOAL = 0.8

Batches = Iterator[tuple[int, Any]]
Contender = Callable[[], AbstractContextManager[tuple[Batches, dict[str, Any]]]]


class RemoteRead(beam.DoFn):  # type: ignore[misc]
    """Stands for a read from remote storage: waits ``wait`` seconds per record (sleeping, so
    it uses no CPU), then yields the record's number and a CRC of its text."""

    def __init__(self, wait: float) -> None:
        super().__init__()
        self.wait = wait

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        time.sleep(self.wait)
        yield {"doc": np.int64(int(text[:9])), "crc": np.int64(zlib.crc32(text.encode()))}


def write_records(root: str, count: int, size: int) -> str:
    """A JSONL file of ``count`` records whose text is ``size`` characters: a 9-digit number,
    a space and letters that depend on the number."""
    path = Path(root) / f"records-{count}x{size}.jsonl"
    letters = "abcdefghijklmnopqrstuvwxyz" * (size // 26 + 2)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            text = f"{i:09d} " + letters[i % 26 : i % 26 + max(0, size - 10)]
            f.write(json.dumps({"text": text}) + "\n")
    return str(path)


def scaling_spec(path: str, *, lanes: int, batch: int, wait: float) -> Any:
    """The pipeline: the records of ``path``, each through ``RemoteRead(wait)``."""
    import zephon_flow as zf
    from zephon_flow import operators as ops

    def build(p: beam.Pipeline) -> beam.PCollection:
        records = p | "read" >> ops.ReadJsonl(path, field="text")
        return records | "remote" >> beam.ParDo(RemoteRead(wait))

    return zf.LoaderSpec(build, lanes=lanes, seed=0, global_batch_size=batch)


@contextmanager
def test_cluster(nodes: int, node_cpus: int) -> Iterator[Any]:
    """Ray's multi-node test cluster, connected: a head with no CPU and ``nodes`` worker nodes
    of ``node_cpus`` CPUs, all on loopback (this machine's own address is not reachable, so Ray
    is told to resolve node addresses to loopback, as ``tests/test_multinode.py`` does).
    ``nodes=0``: the Ray this process is connected to, or else one local Ray node of
    ``node_cpus`` CPUs (quicker to start)."""
    import ray
    from ray import cluster_utils
    from ray._private import ray_constants

    if nodes == 0:
        from zephon_flow.runners.ray_env import connect, disconnect_if_started

        started = connect("bench.owners_scaling", None, num_cpus=node_cpus)
        try:
            yield None
        finally:
            disconnect_if_started(started)
        return
    if ray.is_initialized():
        ray.shutdown()
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        made = cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
        )
        try:
            for _ in range(nodes):
                made.add_node(num_cpus=node_cpus, node_ip_address="127.0.0.1")
            made.wait_for_nodes()
            ray.init(address=made.address, log_to_driver=False, configure_logging=False)
            try:
                yield made
            finally:
                ray.shutdown()
        finally:
            made.shutdown()  # type: ignore[no-untyped-call]
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def contenders(spec: Any, owners: list[int], *, workers: int, ahead: int) -> dict[str, Contender]:
    """``loader`` (embedded, ``workers`` threads), ``owners{n}`` for each ``n``, and
    ``loader_wide`` (embedded, as many threads as the most owners have in all): each yields
    its batches and what is known of where it ran."""
    import zephon_flow as zf

    def loader(threads: int) -> Contender:
        @contextmanager
        def run() -> Iterator[tuple[Batches, dict[str, Any]]]:
            with zf.Loader(spec, backend="threads", workers=threads) as ld:
                yield iter(ld), {"threads": threads}

        return run

    def owned(n: int) -> Contender:
        @contextmanager
        def run() -> Iterator[tuple[Batches, dict[str, Any]]]:
            with zf.cluster.OwnedLoader(
                spec,
                lane_owners=n,
                name=f"bench-owners-scaling-{n}-{os.getpid()}",
                backend="threads",
                workers=workers,
                owner_cpus=1,
                ahead=ahead,
                keep=ahead,
                prefetch=ahead,
            ) as ld:
                yield iter(ld), {"owner_nodes": ld.owner_nodes()}

        return run

    runs: dict[str, Contender] = {"loader": loader(workers)}
    runs.update({f"owners{n}": owned(n) for n in owners})
    runs["loader_wide"] = loader(workers * max(owners))
    return runs


def read_window(batches: Batches, warmup: int, steps: int) -> dict[str, Any]:
    """Reads ``warmup`` untimed and ``steps`` timed steps: their digests, the timed seconds,
    the two halves' seconds, and this process's CPU seconds over the timed steps."""
    from zephon_flow import batch_digest

    digests: list[str] = []
    for _ in range(warmup):
        digests.append(batch_digest(next(batches)[1]))
    start, cpu = time.perf_counter(), time.process_time()
    half = start
    for i in range(steps):
        digests.append(batch_digest(next(batches)[1]))
        if i + 1 == steps // 2:
            half = time.perf_counter()
    end = time.perf_counter()
    return {
        "digests": digests,
        "seconds": end - start,
        "halves": [half - start, end - half],
        "rank_cpu_seconds": time.process_time() - cpu,
    }


def _times(name: str, owners: list[int]) -> int:
    """How many owners' threads contender ``name`` waits with."""
    if name == "loader_wide":
        return max(owners)
    return int(name.removeprefix("owners")) if name.startswith("owners") else 1


def summarise(
    runs: dict[str, list[dict[str, Any]]], owners: list[int], *, steps: int, ideal_1: float
) -> dict[str, Any]:
    """Rates (median over rounds), per-round and median efficiencies, the digests' verdict."""
    rate = {name: median(steps / r["seconds"] for r in rs) for name, rs in runs.items()}
    first = f"owners{owners[0]}"
    efficiency: dict[str, Any] = {}
    for n in owners[1:]:
        per_round = [
            (steps / a["seconds"]) / (n / owners[0] * steps / b["seconds"])
            for a, b in zip(runs[f"owners{n}"], runs[first], strict=True)
        ]
        efficiency[f"owners{n}"] = {"median": median(per_round), "per_round": per_round}
    reference = runs["loader"][0]["digests"]
    same = all(r["digests"] == reference for rs in runs.values() for r in rs)
    return {
        "steps_per_second": rate,
        "of_ideal": {name: rate[name] / (ideal_1 * _times(name, owners)) for name in rate},
        "owners1_over_loader": rate[first] / rate["loader"] if owners[0] == 1 else None,
        "efficiency": efficiency,
        "goal": GOAL,
        "goal_met": all(e["median"] >= GOAL for e in efficiency.values()),
        "digests_equal": same,
        "steps_compared": len(reference),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--owners", default="1,2,4", help="owner counts, the first the reference")
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--workers", type=int, default=4, help="threads per owner (and the Loader's)")
    parser.add_argument("--wait", type=float, default=0.020, help="seconds the DoFn waits per record")
    parser.add_argument("--ahead", type=int, default=4, help="owners' ahead/keep and the rank's prefetch")
    parser.add_argument(
        "--nodes", type=int, default=3, help="worker nodes of the test cluster (0: one local Ray node)"
    )
    parser.add_argument("--node-cpus", type=int, default=2, help="logical CPUs per worker node")
    parser.add_argument("--records", type=int, default=4096)
    parser.add_argument("--record-bytes", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny run: local Ray, 2 owners, 2 ms")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.owners, args.nodes, args.lanes, args.batch, args.workers = "2", 0, 4, 8, 2
        args.wait, args.records, args.record_bytes = 0.002, 256, 1024
        args.steps, args.warmup, args.rounds = 4, 2, 1
    owners = [int(n) for n in args.owners.split(",")]

    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="zf-owners-scaling-") as root:
        path = write_records(root, args.records, args.record_bytes)
        spec = scaling_spec(path, lanes=args.lanes, batch=args.batch, wait=args.wait)
        started = time.perf_counter()
        with test_cluster(args.nodes, args.node_cpus):
            cluster_seconds = time.perf_counter() - started
            made = contenders(spec, owners, workers=args.workers, ahead=args.ahead)
            runs = {name: [] for name in made}
            for round_ in range(args.rounds):
                for name in rotated(list(made), round_):
                    load = loadavg()
                    begun = time.perf_counter()
                    with made[name]() as (batches, where):
                        window = read_window(batches, args.warmup, args.steps)
                    window.update(where, name=name, round=round_, loadavg=load)
                    window["total_seconds"] = time.perf_counter() - begun
                    runs[name].append(window)
                    print(
                        f"round {round_}: {name}: {args.steps / window['seconds']:.2f} steps/s "
                        f"(halves {window['halves'][0]:.2f} s, {window['halves'][1]:.2f} s)",
                        flush=True,
                    )
    ideal_1 = args.workers / args.wait / args.batch  # steps/s of one owner's threads, all waiting
    summary = summarise(runs, owners, steps=args.steps, ideal_1=ideal_1)
    result = {
        "config": vars(args),
        "machine": machine(),
        "cluster_start_seconds": cluster_seconds,
        "ideal_steps_per_second_per_owner": ideal_1,
        "runs": {
            name: [{k: v for k, v in r.items() if k != "digests"} for r in rs] for name, rs in runs.items()
        },
        **summary,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: summary[k] for k in summary}, default=str))
    if not summary["digests_equal"]:
        print("DIGESTS DIFFER between contenders: the stream depends on the owner count", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
