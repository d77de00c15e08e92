"""Checkpoints of lane owners with large lane state: how long ``OwnedLoader.checkpoint()``,
``zf.save_state`` and a rank's ``state_dict()`` take, what is written, and the peak memory of
the coordinator actor and of the rank (issue 29, item 3: today's baseline).

Run from the repository root::

    .venv/bin/python -m bench.owners_checkpoint                    # 64 lanes x 8 MB, 4 owners
    .venv/bin/python -m bench.owners_checkpoint --state-mb 2,4,8   # a sweep: how it grows
    .venv/bin/python -m bench.owners_checkpoint --quick            # a small smoke run

The pipeline: small JSONL records, each made into a sequence of ``--seq-len`` random int32
token ids (seeded by the record; 64 KB at 16,384), then ``ops.Shuffle`` with a buffer of
``state-mb`` MiB of sequences per lane: a lane's state is its shuffle buffer, ``--state-mb``
MiB. ``--lanes`` lanes run on ``--owners`` lane owners (``zf.cluster.OwnedLoader``, inline
backend, a local Ray of 2 CPUs), read by ``--world-size`` ranks, all in this process, each
for ``--steps`` steps (every rank reports its progress each ``snapshot_every`` = 8 steps; the
coordinator then gathers every owner's lane snapshots and keeps them: the coordinator's RSS
*at rest* is read once that gather is over). Then, ``--repeats`` times each, one at a time:

- ``checkpoint``: rank 0's ``OwnedLoader.checkpoint()`` (every lane, through the
  coordinator), its seconds and the peak RSS of the coordinator's process and of the rank's
  (this process) while it ran (Linux ``VmHWM``, reset before through ``/proc/PID/clear_refs``);
- ``save``: ``zf.save_state`` of that state to a file: seconds, bytes written, the rank's peak;
- ``state_dict``: rank 0's ``state_dict()`` (its own lanes, which today costs a checkpoint
  of every lane): seconds, lanes in it, the coordinator's and the rank's peaks;
- ``loader`` (unless ``--no-loader``), the reference: the embedded ``zf.Loader`` of one rank
  (every lane, in this process) run to the same step, its ``state()`` (what ``state_dict()``
  makes plain) and ``zf.save_state`` of it, and this process's peak RSS meanwhile.

Also the owners' RSS. The JSON line gives the median seconds and the largest peaks of the
repeats. The coordinator's process is found among this process's
descendants by its title (``ray::CoordinatorActor``); ``ray.util.state`` needs Ray's dashboard,
which is off. Memory on this machine (24 GiB shared by several agents) caps the size: 64
lanes x 32 MB is about 2 GiB of state, held by the owners, by the coordinator, gathered again
by a checkpoint and returned to the rank; keep the total state under about 1 GiB here.

A checkpoint is taken through one function, ``take_checkpoint``, two ways: ``gather``
(today's: ``checkpoint()`` brings every lane through the coordinator to the rank, then
``zf.save_state``) and, where ``OwnedLoader.save_checkpoint`` exists, ``parts`` (each owner
writes its lanes' part, the coordinator a manifest), each ``--repeats`` times with the same
peaks measured.
The last line printed is one JSON line with every number; the file ``--out`` holds the same.
Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np

from bench.stats import loadavg, machine, median

DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "owners_checkpoint.json")
MIB = 1 << 20
#: Token ids drawn below this (GPT-2's vocabulary): values as a tokenizer makes them.
VOCAB = 50257


class MakeSequence(beam.DoFn):  # type: ignore[misc]
    """A record (its number, then filler) -> a sequence of ``length`` int32 token ids drawn
    from a generator keyed by the number: what tokenizing and packing would make, without the
    work."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        rng = np.random.Generator(np.random.Philox(key=int(text.split(" ", 1)[0])))
        yield {"input_ids": rng.integers(0, VOCAB, self.length, dtype=np.int32)}


def write_records(root: str, count: int, size: int) -> str:
    """``count`` records of ``size`` characters: a number, a space, filler. Records the size
    of a document make a chunk of read-ahead (closed at 128 KB of input) a few dozen
    sequences, not 256: the owners' read-ahead then stays small next to the lanes' state."""
    path = Path(root) / f"numbers-{count}x{size}.jsonl"
    filler = "x" * max(0, size - 10)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            f.write(json.dumps({"text": f"{i} {filler}"}) + "\n")
    return str(path)


