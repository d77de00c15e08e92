"""One contender's process: runs a task (throughput, resume or elastic) and prints one JSON line.

Every loader is wrapped in the same small interface (``Contender.open`` -> ``Session``), so the
measurements are taken by one piece of code for all of them. The orchestrator starts a process
per task: ``python -m bench.contenders.<name> --workload W.json --task T.json``. Needs only the
standard library and numpy (the peers' venv has no zephon-flow).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from bench.workload import TextWorkload, concat, digest, load_workload, real_tokens

Batch = dict[str, Any]


class Session(Protocol):
    """An open loader: this rank's batches (``global_batch / world_size`` sequences each)."""

    def batches(self) -> Iterator[Batch]: ...

    def checkpoint(self) -> bytes:
        """The loader's state after the last batch taken, as the bytes a user would store."""
        ...

    def close(self) -> None: ...


class Contender(Protocol):
    name: str
    resumable: bool

    def open(
        self, workload: TextWorkload, *, rank: int, world_size: int, workers: int, state: bytes | None
    ) -> Session: ...


def run_throughput(c: Contender, w: TextWorkload, task: dict[str, Any]) -> dict[str, Any]:
    """Time to the first batch, then ``warmup`` untimed steps, then ``steps`` timed steps."""
    steps, warmup, workers = int(task["steps"]), int(task["warmup"]), int(task["workers"])
    start = time.perf_counter()
    session = c.open(w, rank=0, world_size=1, workers=workers, state=None)
    try:
        it = session.batches()
        first = next(it)
        ttfb = time.perf_counter() - start
        tokens = pad = 0
        early = real_tokens(first)
        for _ in range(warmup):
            early += real_tokens(next(it))
        timed = time.perf_counter()
        for _ in range(steps):
            batch = next(it)
            real = real_tokens(batch)
            tokens += real
            pad += int(batch["segment_ids"].size) - real
        end = time.perf_counter()
        seconds = end - timed
    finally:
        session.close()
    return {
        "ttfb_s": ttfb,
        "warmup_s": timed - start - ttfb,
        "seconds": seconds,
        # Every token delivered over the whole life of the loader, start-up included: read-ahead
        # done before the timed window cannot inflate it (unlike tokens_per_s when the window is
        # shorter than the loader's buffers).
        "end_to_end_tokens_per_s": (early + tokens) / (end - start),
        "steps": steps,
        "warmup": warmup,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "padding_fraction": pad / max(1, tokens + pad),
        "first_batch_shape": list(first["input_ids"].shape),
    }


def _take(session: Session, n: int) -> list[Batch]:
    it = session.batches()
    return [next(it) for _ in range(n)]


def run_resume(c: Contender, w: TextWorkload, task: dict[str, Any]) -> dict[str, Any]:
    """One uninterrupted run to the last step, a checkpoint before each listed step; then for
    each checkpoint a new loader from it, timed to its first batch and compared by digest."""
    workers, steps = int(task["workers"]), sorted(int(s) for s in task["steps"])
    want = set(steps)
    blobs: dict[int, bytes] = {}
    digests: dict[int, str] = {}
    save_s: dict[int, float] = {}
    session = c.open(w, rank=0, world_size=1, workers=workers, state=None)
    try:
        it = session.batches()
        for step in range(steps[-1] + 1):
            if step in want:
                t = time.perf_counter()
                blobs[step] = session.checkpoint()
                save_s[step] = time.perf_counter() - t
            batch = next(it)
            if step in want:
                digests[step] = digest(batch)
    finally:
        session.close()
    points = []
    for step in steps:
        start = time.perf_counter()
        resumed = c.open(w, rank=0, world_size=1, workers=workers, state=blobs[step])
        try:
            batch = next(resumed.batches())
            ttfb = time.perf_counter() - start
        finally:
            resumed.close()
        points.append(
            {
                "step": step,
                "checkpoint_bytes": len(blobs[step]),
                "save_s": save_s[step],
                "ttfb_s": ttfb,
                "matches_uninterrupted": digest(batch) == digests[step],
            }
        )
    return {"points": points}


def _resumed_digests(
    c: Contender, w: TextWorkload, blob: bytes, world_size: int, workers: int, count: int
) -> list[str]:
    sessions = [
        c.open(w, rank=r, world_size=world_size, workers=workers, state=blob) for r in range(world_size)
    ]
    try:
        per_rank = [_take(s, count) for s in sessions]
    finally:
        for s in sessions:
            s.close()
    return [digest(concat([per_rank[r][i] for r in range(world_size)])) for i in range(count)]


def run_elastic(c: Contender, w: TextWorkload, task: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint at ``step`` with (1 rank, ``workers``), resume under other topologies, and
    compare the next ``count`` global batches with the uninterrupted run's, by digest."""
    step, count, workers = int(task["step"]), int(task["count"]), int(task["workers"])
    session = c.open(w, rank=0, world_size=1, workers=workers, state=None)
    try:
        it = session.batches()
        for _ in range(step):
            next(it)
        blob = session.checkpoint()
        expected = [digest(next(it)) for _ in range(count)]
    finally:
        session.close()
    cases = []
    for topo in task["topologies"]:
        world, wk = int(topo["world_size"]), int(topo["workers"])
        case: dict[str, Any] = {"world_size": world, "workers": wk}
        try:
            got = _resumed_digests(c, w, blob, world, wk, count)
            matched = sum(a == b for a, b in zip(got, expected, strict=True))
            case.update(outcome="match" if matched == count else "mismatch", batches_matching=matched)
        except Exception as exc:  # a refusal is a result: recorded, not raised
            message = str(exc).strip().splitlines()
            case.update(
                outcome="refused", error=f"{type(exc).__name__}: {message[-1] if message else ''}"[:300]
            )
        cases.append(case)
    return {"step": step, "count": count, "checkpoint_workers": workers, "cases": cases}


TASKS = {"throughput": run_throughput, "resume": run_resume, "elastic": run_elastic}


def main(make: Callable[[dict[str, str]], Contender], argv: list[str] | None = None) -> int:
    """Entry point of a contender module: ``make(options)`` builds the contender."""
    parser = argparse.ArgumentParser(description="a bench contender")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--task", required=True, help="a JSON object with 'kind' and its parameters")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for the contender")
    args = parser.parse_args(argv)
    contender = make(dict(o.split("=", 1) for o in args.option))
    workload = load_workload(args.workload)
    task = json.loads(args.task)
    result: dict[str, Any] = {"contender": contender.name, "kind": task["kind"]}
    try:
        if task["kind"] != "throughput" and not contender.resumable:
            result["unsupported"] = f"{contender.name} has no checkpoint"
        else:
            result.update(TASKS[task["kind"]](contender, workload, task))
        result["ok"] = True
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    sys.stdout.flush()
    print("BENCH-RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1
