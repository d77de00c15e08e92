"""One contender's process: runs a task (throughput, resume or elastic) and prints one JSON line.

Every loader is wrapped in the same small interface (``Contender.open`` -> ``Session``), so the
measurements are taken by one piece of code for all of them. The orchestrator starts a process
per task: ``python -m bench.contenders.<name> --workload W.json --task T.json``. Needs only the
standard library and numpy (the peers' venv has no zephon-flow).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bench.procs import RESULT_TAG
from bench.stats import median
from bench.workload import TextWorkload, concat, digest, load_workload, real_tokens

Batch = dict[str, Any]
#: Called with each batch's index (0: the first batch) and the batch, as it is delivered.
Observer = Callable[[int, Batch], None]


class Session(Protocol):
    """An open loader: this rank's batches (``global_batch / world_size`` sequences each)."""

    def batches(self) -> Iterator[Batch]: ...

    def checkpoint(self) -> bytes:
        """The loader's state after the last batch taken, as the bytes a user would store."""
        ...

    def close(self) -> None: ...


class Peer:
    """A peer loader's contender: resumable, its ``--option`` values kept (none used today)."""

    name = "peer"
    resumable = True

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options


class TorchSession:
    """A session over a torch-style loader (``DataLoader``, ``StatefulDataLoader``, torchdata's
    ``nodes.Loader``): one iterator over it, ``convert`` applied to each batch, checkpoints as
    ``torch.save`` of its ``state_dict()`` (and restored from ``state`` by ``load_state_dict``),
    its worker processes shut down on close."""

    def __init__(
        self, loader: Any, convert: Callable[[Any], Batch] | None = None, *, state: bytes | None = None
    ) -> None:
        if state is not None:
            import torch

            loader.load_state_dict(torch.load(io.BytesIO(state), weights_only=False))
        self._loader = loader
        self._convert = convert
        self._it: Any = None

    def batches(self) -> Iterator[Batch]:
        if self._it is None:
            self._it = iter(self._loader)
        for batch in self._it:
            yield batch if self._convert is None else self._convert(batch)

    def checkpoint(self) -> bytes:
        import torch

        buf = io.BytesIO()
        torch.save(self._loader.state_dict(), buf)
        return buf.getvalue()

    def close(self) -> None:
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class Contender(Protocol):
    name: str
    resumable: bool

    def open(
        self, workload: TextWorkload, *, rank: int, world_size: int, workers: int, state: bytes | None
    ) -> Session: ...


def rate(marks: Sequence[tuple[float, ...]], lo: int, hi: int, k: int = 1) -> float | None:
    """Per batch ``(delivery instant, count, ...)``: count ``k`` summed over batches ``lo+1..hi``,
    per second between the deliveries of batch ``lo`` and batch ``hi`` (None for an empty span)."""
    if hi <= lo or marks[hi][0] <= marks[lo][0]:
        return None
    return sum(m[k] for m in marks[lo + 1 : hi + 1]) / (marks[hi][0] - marks[lo][0])


@dataclass(frozen=True)
class Timed:
    """Batches taken one by one: per batch its delivery instant and counts, the first batch, and
    the CPU seconds (``cpu_seconds``' keys) spent over the timed window and since ``born``."""

    marks: list[tuple[float, ...]]
    first: Batch
    window_cpu: dict[str, float]
    life_cpu: dict[str, float]

    def cores(self, lo: int, hi: int) -> dict[str, float | None]:
        """CPU cores busy between the deliveries of batch ``lo`` and ``hi``: this (consumer)
        process, and its child processes (None without psutil)."""
        window = self.marks[hi][0] - self.marks[lo][0]
        children = self.window_cpu.get("children")
        return {
            "main_cpu_cores": self.window_cpu.get("main", 0.0) / window if window > 0 else None,
            "children_cpu_cores": children / window if children is not None and window > 0 else None,
        }