def checkpoint_spec(path: str, *, lanes: int, batch: int, seq_len: int, buffer: int) -> Any:
    """The records of ``path`` made into sequences, shuffled with ``buffer`` of them per lane."""
    import zephon_flow as zf
    from zephon_flow import operators as ops

    def build(p: beam.Pipeline) -> beam.PCollection:
        records = p | "read" >> ops.ReadJsonl(path, field="text")
        seqs = records | "make" >> beam.ParDo(MakeSequence(seq_len))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=buffer))

    return zf.LoaderSpec(build, lanes=lanes, seed=0, global_batch_size=batch)


# -- memory of a process ---------------------------------------------------------------------
def memory(pid: int) -> dict[str, int]:
    """A process's ``VmRSS``, ``VmHWM`` (peak RSS since the last reset), ``RssAnon`` and
    ``RssShmem`` (Ray's object store pages it maps), in bytes, from ``/proc/PID/status``."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int) -> bool:
    """Resets a process's ``VmHWM`` to its current RSS (Linux 4.0+); False if refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def coordinator_pid() -> int:
    """The process of this run's coordinator actor: a descendant of this process (the local
    Ray it started) titled ``ray::CoordinatorActor``."""
    import psutil

    found: list[int] = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if cmdline and cmdline[0].startswith("ray::CoordinatorActor"):
            found.append(proc.pid)
    if len(found) != 1:
        raise RuntimeError(
            f"expected one coordinator process among this process's descendants, found {found}"
        )
    return found[0]


def object_store_mib() -> int | None:
    """MiB in use in Ray's object store (every node), from Ray's memory summary (an internal
    API: None where it is not there). Objects a process reads are mapped, not copied, so its
    RSS does not show them until it touches their pages: the store is counted on its own."""
    import ray

    try:
        from ray._private.internal_api import memory_summary

        text = memory_summary(  # type: ignore[no-untyped-call]
            address=ray.get_runtime_context().gcs_address, stats_only=True
        )
    except Exception:
        return None
    found = re.search(r"Plasma memory usage (\d+) MiB", text)
    return int(found.group(1)) if found else None


