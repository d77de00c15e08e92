"""Throughput and resume cost of zephon-flow on the demo corpus, next to the tokenizer's own limit.

Run from the repository root::

    .venv/bin/python -m bench.throughput                # full run, 3 repeats
    .venv/bin/python -m bench.throughput --quick        # a tiny smoke run

Three measurements, taken side by side in one run, contenders alternated within each repeat:

1. **limit**: the HF tokenizer alone, encoding documents mixed like the pipeline's ``Mix`` in
   ``WORKERS`` spawned processes (each loads its own tokenizer and the corpus; the documents are
   pre-split into halves of equal token count, one half per process).
2. **zephon**: the demo text pipeline (ReadJsonl + ReadParquet, Mix, Tokenize, Pack, Shuffle) with
   ``Loader(backend="processes", workers=WORKERS)`` and with ``backend="inline"``; tokens/s after
   the first batch, and the time to that first batch, separately.
3. **resume**: checkpoint size and time from ``Loader(state=...)`` to the first batch, at an early
   and a late step, for both backends.

See ``bench/README.md`` for what each number means. Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

# Pipeline geometry (the demo pipeline).
SEQ_LEN = 512
GLOBAL_BATCH = 32
LANES = 8
SHUFFLE_BUFFER = 64
MIX_WEIGHTS = (0.5, 0.5)
JSONL_SPLIT_BYTES = 64 * 1024  # as zephon_flow.demo: the prose file is dealt in several splits
SEED = 0
WORKERS = 2

# Goals from the issue.
GOAL_THROUGHPUT_RATIO = 0.8
GOAL_RESUME_RATIO = 1.2

DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "throughput.json")
CONTENDERS = ("limit", "zephon_processes", "zephon_inline")

# A document reference: (source index, row index) with source 0 = prose JSONL, 1 = code Parquet.
DocRef = tuple[int, int]


# -- the corpus, as both contenders see it ------------------------------------------------------


def load_texts(docs_jsonl: str, code_parquet: str) -> tuple[list[str], list[str]]:
    """Prose documents and code files, as the pipeline's sources yield them (empties dropped)."""
    import pyarrow.parquet as pq

    prose: list[str] = []
    with open(docs_jsonl, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                text = json.loads(line)["text"]
                if text:
                    prose.append(text)
    column = pq.read_table(code_parquet, columns=["content"])["content"].to_pylist()
    code = [text for text in column if text]
    return prose, code


def plan_documents(token_counts: Sequence[Sequence[int]], target_tokens: int, seed: int) -> list[DocRef]:
    """Documents drawn like ``Mix(MIX_WEIGHTS)`` draws records, each source cycled in file order,
    until their tokens reach ``target_tokens``."""
    rng = random.Random(seed)
    share0 = MIX_WEIGHTS[0] / sum(MIX_WEIGHTS)
    nxt = [0, 0]
    plan: list[DocRef] = []
    total = 0
    while total < target_tokens:
        source = 0 if rng.random() < share0 else 1
        row = nxt[source] % len(token_counts[source])
        nxt[source] += 1
        plan.append((source, row))
        total += token_counts[source][row]
    return plan


def split_by_tokens(
    plan: list[DocRef], token_counts: Sequence[Sequence[int]], parts: int
) -> list[list[DocRef]]:
    """Cuts ``plan`` into ``parts`` contiguous pieces of about equal token count."""
    total = sum(token_counts[s][r] for s, r in plan)
    pieces: list[list[DocRef]] = [[] for _ in range(parts)]
    acc = 0
    for ref in plan:
        index = min(parts - 1, acc * parts // max(total, 1))
        pieces[index].append(ref)
        acc += token_counts[ref[0]][ref[1]]
    return pieces


# -- the limit: the tokenizer alone in worker processes -----------------------------------------

_TOKENIZER: Any = None
_TEXTS: tuple[list[str], list[str]] = ([], [])


def _limit_init(tokenizer_json: str, docs_jsonl: str, code_parquet: str) -> None:
    global _TOKENIZER, _TEXTS
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_file(tokenizer_json)
    _TEXTS = load_texts(docs_jsonl, code_parquet)


def _limit_ready(delay: float) -> int:
    time.sleep(delay)
    return os.getpid()


def _limit_encode(plan: list[DocRef]) -> dict[str, Any]:
    """Encodes the documents one ``encode`` call each, as ``Tokenize`` does; counts the ids."""
    tokenizer, texts = _TOKENIZER, _TEXTS
    start = time.perf_counter()
    tokens = 0
    for source, row in plan:
        tokens += len(tokenizer.encode(texts[source][row], add_special_tokens=False).ids)
    return {"pid": os.getpid(), "tokens": tokens, "docs": len(plan), "seconds": time.perf_counter() - start}


class LimitPool:
    """``WORKERS`` spawned processes, started, initialised and warmed before any timing."""

    def __init__(self, data: Any, workers: int) -> None:
        self.workers = workers
        self._pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=get_context("spawn"),
            initializer=_limit_init,
            initargs=(data.tokenizer_json, data.docs_jsonl, data.code_parquet),
        )
        pids: set[int] = set()
        for _ in range(10):  # until every worker has answered (all started and initialised)
            pids |= set(self._pool.map(_limit_ready, [0.3] * workers))
            if len(pids) >= workers:
                break

    def encode(self, halves: list[list[DocRef]]) -> tuple[float, list[dict[str, Any]]]:
        start = time.perf_counter()
        results = list(self._pool.map(_limit_encode, halves))
        return time.perf_counter() - start, results

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def run_limit(
    pool: LimitPool, warm: list[list[DocRef]], work: list[list[DocRef]], work_bytes: int
) -> dict[str, Any]:
    pool.encode(warm)  # as much text as the loader encodes before its first batch (shuffle fill)
    seconds, results = pool.encode(work)
    tokens = sum(r["tokens"] for r in results)
    return {
        "tokens": tokens,
        "bytes": work_bytes,
        "docs": sum(r["docs"] for r in results),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "mb_per_s": work_bytes / seconds / 1e6,
        "worker_seconds": [r["seconds"] for r in results],
        "distinct_workers": len({r["pid"] for r in results}),
    }


# -- zephon-flow ----------------------------------------------------------------------------------


def tokenize_options(engine: str) -> tuple[dict[str, Any], str]:
    """``Tokenize`` keyword arguments for ``engine``, and a description of what will run.

    ``Tokenize`` may or may not take ``engine=`` (HF ``tokenizers`` being the only engine
    without it); the limit is always HF, so ``"hf"`` (the default) compares like with like.
    """
    import inspect

    from zephon_flow import operators as ops

    if "engine" in inspect.signature(ops.Tokenize).parameters:
        return {"engine": engine}, engine
    if engine != "hf":
        raise SystemExit(
            f"this zephon-flow's Tokenize has no engine= parameter (only HF); got --engine {engine}"
        )
    return {}, "hf (Tokenize has no engine= parameter)"


def selected_engine(data: Any, options: dict[str, Any]) -> str:
    """The engine ``Tokenize`` picks for the demo tokenizer with ``options``."""
    from zephon_flow import operators as ops

    probe = ops.Tokenize(data.tokenizer_json, append_eos=True, **options)
    return str(getattr(probe, "selected_engine", "hf"))


def make_spec(data: Any, tokenize: dict[str, Any] | None = None, *, per_element: bool = False) -> Any:
    """The issue's demo text pipeline over ``data`` (a ``DemoData``); ``tokenize`` holds extra
    ``Tokenize`` keyword arguments (see ``tokenize_options``); ``per_element`` hides
    ``Tokenize``'s batched path (``process_batch``), for a before/after comparison."""
    import apache_beam as beam

    import zephon_flow as zf
    from bench._per_element import PerElementTokenize
    from zephon_flow import operators as ops

    extra = dict(tokenize or {})
    tokenizer = PerElementTokenize if per_element else ops.Tokenize

    def text_mix(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(data.docs_jsonl, field="text", split_bytes=JSONL_SPLIT_BYTES)
        code = p | "code" >> ops.ReadParquet(data.code_parquet, column="content")
        mixed = (docs, code) | "mix" >> ops.Mix(weights=list(MIX_WEIGHTS))
        toks = mixed | "tok" >> beam.ParDo(tokenizer(data.tokenizer_json, append_eos=True, **extra))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=SEQ_LEN))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=SHUFFLE_BUFFER))

    return zf.LoaderSpec(text_mix, lanes=LANES, seed=SEED, global_batch_size=GLOBAL_BATCH)