def time_batches(
    batches: Iterator[Batch],
    count: Callable[[Batch], tuple[int, ...]],
    *,
    steps: int,
    warmup: int,
    born: dict[str, float] | None = None,
    observe: Observer | None = None,
) -> Timed:
    """The first batch, ``warmup`` untimed ones, then ``steps`` timed ones (the window: from the
    delivery of batch ``warmup`` to that of batch ``warmup + steps``), each marked with its
    delivery instant and ``count(batch)``. ``observe``, if given, sees every batch as it is
    delivered (its time is counted)."""
    marks: list[tuple[float, ...]] = []
    first: Batch = {}
    cpu: dict[str, float] = {}
    for i in range(1 + warmup + steps):
        if i == 1 + warmup:
            cpu = cpu_seconds()
        batch = next(batches)
        marks.append((time.perf_counter(), *count(batch)))
        if observe is not None:
            observe(i, batch)
        if i == 0:
            first = batch
    end = cpu_seconds()
    window = {k: v - cpu.get(k, 0.0) for k, v in end.items()}
    life = {k: v - born.get(k, 0.0) for k, v in end.items()} if born is not None else {}
    return Timed(marks, first, window, life)


def _tokens(batch: Batch) -> tuple[int, int]:
    """(real tokens, pad tokens) of a text batch."""
    real = real_tokens(batch)
    return real, int(batch["segment_ids"].size) - real


