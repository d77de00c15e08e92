"""HF tokenizers against tiktoken as ``Tokenize``'s engine: alone, and inside the demo pipeline.

Run from the repository root::

    .venv/bin/python -m bench.tokenizer_engines                 # full run (about 6 min on 2 cores)
    .venv/bin/python -m bench.tokenizer_engines --quick         # a small smoke run
    .venv/bin/python -m bench.tokenizer_engines --tokenizer other/tokenizer.json

Three measurements, each for ``engine="hf"`` and ``engine="tiktoken"``, on the demo corpus text
(prose JSONL and code Parquet, built by ``zephon_flow.demo_data`` and cached):

1. **one core**: ``Tokenize(path, engine=..., append_eos=False).process(text)`` on every document,
   in this process, after the engine is set up and past its checked first documents.
2. **two processes**: the same in 2 spawned processes, each encoding one half of the documents
   (halves of equal bytes), started together; wall time from the first start to the last end.
3. **pipeline**: the demo pipeline (ReadJsonl + ReadParquet, Mix, Tokenize, Pack(512),
   Shuffle(64); lanes 8, global batch 32) with ``zf.Loader(spec, backend="processes",
   workers=2)``; tokens/s over ``--steps`` batches after the first batch and ``--warmup-steps``
   more (the lanes' read-ahead would otherwise count as free throughput). The two engines' batch
   digests are compared: they must be identical.

MB are 10^6 bytes of UTF-8 text. Ratios are tiktoken over HF (medians over ``--repeats``, the
engines' order alternating). Results go to ``--out`` (JSON, with each run's 1-minute load
average before and after, and each worker's own time) and a Markdown table on stdout. Timings
are noisy on a shared machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import zephon_flow as zf
from bench import demo
from bench.demo import GLOBAL_BATCH, LANES, SEQ_LEN, SHUFFLE_BUFFER
from bench.stats import median
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest
from zephon_flow.demo_data import build_demo_data
from zephon_flow.operators.tokenize import STREAM_CHECK_DOCS

ENGINES = ("hf", "tiktoken")
WORKERS = 2
DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "tokenizer_engines.json")


def load_texts(docs_jsonl: str, code_parquet: str) -> list[str]:
    """Every prose document and code file of the corpus, prose first, empties dropped."""
    prose, code = demo.load_texts(docs_jsonl, code_parquet)
    return prose + code


def _ready(path: str, engine: str, warm: list[str]) -> ops.Tokenize:
    """A set-up Tokenize past its checked first documents (those encode with both engines)."""
    tok = ops.Tokenize(path, engine=engine, append_eos=False)
    tok.setup()
    for text in (warm * STREAM_CHECK_DOCS)[: STREAM_CHECK_DOCS + 1]:
        list(tok.process(text))
    assert tok.active_engine == engine, f"asked for {engine}, running {tok.active_engine}"
    return tok


def encode_all(tok: ops.Tokenize, texts: list[str]) -> int:
    return sum(len(ids) for text in texts for ids in tok.process(text))


def one_core(path: str, engine: str, texts: list[str]) -> dict[str, Any]:
    tok = _ready(path, engine, texts[:2])
    start = time.perf_counter()
    tokens = encode_all(tok, texts)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "bytes": _bytes(texts)}


def _worker(
    path: str, engine: str, docs_jsonl: str, code_parquet: str, part: int, go_at: float
) -> tuple[float, float, int, int]:
    """One of the two processes: loads the corpus, keeps its half, waits for ``go_at``, encodes."""
    texts = _halves(load_texts(docs_jsonl, code_parquet))[part]
    tok = _ready(path, engine, texts[:2])
    while time.time() < go_at:
        time.sleep(0.001)
    start = time.time()
    tokens = encode_all(tok, texts)
    return start, time.time(), tokens, _bytes(texts)


def two_processes(path: str, engine: str, docs_jsonl: str, code_parquet: str) -> dict[str, Any]:
    ctx = get_context("spawn")
    with ProcessPoolExecutor(max_workers=WORKERS, mp_context=ctx) as pool:
        # Start the processes (imports, corpus, tokenizer) before the common start time.
        list(pool.map(_noop, range(WORKERS)))
        go_at = time.time() + 8.0
        futures = [
            pool.submit(_worker, path, engine, docs_jsonl, code_parquet, part, go_at)
            for part in range(WORKERS)
        ]
        results = [f.result() for f in futures]
    starts, ends, tokens, sizes = zip(*results, strict=True)
    if max(starts) - go_at > 1.0:
        print(f"  warning: a {engine} worker started {max(starts) - go_at:.1f} s late", file=sys.stderr)
    return {
        "seconds": max(ends) - min(starts),
        "tokens": sum(tokens),
        "bytes": sum(sizes),
        "worker_seconds": [e - s for s, e in zip(starts, ends, strict=True)],
    }


def _noop(_: int) -> None:
    return None


def _burn(_: int) -> float:
    start, x = time.perf_counter(), 0
    for i in range(10_000_000):
        x += i
    return time.perf_counter() - start


def cpu_scaling() -> float:
    """How much faster 2 processes do twice a pure-Python loop than 1 process does it once
    (2.0 on 2 idle cores; less where the cores are shared or hyperthreads)."""
    alone = _burn(0)
    with ProcessPoolExecutor(max_workers=WORKERS, mp_context=get_context("spawn")) as pool:
        list(pool.map(_noop, range(WORKERS)))
        both = max(pool.map(_burn, range(WORKERS)))
    return WORKERS * alone / both


def _halves(texts: list[str]) -> list[list[str]]:
    """Two contiguous halves of (nearly) equal bytes."""
    sizes = [len(t.encode("utf-8")) for t in texts]
    total, run = sum(sizes), 0
    cut = len(texts)
    for i, size in enumerate(sizes):
        run += size
        if run >= total / 2:
            cut = i + 1
            break
    return [texts[:cut], texts[cut:]]


def _bytes(texts: list[str]) -> int:
    return sum(len(t.encode("utf-8")) for t in texts)


def pipeline_spec(docs_jsonl: str, code_parquet: str, tokenizer: str, engine: str) -> zf.LoaderSpec:
    spec: zf.LoaderSpec = demo.pipeline_spec(
        docs_jsonl, code_parquet, tokenizer, weights=(0.3, 0.7), seed=1234, tokenize={"engine": engine}
    )
    return spec


def pipeline(spec: zf.LoaderSpec, *, warmup_steps: int, steps: int) -> dict[str, Any]:
    digests: list[str] = []
    begin = time.perf_counter()
    with zf.Loader(spec, backend="processes", workers=WORKERS) as loader:
        it = iter(loader)
        for _ in range(1 + warmup_steps):
            digests.append(batch_digest(next(it)[1]))
        first = time.perf_counter()
        for _ in range(steps):
            digests.append(batch_digest(next(it)[1]))
        seconds = time.perf_counter() - first
    tokens = steps * GLOBAL_BATCH * SEQ_LEN
    chain = hashlib.sha256("".join(digests).encode()).hexdigest()
    return {"seconds": seconds, "tokens": tokens, "first_batch_s": first - begin, "digests_sha256": chain}


def _rates(run: dict[str, Any]) -> dict[str, float]:
    out = {"tokens_per_s": run["tokens"] / run["seconds"]}
    if "bytes" in run:
        out["mb_per_s"] = run["bytes"] / run["seconds"] / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", default=None, help="demo corpus directory (default: the cache)")
    ap.add_argument("--max-code-files", type=int, default=600)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: the demo's)")
    ap.add_argument("--steps", type=int, default=300, help="timed pipeline steps")
    ap.add_argument("--warmup-steps", type=int, default=100, help="untimed steps after the first")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="5 + 5 pipeline steps, 1 repeat")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup_steps, args.repeats = 5, 5, 1

    data = build_demo_data(
        args.data_root, max_code_files=args.max_code_files, vocab_size=args.vocab_size, progress=True
    )
    tokenizer = args.tokenizer or data.tokenizer_json
    texts = load_texts(data.docs_jsonl, data.code_parquet)
    scaling = cpu_scaling()
    print(f"2 processes run a pure-Python loop {scaling:.2f}x as fast as 1 (2.00 on 2 idle cores)")
    print(f"corpus: {len(texts)} documents, {_bytes(texts) / 1e6:.2f} MB; tokenizer {tokenizer}")

    raw: dict[str, dict[str, list[dict[str, Any]]]] = {
        k: {e: [] for e in ENGINES} for k in ("one_core", "two_processes", "pipeline")
    }
    for r in range(args.repeats):
        order = ENGINES if r % 2 == 0 else ENGINES[::-1]
        for engine in order:
            print(f"repeat {r + 1}/{args.repeats}: {engine} ...", flush=True)
            spec = pipeline_spec(data.docs_jsonl, data.code_parquet, tokenizer, engine)
            measures: dict[str, Callable[[], dict[str, Any]]] = {
                "one_core": partial(one_core, tokenizer, engine, texts),
                "two_processes": partial(
                    two_processes, tokenizer, engine, data.docs_jsonl, data.code_parquet
                ),
                "pipeline": partial(pipeline, spec, warmup_steps=args.warmup_steps, steps=args.steps),
            }
            for kind, run in measures.items():
                load = os.getloadavg()[0]
                result = run()
                raw[kind][engine].append({**result, "load_before": load, "load_after": os.getloadavg()[0]})

    medians: dict[str, dict[str, dict[str, float]]] = {}
    for kind, by_engine in raw.items():
        medians[kind] = {}
        for engine, runs in by_engine.items():
            rates = [_rates(run) for run in runs]
            medians[kind][engine] = {k: median(r[k] for r in rates) for k in rates[0]}
    ratios = {
        f"{kind}_{metric}": medians[kind]["tiktoken"][metric] / medians[kind]["hf"][metric]
        for kind in medians
        for metric in medians[kind]["hf"]
    }
    chains = {run["digests_sha256"] for runs in raw["pipeline"].values() for run in runs}
    result = {
        "config": {
            "tokenizer": tokenizer,
            "documents": len(texts),
            "mb": _bytes(texts) / 1e6,
            "steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "repeats": args.repeats,
            "workers": WORKERS,
            "pipeline": f"ReadJsonl+ReadParquet, Mix([0.3, 0.7]), Tokenize, Pack({SEQ_LEN}), Shuffle({SHUFFLE_BUFFER}); lanes {LANES}, B {GLOBAL_BATCH}",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "two_process_cpu_scaling": scaling,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "raw": raw,
        "medians": medians,
        "ratios": ratios,
        "checks": {"pipeline_digests_identical_across_engines": len(chains) == 1},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(_table(medians, ratios, result["checks"]))
    print(f"\nwritten to {args.out}")
    return 0 if result["checks"]["pipeline_digests_identical_across_engines"] else 1


def _table(
    medians: dict[str, dict[str, dict[str, float]]], ratios: dict[str, float], checks: dict[str, bool]
) -> str:
    lines = ["", "| measurement | HF | tiktoken | tiktoken / HF |", "| --- | ---: | ---: | ---: |"]
    names = {
        "one_core": "alone, 1 core",
        "two_processes": "alone, 2 processes",
        "pipeline": "pipeline, processes x2",
    }
    for kind, label in names.items():
        for metric in medians[kind]["hf"]:
            unit = "MB/s" if metric == "mb_per_s" else "tokens/s"
            hf, tk = medians[kind]["hf"][metric], medians[kind]["tiktoken"][metric]
            lines.append(f"| {label} {unit} | {hf:,.2f} | {tk:,.2f} | {ratios[f'{kind}_{metric}']:.2f} |")
    lines.append(
        f"\npipeline batch digests identical across engines: {checks['pipeline_digests_identical_across_engines']}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