def run_loader(spec: Any, backend: str, steps: int, warmup: int, capture: Sequence[int]) -> dict[str, Any]:
    """``1 + warmup + steps`` batches; tokens/s over the last ``steps``.

    The first batch ends start-up (timed as ``ttfb_s``). The ``warmup`` batches after it are
    not timed either: when the first batch is out, every lane has already run its read-ahead
    (``prefetch_chunks`` chunks of ``chunk_records`` documents) through the tokenizer, which is
    worth many steps of tokens and would otherwise be counted as free throughput.

    For each step ``s`` in ``capture`` keeps ``state_dict()`` as it is after batch ``s - 1``
    (a checkpoint at step ``s``) and the digest of batch ``s`` (what a resume from it yields
    first). Both are cheap next to a step and are taken inside the timed loop.
    """
    import zephon_flow as zf

    want = set(capture)
    states: dict[int, dict[str, Any]] = {}
    digests: dict[int, str] = {}

    def observe(step: int, batch: Any, loader: Any) -> None:
        if step in want:
            digests[step] = zf.batch_digest(batch)
        if step + 1 in want:
            states[step + 1] = loader.state_dict()

    start = time.perf_counter()
    loader = zf.Loader(spec, backend=backend, workers=WORKERS)
    built = time.perf_counter()
    try:
        batches = iter(loader)
        step, batch = next(batches)
        first = time.perf_counter()
        observe(step, batch, loader)
        for _ in range(warmup):
            step, batch = next(batches)
            observe(step, batch, loader)
        timed, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step, batch = next(batches)
            observe(step, batch, loader)
        end, cpu_end = time.perf_counter(), time.process_time()
    finally:
        closing = time.perf_counter()
        loader.close()
        closed = time.perf_counter()
    tokens = steps * GLOBAL_BATCH * SEQ_LEN
    seconds = end - timed
    return {
        "backend": backend,
        "steps_timed": steps,
        "warmup_steps": warmup,
        "tokens": tokens,
        "init_s": built - start,
        "ttfb_s": first - start,
        "warmup_s": timed - first,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if steps else 0.0,
        "steps_per_s": steps / seconds if steps else 0.0,
        # CPU time of this (the trainer's) process, all threads, over the timed steps.
        "main_cpu_s": cpu_end - cpu_start,
        "main_cpu_us_per_token": 1e6 * (cpu_end - cpu_start) / tokens if steps else 0.0,
        "close_s": closed - closing,
        "last_step": step,
        "_states": states,
        "_digests": digests,
    }