def run_throughput(
    c: Contender, w: TextWorkload, task: dict[str, Any], observe: Observer | None = None
) -> dict[str, Any]:
    """Time to the first batch, then ``warmup`` untimed steps, then ``steps`` timed steps.

    Every batch's delivery instant and real-token count is recorded. ``tokens_per_s`` is the rate
    between the deliveries of batch ``warmup`` and batch ``warmup + steps`` (both after the first);
    a loader that read ahead more than ``warmup`` steps before that window delivers its buffer in
    it, so the window is also split in halves: in a steady state their rates agree
    (``half_rate_ratio`` near 1), while a draining buffer makes the first half faster. The
    end-to-end rate (construction to last batch) can never be inflated by read-ahead.
    ``observe``, if given, sees every batch as it is delivered (its time is counted).
    """
    steps, warmup, workers = int(task["steps"]), int(task["warmup"]), int(task["workers"])
    start = time.perf_counter()
    born = cpu_seconds()
    session = c.open(w, rank=0, world_size=1, workers=workers, state=None)
    try:
        timed = time_batches(
            session.batches(), _tokens, steps=steps, warmup=warmup, born=born, observe=observe
        )
    finally:
        session.close()
    marks = timed.marks  # (delivery instant, real tokens, pad tokens) per batch, first = index 0
    lo, hi = warmup, warmup + steps
    mid = (lo + hi) // 2
    tokens = sum(m[1] for m in marks[lo + 1 :])
    pad = sum(m[2] for m in marks[lo + 1 :])
    seconds = marks[hi][0] - marks[lo][0]
    first_half, second_half = rate(marks, lo, mid), rate(marks, mid, hi)
    return {
        "ttfb_s": marks[0][0] - start,
        "warmup_s": marks[lo][0] - marks[0][0],
        "seconds": seconds,
        "end_to_end_tokens_per_s": sum(m[1] for m in marks) / (marks[-1][0] - start),
        "first_half_tokens_per_s": first_half,
        "second_half_tokens_per_s": second_half,
        "half_rate_ratio": first_half / second_half if first_half and second_half else None,
        "steps": steps,
        "warmup": warmup,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "padding_fraction": pad / max(1, tokens + pad),
        "first_batch_shape": list(timed.first["input_ids"].shape),
        "batch_times_s": [round(m[0] - start, 4) for m in marks],
        **timed.cores(lo, hi),
        # whole life, start-up included: CPU per delivered token, where every core-second went
        "life_main_cpu_s": timed.life_cpu.get("main"),
        "life_children_cpu_s": timed.life_cpu.get("children"),
        "life_tokens": sum(m[1] for m in marks),
    }


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process (all threads) and, with psutil, of its live children."""
    out = {"main": time.process_time()}
    try:
        import psutil
    except ImportError:
        return out
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    out["children"] = total
    return out


def _take(session: Session, n: int) -> list[Batch]:
    it = session.batches()
    return [next(it) for _ in range(n)]


def emit(result: dict[str, Any]) -> None:
    """One result line; the orchestrator keeps the last one, so a task that prints partial results
    as it goes and is then killed at its timeout still reports what it measured."""
    sys.stdout.flush()
    print(RESULT_TAG + json.dumps(result), flush=True)


def first_batch(
    c: Contender, w: TextWorkload, *, workers: int, state: bytes | None
) -> tuple[Batch, dict[str, float]]:
    """Opens a loader (fresh, or resumed from ``state``), takes its first batch and closes it:
    the batch, with the seconds from ``open`` to it (``ttfb_s``) and to close (``close_s``)."""
    start = time.perf_counter()
    session = c.open(w, rank=0, world_size=1, workers=workers, state=state)
    try:
        batch = next(session.batches())
        got = time.perf_counter()
    finally:
        closing = time.perf_counter()
        session.close()
    return batch, {"ttfb_s": got - start, "close_s": time.perf_counter() - closing}


def run_resume(c: Contender, w: TextWorkload, task: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint size and time to the first batch after a resume, against the step.

    One uninterrupted run to the last step: before each step ``s, s+1, .., s+consecutive-1`` of
    every listed point ``s`` it takes a checkpoint (its size depends on what is in flight, e.g.
    long documents leave pending sequences, hence several consecutive ones), and it records when
    it got there (``uninterrupted_s``: its whole time). Then, per point, a new loader from each of
    the first ``resumes`` checkpoints is timed to its first batch, which is compared by digest
    with the uninterrupted run's. A point reports its raw samples and their medians. Partial
    results are printed after the run and after every point, so a timeout keeps them.
    """
    workers = int(task["workers"])
    points_at = sorted(int(s) for s in task["steps"])
    consecutive = max(1, int(task.get("consecutive", 1)))
    resumes = max(1, min(consecutive, int(task.get("resumes", 1))))
    want = {s + i: (s, i) for s in points_at for i in range(consecutive)}
    last = max(want)
    blobs: dict[int, bytes] = {}
    samples: dict[int, dict[str, Any]] = {}
    reached: dict[int, float] = {}
    start = time.perf_counter()
    session = c.open(w, rank=0, world_size=1, workers=workers, state=None)
    try:
        it = session.batches()
        for step in range(last + 1):
            if step in want:
                point, i = want[step]
                reached.setdefault(point, time.perf_counter() - start)
                t = time.perf_counter()
                blob = session.checkpoint()
                samples[step] = {
                    "step": step,
                    "checkpoint_bytes": len(blob),
                    "save_s": time.perf_counter() - t,
                }
                if i < resumes:
                    blobs[step] = blob
            batch = next(it)
            if step in want:
                samples[step]["digest"] = digest(batch)
    finally:
        session.close()
    result: dict[str, Any] = {
        "consecutive": consecutive,
        "resumes": resumes,
        "last_step": last,
        "uninterrupted_s": time.perf_counter() - start,
        "points": [],
    }
    for point in points_at:
        taken = [samples[point + i] for i in range(consecutive)]
        for sample in taken[:resumes]:
            first, times = first_batch(c, w, workers=workers, state=blobs.pop(sample["step"]))
            sample["ttfb_s"] = times["ttfb_s"]
            sample["matches_uninterrupted"] = digest(first) == sample["digest"]
        resumed_ = [x for x in taken if "ttfb_s" in x]
        result["points"].append(
            {
                "step": point,
                "reached_s": reached[point],
                "checkpoint_bytes": median([x["checkpoint_bytes"] for x in taken]),
                "ttfb_s": median([x["ttfb_s"] for x in resumed_]),
                "matches_uninterrupted": all(x["matches_uninterrupted"] for x in resumed_),
                "samples": [{k: v for k, v in x.items() if k != "digest"} for x in taken],
            }
        )
        emit({"contender": c.name, "kind": "resume", "ok": True, "partial": True, **result})
    return result


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


def emit_outcome(result: dict[str, Any], work: Callable[[], dict[str, Any]]) -> int:
    """Adds what ``work()`` measured to ``result`` (``ok`` true), or the exception it raised
    (``ok`` false, the error and its traceback); prints the result line; the exit status."""
    try:
        result.update(work(), ok=True)
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    emit(result)
    return 0 if result["ok"] else 1


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

    def work() -> dict[str, Any]:
        if task["kind"] != "throughput" and not contender.resumable:
            return {"unsupported": f"{contender.name} has no checkpoint"}
        return TASKS[task["kind"]](contender, workload, task)

    return emit_outcome({"contender": contender.name, "kind": task["kind"]}, work)
