"""Contender: the limit of the work itself, the tokenizer alone in ``workers`` processes.

No loader: each process loads the tokenizer, reads its share of the mixed documents into memory
(``bench.workload.iter_mixed``, the same draw the plain peers use), encodes a few untimed, then
waits at a barrier with the others and encodes the rest one ``encode`` call per document, EOS
appended, ids turned into an int32 array (as every contender does). tokens/s = all processes'
tokens over the slowest one's time. Packing, shuffling and batching cost nothing here, so no
loader doing the same tokenization on the same cores can beat it.

Option ``engine=tiktoken`` (the contender ``limit_tiktoken``): the same, with the engine that
``Tokenize(engine="auto")`` runs on this tokenizer (tiktoken's Rust core, through
``Tokenize(engine="tiktoken").process``: the same ids and the same int32 array per document), so
``zephon_processes_auto`` has its own engine's limit to be held to.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from bench.contenders.harness import emit
from bench.workload import TextWorkload, encode, iter_mixed, load_tokenizer, load_workload

CHARS_PER_TOKEN = 3.5  # to size the in-memory share; the measured rate does not depend on it
WARM_DOCS = 50


def _encoder(w: TextWorkload, engine: str) -> Callable[[str], Any]:
    """One document's ids (EOS appended) as an int32 array, with the engine asked for."""
    tok, eos = load_tokenizer(w)
    if engine == "hf":
        return partial(encode, tok, eos)
    from zephon_flow import operators as ops
    from zephon_flow.operators.tokenize import STREAM_CHECK_DOCS

    fast = ops.Tokenize(w.tokenizer, append_eos=True, eos_token=w.eos_token, engine=engine)
    fast.setup()
    for text in ("warm", "up") * STREAM_CHECK_DOCS:  # past the first documents' cross-check
        next(iter(fast.process(text)))

    def encode_fast(text: str) -> Any:
        return next(iter(fast.process(text)))

    return encode_fast


def _worker(path: str, engine: str, part: int, parts: int, target: int, barrier: Any, out: Any) -> None:
    w = load_workload(path)
    encode_one = _encoder(w, engine)
    texts: list[str] = []
    chars = 0
    for text in iter_mixed(w, part, parts):
        texts.append(text)
        chars += len(text)
        if chars >= target * CHARS_PER_TOKEN and len(texts) > WARM_DOCS:
            break
    for text in texts[:WARM_DOCS]:
        encode_one(text)
    work = texts[WARM_DOCS:]
    barrier.wait()
    start, cpu = time.perf_counter(), time.process_time()
    tokens = 0
    for text in work:
        tokens += len(encode_one(text))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    out.put({"part": part, "tokens": tokens, "docs": len(work), "seconds": seconds, "cpu_seconds": cpu})


def run_parts(worker: Callable[..., None], head: tuple[Any, ...], workers: int, target: int) -> list[Any]:
    """Spawns ``workers`` processes ``worker(*head, part, parts, target, barrier, out)`` that start
    their timed work together at a barrier; returns what each put on ``out``."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(*head, k, workers, target, barrier, out)) for k in range(workers)
    ]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return results


def measure(workload_path: str, steps: int, workers: int, engine: str = "hf") -> dict[str, Any]:
    w = load_workload(workload_path)
    target = steps * w.global_batch * w.seq_len // workers
    results = run_parts(_worker, (workload_path, engine), workers, target)
    seconds = max(r["seconds"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "padding_fraction": 0.0,
        "worker_seconds": [r["seconds"] for r in results],
        # CPU time of the encoding alone, every process: the cost per token that a loader's
        # total CPU per token (its process and its workers) is compared with
        "cpu_seconds": sum(r["cpu_seconds"] for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the tokenizer alone")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--option", action="append", default=[])
    args = parser.parse_args(argv)
    task = json.loads(args.task)
    engine = dict(o.split("=", 1) for o in args.option).get("engine", "hf")
    name = "limit" if engine == "hf" else f"limit_{engine}"
    result: dict[str, Any] = {"contender": name, "kind": task["kind"]}
    if task["kind"] != "throughput":
        result.update(ok=True, unsupported="the limit has no loader state")
    else:
        result.update(measure(args.workload, int(task["steps"]), int(task["workers"]), engine), ok=True)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