def run_resume(spec: Any, backend: str, blob: bytes, expect_digest: str, step: int) -> dict[str, Any]:
    """Time from ``Loader(spec, state=checkpoint bytes)`` to its first batch, checked against the
    uninterrupted run's batch at that step."""
    import zephon_flow as zf

    start = time.perf_counter()
    loader = zf.Loader(spec, state=blob, backend=backend, workers=WORKERS)
    built = time.perf_counter()
    try:
        got_step, batch = next(iter(loader))
        first = time.perf_counter()
    finally:
        loader.close()
    return {
        "backend": backend,
        "step": step,
        "init_s": built - start,
        "ttfb_s": first - start,
        "first_step": got_step,
        "matches_uninterrupted": got_step == step and zf.batch_digest(batch) == expect_digest,
    }


def measure_state(state: dict[str, Any]) -> dict[str, Any]:
    import zephon_flow as zf

    start = time.perf_counter()
    blob = zf.encode_state(state)
    encoded = time.perf_counter()
    zf.decode_state(blob)
    decoded = time.perf_counter()
    return {
        "step": int(state["step"]),
        "bytes": len(blob),
        "encode_s": encoded - start,
        "decode_s": decoded - encoded,
        "_blob": blob,
    }


# -- the run --------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    import apache_beam
    import numpy
    import pyarrow
    import tokenizers

    import zephon_flow

    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "versions": {
            "zephon_flow": zephon_flow.__version__,
            "tokenizers": tokenizers.__version__,
            "apache_beam": apache_beam.__version__,
            "numpy": numpy.__version__,
            "pyarrow": pyarrow.__version__,
        },
        "git": _git_revision(),
    }
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _git_revision() -> dict[str, Any] | None:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "dirty": bool(dirty)}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput",
        description="zephon-flow throughput vs the tokenizer's limit, and resume cost, on the demo corpus.",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per loader run (default 400; 4 with --quick)"
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="untimed steps after the first batch (default 100; 1 with --quick)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="repeats (default 3; 1 with --quick)")
    parser.add_argument("--early-step", type=int, default=None, help="early checkpoint step (default 10)")
    parser.add_argument(
        "--late-step", type=int, default=None, help="late checkpoint step (default: the last, warmup + steps)"
    )
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help="results JSON (default bench/results/throughput.json)"
    )
    parser.add_argument(
        "--data-root", default=None, help="demo corpus directory (default: zephon_flow's demo cache)"
    )
    parser.add_argument(
        "--max-code-files", type=int, default=600, help="demo corpus size when it must be built"
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="demo tokenizer vocabulary size")
    parser.add_argument(
        "--engine",
        choices=("hf", "auto", "tiktoken"),
        default="hf",
        help="Tokenize's engine, where it has engine= (default hf: the same engine as the limit)",
    )
    parser.add_argument(
        "--per-element-tokenize",
        action="store_true",
        help="hide Tokenize's batched path (process_batch): the before of a before/after comparison",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run: few steps, one repeat")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.quick else 400
    if args.warmup_steps is None:
        args.warmup_steps = 1 if args.quick else 100
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.early_step is None:
        args.early_step = 1 if args.quick else 10
    if args.late_step is None:
        args.late_step = args.warmup_steps + args.steps
    if args.steps < 1 or args.repeats < 1 or args.warmup_steps < 0:
        parser.error("--steps and --repeats must be positive, --warmup-steps not negative")
    if not 1 <= args.early_step < args.late_step <= args.warmup_steps + args.steps:
        parser.error("need 1 <= --early-step < --late-step <= --warmup-steps + --steps")
    return args


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from tokenizers import Tokenizer

    from zephon_flow.demo_data import build_demo_data, default_demo_root

    root = args.data_root or default_demo_root()
    data = build_demo_data(
        root, max_code_files=args.max_code_files, vocab_size=args.vocab_size, progress=True
    )
    machine = machine_info()
    load_before = _loadavg()

    # The limit's documents: mixed like the pipeline, as many tokens as the timed loader steps.
    _say("counting tokens per document (setup, not timed)")
    texts = load_texts(data.docs_jsonl, data.code_parquet)
    tokenizer = Tokenizer.from_file(data.tokenizer_json)
    counts = [[len(e.ids) for e in tokenizer.encode_batch(t, add_special_tokens=False)] for t in texts]
    doc_bytes = [[len(t.encode("utf-8")) for t in source] for source in texts]
    target = args.steps * GLOBAL_BATCH * SEQ_LEN
    fill = LANES * SHUFFLE_BUFFER * SEQ_LEN  # tokens the loader packs before its first batch
    work = plan_documents(counts, target, seed=SEED)
    warm = plan_documents(counts, fill, seed=SEED + 1)
    work_halves = split_by_tokens(work, counts, WORKERS)
    warm_halves = split_by_tokens(warm, counts, WORKERS)
    work_bytes = sum(doc_bytes[s][r] for s, r in work)
    work_tokens = sum(counts[s][r] for s, r in work)

    tokenize, engine_note = tokenize_options(args.engine)
    engine_used = selected_engine(data, tokenize)
    spec = make_spec(data, tokenize, per_element=args.per_element_tokenize)
    _ = spec.fingerprint  # computed once per spec; kept out of every timing
    # The first processes Loader of a Python process also starts the backend's process
    # machinery (a forkserver that imports Beam): timed once here, kept out of the repeats.
    # (Skipped by --quick, whose single repeat then includes that start.)
    cold: dict[str, Any] | None = None
    if not args.quick:
        _say("cold start: the first processes Loader of this process, to its first batch")
        first_run = run_loader(spec, "processes", 0, 0, ())
        cold = {k: first_run[k] for k in ("init_s", "ttfb_s", "close_s")}
    capture = (args.early_step, args.late_step)

    raw: dict[str, list[Any]] = {name: [] for name in (*CONTENDERS, "resume")}
    states: dict[str, dict[str, Any]] = {}
    checks = {
        "resume_matches_uninterrupted": True,
        "states_identical_across_backends": True,
        "batches_identical_across_backends": True,
        "limit_used_every_worker": True,
    }
    reference: dict[str, Any] = {}

    _say(f"starting {WORKERS} tokenizer processes for the limit")
    pool = LimitPool(data, WORKERS)
    try:
        for rep in range(args.repeats):
            order = CONTENDERS[rep % len(CONTENDERS) :] + CONTENDERS[: rep % len(CONTENDERS)]
            for name in order:
                _say(f"repeat {rep + 1}/{args.repeats}: {name}")
                if name == "limit":
                    result = run_limit(pool, warm_halves, work_halves, work_bytes)
                    checks["limit_used_every_worker"] &= result["distinct_workers"] == WORKERS
                else:
                    backend = name.removeprefix("zephon_")
                    result = run_loader(spec, backend, args.steps, args.warmup_steps, capture)
                    found_states, found_digests = result.pop("_states"), result.pop("_digests")
                    blobs = {s: measure_state(found_states[s]) for s in capture}
                    if not reference:
                        reference = {"digests": found_digests, "states": blobs}
                        states = {
                            "early": {k: v for k, v in blobs[args.early_step].items() if k != "_blob"},
                            "late": {k: v for k, v in blobs[args.late_step].items() if k != "_blob"},
                        }
                    else:
                        checks["batches_identical_across_backends"] &= found_digests == reference["digests"]
                        checks["states_identical_across_backends"] &= all(
                            blobs[s]["_blob"] == reference["states"][s]["_blob"] for s in capture
                        )
                raw[name].append({"repeat": rep, **result})
            # Resume: early and late alternated, each backend in turn.
            steps_order = capture if rep % 2 == 0 else capture[::-1]
            resume: dict[str, dict[str, Any]] = {"processes": {}, "inline": {}}
            for step in steps_order:
                which = "early" if step == args.early_step else "late"
                for backend in ("processes", "inline"):
                    _say(f"repeat {rep + 1}/{args.repeats}: resume {backend} at step {step}")
                    blob = reference["states"][step]["_blob"]
                    got = run_resume(spec, backend, blob, reference["digests"][step], step)
                    checks["resume_matches_uninterrupted"] &= got["matches_uninterrupted"]
                    resume[backend][which] = got
            raw["resume"].append({"repeat": rep, **resume})
    finally:
        pool.close()

    results = summarise(args, data, machine, raw, states, checks, work_tokens, work_bytes, target)
    results["cold_start_processes"] = cold
    results["config"]["tokenize_engine"] = {"requested": engine_note, "selected": engine_used}
    results["config"]["tokenize_batched"] = not args.per_element_tokenize
    results["machine"]["loadavg_before"] = load_before
    results["machine"]["loadavg_after"] = _loadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(markdown(results))
    print(f"\nresults: {out}")
    return results


def summarise(
    args: argparse.Namespace,
    data: Any,
    machine: dict[str, Any],
    raw: dict[str, list[Any]],
    states: dict[str, dict[str, Any]],
    checks: dict[str, bool],
    work_tokens: int,
    work_bytes: int,
    target: int,
) -> dict[str, Any]:
    def med(name: str, key: str) -> float:
        return _median([r[key] for r in raw[name]])

    def med_resume(backend: str, which: str) -> float:
        return _median([r[backend][which]["ttfb_s"] for r in raw["resume"]])

    bytes_per_token = work_bytes / work_tokens
    limit_tps = med("limit", "tokens_per_s")
    proc_tps = med("zephon_processes", "tokens_per_s")
    inline_tps = med("zephon_inline", "tokens_per_s")
    paired = [
        p["tokens_per_s"] / lim["tokens_per_s"]
        for p, lim in zip(raw["zephon_processes"], raw["limit"], strict=True)
    ]
    medians = {
        "limit_tokens_per_s": limit_tps,
        "limit_mb_per_s": med("limit", "mb_per_s"),
        "zephon_processes_tokens_per_s": proc_tps,
        "zephon_processes_mb_per_s_est": proc_tps * bytes_per_token / 1e6,
        "zephon_processes_ttfb_fresh_s": med("zephon_processes", "ttfb_s"),
        "zephon_processes_init_s": med("zephon_processes", "init_s"),
        "zephon_processes_main_cpu_cores": _median(
            [r["main_cpu_s"] / r["seconds"] for r in raw["zephon_processes"]]
        ),
        "zephon_processes_main_cpu_us_per_token": med("zephon_processes", "main_cpu_us_per_token"),
        "zephon_inline_tokens_per_s": inline_tps,
        "zephon_inline_mb_per_s_est": inline_tps * bytes_per_token / 1e6,
        "zephon_inline_ttfb_fresh_s": med("zephon_inline", "ttfb_s"),
        "zephon_inline_init_s": med("zephon_inline", "init_s"),
        "resume_processes_ttfb_early_s": med_resume("processes", "early"),
        "resume_processes_ttfb_late_s": med_resume("processes", "late"),
        "resume_inline_ttfb_early_s": med_resume("inline", "early"),
        "resume_inline_ttfb_late_s": med_resume("inline", "late"),
        "state_bytes_early": states["early"]["bytes"],
        "state_bytes_late": states["late"]["bytes"],
    }
    ratios = {
        "processes_over_limit": proc_tps / limit_tps,
        "processes_over_limit_paired_median": _median(paired),
        "inline_over_limit": inline_tps / limit_tps,
        "processes_over_inline": proc_tps / inline_tps,
        "resume_processes_ttfb_late_over_early": medians["resume_processes_ttfb_late_s"]
        / medians["resume_processes_ttfb_early_s"],
        "resume_inline_ttfb_late_over_early": medians["resume_inline_ttfb_late_s"]
        / medians["resume_inline_ttfb_early_s"],
        "state_bytes_late_over_early": states["late"]["bytes"] / states["early"]["bytes"],
    }
    goals = {
        "processes_over_limit_min": GOAL_THROUGHPUT_RATIO,
        "resume_late_over_early_max": GOAL_RESUME_RATIO,
        "met": {
            "throughput": ratios["processes_over_limit"] >= GOAL_THROUGHPUT_RATIO,
            "resume_time_processes": ratios["resume_processes_ttfb_late_over_early"] <= GOAL_RESUME_RATIO,
            "resume_time_inline": ratios["resume_inline_ttfb_late_over_early"] <= GOAL_RESUME_RATIO,
            "state_size": ratios["state_bytes_late_over_early"] <= GOAL_RESUME_RATIO,
        },
    }
    return {
        "benchmark": "zephon-flow throughput and resume cost",
        "config": {
            "steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "repeats": args.repeats,
            "early_step": args.early_step,
            "late_step": args.late_step,
            "quick": args.quick,
            "data_root": data.root,
            "seq_len": SEQ_LEN,
            "global_batch_size": GLOBAL_BATCH,
            "lanes": LANES,
            "shuffle_buffer": SHUFFLE_BUFFER,
            "mix_weights": list(MIX_WEIGHTS),
            "jsonl_split_bytes": JSONL_SPLIT_BYTES,
            "seed": SEED,
            "workers": WORKERS,
            "loader_tokens_timed": target,
            "limit_tokens": work_tokens,
            "limit_bytes": work_bytes,
            "bytes_per_token": bytes_per_token,
        },
        "machine": machine,
        "medians": medians,
        "ratios": ratios,
        "goals": goals,
        "checks": checks,
        "state": states,
        "raw": raw,
    }


def markdown(results: dict[str, Any]) -> str:
    m, r, c = results["medians"], results["ratios"], results["config"]
    engine = c.get("tokenize_engine", {}).get("selected", "hf")
    rows: list[tuple[str, str, str]] = [
        (
            "limit: tokenizer alone, 2 processes",
            f"{m['limit_tokens_per_s']:,.0f} tok/s",
            f"{m['limit_mb_per_s']:.2f} MB/s",
        ),
        (
            f"zephon-flow, processes x2 (Tokenize: {engine})",
            f"{m['zephon_processes_tokens_per_s']:,.0f} tok/s",
            f"~{m['zephon_processes_mb_per_s_est']:.2f} MB/s; first batch {m['zephon_processes_ttfb_fresh_s']:.2f} s; "
            f"main process uses {m['zephon_processes_main_cpu_cores']:.2f} cores",
        ),
        (
            f"zephon-flow, inline (Tokenize: {engine})",
            f"{m['zephon_inline_tokens_per_s']:,.0f} tok/s",
            f"~{m['zephon_inline_mb_per_s_est']:.2f} MB/s; first batch {m['zephon_inline_ttfb_fresh_s']:.2f} s",
        ),
        (
            "ratio processes / limit",
            f"{r['processes_over_limit']:.2f}",
            f"paired median {r['processes_over_limit_paired_median']:.2f}; goal >= {GOAL_THROUGHPUT_RATIO}",
        ),
        (
            f"resume processes: step {c['early_step']} / {c['late_step']}",
            f"{m['resume_processes_ttfb_early_s']:.2f} s / {m['resume_processes_ttfb_late_s']:.2f} s",
            f"late/early {r['resume_processes_ttfb_late_over_early']:.2f}",
        ),
        (
            f"resume inline: step {c['early_step']} / {c['late_step']}",
            f"{m['resume_inline_ttfb_early_s']:.2f} s / {m['resume_inline_ttfb_late_s']:.2f} s",
            f"late/early {r['resume_inline_ttfb_late_over_early']:.2f}",
        ),
        (
            f"checkpoint bytes: step {c['early_step']} / {c['late_step']}",
            f"{m['state_bytes_early']:,} / {m['state_bytes_late']:,}",
            f"late/early {r['state_bytes_late_over_early']:.2f}",
        ),
    ]
    lines = [
        f"### zephon-flow throughput ({c['steps']} timed steps after {c['warmup_steps']} warm-up, "
        f"{c['global_batch_size']} x {c['seq_len']} tokens each; "
        f"median of {c['repeats']}, {results['machine']['cpu_count']} CPUs)",
        "",
        "| measurement | value | notes |",
        "| --- | --- | --- |",
        *(f"| {a} | {b} | {n} |" for a, b, n in rows),
        "",
        "checks: " + ", ".join(f"{k}={v}" for k, v in results["checks"].items()),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