class Peaks:
    """The peak memory of some processes over a block of work: ``with Peaks(pids) as p: ...``,
    then ``p.peak[pid]`` (``VmHWM``, bytes), ``p.most[pid]`` (the largest ``RssAnon`` and
    ``RssShmem`` sampled every 20 ms), ``p.before[pid]`` (their memory when it began) and
    ``p.store`` (the object store's MiB before and the most sampled every 0.2 s)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.before: dict[int, dict[str, int]] = {}
        self.peak: dict[int, int] = {}
        self.most: dict[int, dict[str, int]] = {pid: {"RssAnon": 0, "RssShmem": 0} for pid in pids}
        self.store: dict[str, int | None] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        ticks, most_store = 0, self.store["before"]
        while not self._done.wait(0.02):
            for pid in self.pids:
                now = memory(pid)
                for key in ("RssAnon", "RssShmem"):
                    self.most[pid][key] = max(self.most[pid][key], now[key])
            ticks += 1
            if ticks % 10 == 0:
                store = object_store_mib()
                if store is not None:
                    most_store = max(most_store or 0, store)
        self.store["most"] = most_store

    def __enter__(self) -> Peaks:
        gc.collect()
        for pid in self.pids:
            if not reset_peak(pid):
                raise RuntimeError(f"cannot reset the peak RSS of process {pid} (/proc/{pid}/clear_refs)")
            self.before[pid] = memory(pid)
        self.store["before"] = object_store_mib()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        for pid in self.pids:
            self.peak[pid] = memory(pid)["VmHWM"]
        self.store["after"] = object_store_mib()


def state_bytes(value: Any) -> int:
    """The bytes of the arrays and byte strings in a plain-data tree (a state's payload)."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, bytes | bytearray):
        return len(value)
    if isinstance(value, dict):
        return sum(state_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(state_bytes(v) for v in value)
    if hasattr(value, "__dict__"):
        return state_bytes(vars(value))
    return 0


# -- the measurement -------------------------------------------------------------------------
def take_checkpoint(loader: Any, directory: str, way: str) -> tuple[Any, dict[str, Any]]:
    """A checkpoint of every lane from a rank, written to ``directory``, one of two ways:
    ``gather``, ``checkpoint()`` (every lane through the coordinator to the rank) then
    ``zf.save_state``; ``parts``, ``save_checkpoint(path)`` where the owners have it (each
    owner writes its lanes' part, the coordinator a manifest). Returns the state (``gather``)
    or None, and the numbers."""
    import zephon_flow as zf

    path = os.path.join(directory, "checkpoint.zf")
    start = time.perf_counter()
    state, stats = None, None
    if way == "gather":
        state = loader.checkpoint()
        gathered = time.perf_counter()
        stats = zf.save_state(state, path)
    else:
        loader.save_checkpoint(path)
        gathered = start
    saved = time.perf_counter()
    files = [p for p in Path(directory).rglob("*") if p.is_file()]
    return state, {
        "way": way,
        "checkpoint_seconds": gathered - start,
        "save_seconds": saved - gathered,
        "total_seconds": saved - start,
        "files": len(files),
        "bytes_on_disk": sum(p.stat().st_size for p in files),
        "written": None if stats is None else stats.written,
        "uncompressed": None if stats is None else stats.uncompressed,
        "raw_bytes": None if stats is None else stats.raw_bytes,
    }


def settled(pid: int, *, quiet: float = 3.0, timeout: float = 120.0) -> dict[str, int]:
    """``memory(pid)`` once its RSS has stayed within 1 MiB for ``quiet`` seconds (the
    coordinator's gather that the ranks' last progress report started has ended)."""
    last, since = memory(pid), time.monotonic()
    deadline = since + timeout
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = memory(pid)
        if abs(now["VmRSS"] - last["VmRSS"]) > MIB:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    return memory(pid)


def start_ranks(spec: Any, args: argparse.Namespace, name: str) -> list[Any]:
    """Every rank's ``OwnedLoader`` (the first starts the coordinator and the owners)."""
    import zephon_flow as zf

    return [
        zf.cluster.OwnedLoader(
            spec,
            lane_owners=args.owners,
            rank=rank,
            world_size=args.world_size,
            name=name,
            timeout=600,
            start_timeout=600,
        )
        for rank in range(args.world_size)
    ]


def measure(spec: Any, args: argparse.Namespace, state_mb: int, directory: str) -> dict[str, Any]:
    """Runs the ranks ``args.steps`` steps, then measures ``args.repeats`` times a checkpoint
    and its save, then as many times rank 0's ``state_dict()``, all at that step."""
    ranks: list[Any] = []
    try:
        started = time.perf_counter()
        ranks = start_ranks(spec, args, f"bench-owners-checkpoint-{os.getpid()}-{state_mb}")
        iters = [iter(r) for r in ranks]
        for _ in range(args.steps):
            for it in iters:
                next(it)
        ran = time.perf_counter() - started
        coordinator, me = coordinator_pid(), os.getpid()
        at_rest = settled(coordinator)
        store_at_rest = object_store_mib()
        owners = [memory(p) for p in ranks[0].owner_pids()]

        # Parts first: once a gather has passed through the coordinator, the object store's
        # pages it touched stay mapped in it, and its RSS no longer shows what a save adds.
        ways = (["parts"] if hasattr(ranks[0], "save_checkpoint") else []) + ["gather"]
        checkpoints = []
        for way in ways:
            for i in range(args.repeats):
                where = os.path.join(directory, f"{way}-{i}")
                os.makedirs(where)
                with Peaks([coordinator, me]) as peaks:
                    state, numbers = take_checkpoint(ranks[0], where, way)
                numbers["lane_state_bytes"] = None if state is None else state_bytes(state.lane_states)
                del state
                shutil.rmtree(where)
                numbers.update(_peaks(peaks, coordinator, me))
                checkpoints.append(numbers)

        state_dicts = []
        for _ in range(args.repeats):
            with Peaks([coordinator, me]) as peaks:
                start = time.perf_counter()
                mine = ranks[0].state_dict()
                seconds = time.perf_counter() - start
            lanes = mine["lane_states"]
            state_dicts.append(
                {"seconds": seconds, "lanes": len(lanes), "lane_state_bytes": state_bytes(lanes)}
                | _peaks(peaks, coordinator, me)
            )
            del mine, lanes
        return {
            "lanes": spec.lanes,
            "state_mb_per_lane": state_mb,
            "owners": args.owners,
            "world_size": args.world_size,
            "steps": args.steps,
            "run_seconds": ran,
            "coordinator_at_rest": at_rest,
            "object_store_mib_at_rest": store_at_rest,
            "owners_rss": sum(o["VmRSS"] for o in owners),
            "owners_anon": sum(o["RssAnon"] for o in owners),
            "owners_shmem": sum(o["RssShmem"] for o in owners),
            "checkpoints": checkpoints,
            "state_dicts": state_dicts,
            "loadavg": loadavg(),
        }
    finally:
        for loader in reversed(ranks):
            loader.close()


def measure_loader(spec: Any, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """The reference: the embedded ``zf.Loader`` (one process, every lane) at the same step,
    its ``state()`` and ``zf.save_state`` of it, and this process's peak RSS."""
    import zephon_flow as zf

    me = os.getpid()
    with zf.Loader(spec) as loader:
        batches = iter(loader)
        for _ in range(args.steps):
            next(batches)
        with Peaks([me]) as peaks:
            start = time.perf_counter()
            state = loader.state()  # the typed state that state_dict() makes plain
            taken = time.perf_counter()
            stats = zf.save_state(state, os.path.join(directory, "loader.zf"))
            saved = time.perf_counter()
        lanes = state_bytes(state.lane_states)
        del state
    return {
        "state_seconds": taken - start,
        "save_seconds": saved - taken,
        "written": stats.written,
        "lane_state_bytes": lanes,
        "rss_before": peaks.before[me]["VmRSS"],
        "peak_rss": peaks.peak[me],
    }


def _peaks(peaks: Peaks, coordinator: int, me: int) -> dict[str, Any]:
    return {
        "coordinator_rss_before": peaks.before[coordinator]["VmRSS"],
        "coordinator_peak_rss": peaks.peak[coordinator],
        "coordinator_most_anon": peaks.most[coordinator]["RssAnon"],
        "coordinator_most_shmem": peaks.most[coordinator]["RssShmem"],
        "rank_rss_before": peaks.before[me]["VmRSS"],
        "rank_peak_rss": peaks.peak[me],
        "rank_most_anon": peaks.most[me]["RssAnon"],
        "rank_most_shmem": peaks.most[me]["RssShmem"],
        "object_store_mib": dict(peaks.store),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lanes", type=int, default=64)
    parser.add_argument("--state-mb", default="8", help="MiB of state per lane; a list is a sweep")
    parser.add_argument("--seq-len", type=int, default=16384, help="token ids per sequence (x4 bytes)")
    parser.add_argument("--owners", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="global batch size (default: lanes)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="checkpoints (and state_dicts) measured")
    parser.add_argument("--record-bytes", type=int, default=8192)
    parser.add_argument("--no-loader", action="store_true", help="skip the embedded Loader's reference")
    parser.add_argument("--quick", action="store_true", help="8 lanes x 1 MiB of 4 KB sequences, 1 owner")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.lanes, args.state_mb, args.seq_len, args.owners, args.steps = 8, "1", 1024, 1, 8
        args.repeats, args.record_bytes = 1, 256
    batch = args.batch or args.lanes
    sizes = [int(s) for s in str(args.state_mb).split(",")]

    from zephon_flow.runners.ray_env import connect, disconnect_if_started

    results = []
    with tempfile.TemporaryDirectory(prefix="zf-owners-checkpoint-") as root:
        # Twice the sequences the lanes take (their buffers, the steps, read-ahead): no sequence
        # is in a checkpoint twice, where the compressor would find it.
        most = max(sizes) * MIB // (4 * args.seq_len)
        count = 2 * (args.lanes * (most + 64) + args.steps * batch)
        path = write_records(root, count, args.record_bytes)
        started = connect("bench.owners_checkpoint", None, num_cpus=2)
        try:
            for state_mb in sizes:
                buffer = state_mb * MIB // (4 * args.seq_len)
                spec = checkpoint_spec(
                    path, lanes=args.lanes, batch=batch, seq_len=args.seq_len, buffer=buffer
                )
                directory = os.path.join(root, f"ckpt-{state_mb}")
                os.makedirs(directory)
                result = measure(spec, args, state_mb, directory)
                result["shuffle_buffer"] = buffer
                results.append(result)
            # The references after every owners' run: the Loader's memory stays with this process.
            for result in results if not args.no_loader else []:
                spec = checkpoint_spec(
                    path, lanes=args.lanes, batch=batch, seq_len=args.seq_len, buffer=result["shuffle_buffer"]
                )
                result["loader"] = measure_loader(spec, args, root)
                print(json.dumps(_line(result)), flush=True)
        finally:
            disconnect_if_started(started)
    report = {"config": vars(args), "machine": machine(), "results": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({"owners_checkpoint": [_line(r) for r in results]}))
    return 0


def _most(values: Iterator[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _line(result: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of one size: medians of the repeats' seconds, the largest peaks
    (MB are MiB)."""
    cks = [c for c in result["checkpoints"] if c["way"] == "gather"]
    parts = [c for c in result["checkpoints"] if c["way"] == "parts"]
    sds = result["state_dicts"]

    def mb(value: float) -> float:
        return round(value / MIB, 1)

    return {
        "lanes": result["lanes"],
        "state_mb_per_lane": result["state_mb_per_lane"],
        "owners": result["owners"],
        "world_size": result["world_size"],
        "state_mb": mb(cks[0]["lane_state_bytes"]),
        "checkpoint_s": round(median(c["checkpoint_seconds"] for c in cks), 3),
        "save_s": round(median(c["save_seconds"] for c in cks), 3),
        "written_mb": mb(cks[0]["bytes_on_disk"]),
        "coordinator_rest_mb": mb(result["coordinator_at_rest"]["VmRSS"]),
        "store_rest_mb": result["object_store_mib_at_rest"],
        "coordinator_peak_mb": mb(max(c["coordinator_peak_rss"] for c in cks)),
        "coordinator_most_anon_mb": mb(max(c["coordinator_most_anon"] for c in cks)),
        "store_most_mb": _most(c["object_store_mib"]["most"] for c in cks),
        "rank_before_mb": mb(cks[0]["rank_rss_before"]),
        "rank_peak_mb": mb(max(c["rank_peak_rss"] for c in cks)),
        "rank_most_anon_mb": mb(max(c["rank_most_anon"] for c in cks)),
        "owners_rss_mb": mb(result["owners_rss"]),
        "owners_anon_mb": mb(result["owners_anon"]),
        "state_dict_s": round(median(d["seconds"] for d in sds), 3),
        "state_dict_lanes": sds[0]["lanes"],
        "state_dict_mb": mb(sds[0]["lane_state_bytes"]),
        "state_dict_coordinator_peak_mb": mb(max(d["coordinator_peak_rss"] for d in sds)),
        "state_dict_rank_peak_mb": mb(max(d["rank_peak_rss"] for d in sds)),
        **_parts_line(parts),
        **_loader_line(result.get("loader")),
    }


def _parts_line(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if not parts:
        return {}
    return {
        "parts_s": round(median(c["total_seconds"] for c in parts), 3),
        "parts_files": parts[0]["files"],
        "parts_written_mb": round(parts[0]["bytes_on_disk"] / MIB, 1),
        "parts_coordinator_peak_mb": round(max(c["coordinator_peak_rss"] for c in parts) / MIB, 1),
        "parts_store_most_mb": _most(c["object_store_mib"]["most"] for c in parts),
        "parts_rank_peak_mb": round(max(c["rank_peak_rss"] for c in parts) / MIB, 1),
    }


def _loader_line(loader: dict[str, Any] | None) -> dict[str, Any]:
    if loader is None:
        return {}
    return {
        "loader_state_s": round(loader["state_seconds"], 3),
        "loader_save_s": round(loader["save_seconds"], 3),
        "loader_written_mb": round(loader["written"] / MIB, 1),
        "loader_rss_before_mb": round(loader["rss_before"] / MIB, 1),
        "loader_peak_mb": round(loader["peak_rss"] / MIB, 1),
    }


if __name__ == "__main__":
    raise SystemExit(main())
