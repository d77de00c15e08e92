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
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import report, stats
from bench.contenders.harness import Batch, first_batch, run_throughput
from bench.contenders.limit import run_parts
from bench.contenders.zephon_embedded import ZephonEmbedded
from bench.demo import (
    GLOBAL_BATCH,
    JSONL_SPLIT_BYTES,
    LANES,
    SEQ_LEN,
    SHUFFLE_BUFFER,
    load_texts,
    pipeline_spec,
)
from bench.workload import TextWorkload

MIX_WEIGHTS = (0.5, 0.5)
SEED = 0
WORKERS = 2

DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "throughput.json")
CONTENDERS = ("limit", "zephon_processes", "zephon_inline")

# A document reference: (source index, row index) with source 0 = prose JSONL, 1 = code Parquet.
DocRef = tuple[int, int]


# -- the limit's documents --------------------------------------------------------------------


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


def _limit_worker(
    tokenizer_json: str,
    docs_jsonl: str,
    code_parquet: str,
    warm: list[list[DocRef]],
    work: list[list[DocRef]],
    part: int,
    parts: int,
    target: int,
    barrier: Any,
    out: Any,
) -> None:
    """One limit process: loads its tokenizer and the corpus, encodes its ``warm`` part untimed,
    waits for the others, then encodes its ``work`` part one ``encode`` call per document, as
    ``Tokenize`` does, and counts the ids."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_json)
    texts = load_texts(docs_jsonl, code_parquet)
    for source, row in warm[part]:
        tokenizer.encode(texts[source][row], add_special_tokens=False)
    barrier.wait()
    start = time.perf_counter()
    tokens = 0
    for source, row in work[part]:
        tokens += len(tokenizer.encode(texts[source][row], add_special_tokens=False).ids)
    seconds = time.perf_counter() - start
    out.put({"pid": os.getpid(), "tokens": tokens, "docs": len(work[part]), "seconds": seconds})


def run_limit(
    data: Any, warm: list[list[DocRef]], work: list[list[DocRef]], work_bytes: int
) -> dict[str, Any]:
    """``WORKERS`` spawned processes, each warmed on as much text as the loader encodes before
    its first batch (the shuffle fill), then timed together from a barrier on its ``work`` part;
    the rate is all processes' tokens over the slowest one's time."""
    head = (data.tokenizer_json, data.docs_jsonl, data.code_parquet, warm, work)
    results = run_parts(_limit_worker, head, WORKERS, 0)
    seconds = max(r["seconds"] for r in results)
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
    """The demo pipeline over ``data`` (a ``DemoData``), mixed ``MIX_WEIGHTS``; ``tokenize`` holds
    extra ``Tokenize`` keyword arguments (see ``tokenize_options``)."""
    return pipeline_spec(
        data.docs_jsonl,
        data.code_parquet,
        data.tokenizer_json,
        weights=MIX_WEIGHTS,
        seed=SEED,
        tokenize=tokenize,
        per_element=per_element,
    )


def demo_workload(data: Any) -> TextWorkload:
    """The demo pipeline's geometry as the harness's workload (``make_spec`` builds its pipeline)."""
    return TextWorkload(
        tokenizer=data.tokenizer_json,
        sources={"docs": data.docs_jsonl, "code": data.code_parquet},
        weights={"docs": MIX_WEIGHTS[0], "code": MIX_WEIGHTS[1]},
        seq_len=SEQ_LEN,
        global_batch=GLOBAL_BATCH,
        lanes=LANES,
        shuffle_per_lane=SHUFFLE_BUFFER,
        seed=SEED,
    )


def run_loader(
    c: ZephonEmbedded, w: TextWorkload, steps: int, warmup: int, capture: Sequence[int]
) -> dict[str, Any]:
    """``1 + warmup + steps`` batches timed by the harness (``run_throughput``); tokens/s over
    the last ``steps``.

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

    def observe(step: int, batch: Batch) -> None:
        if step in want:
            digests[step] = zf.batch_digest(batch)
        if step + 1 in want:
            assert c.session is not None
            states[step + 1] = c.session.state()

    task = {"steps": steps, "warmup": warmup, "workers": WORKERS}
    result = run_throughput(c, w, task, observe)
    cpu_s = result["main_cpu_cores"] * result["seconds"]
    return {
        "backend": c.backend,
        "init_s": c.init_s,
        **result,
        "steps_per_s": steps / result["seconds"],
        # CPU time of this (the trainer's) process, all threads, over the timed steps.
        "main_cpu_s": cpu_s,
        "main_cpu_us_per_token": 1e6 * cpu_s / result["tokens"],
        "last_step": warmup + steps,
        "_states": states,
        "_digests": digests,
    }


def run_resume(
    c: ZephonEmbedded, w: TextWorkload, blob: bytes, expect_digest: str, step: int
) -> dict[str, Any]:
    """Time from ``Loader(spec, state=checkpoint bytes)`` to its first batch, checked against the
    uninterrupted run's batch at that step."""
    import zephon_flow as zf

    batch, times = first_batch(c, w, workers=WORKERS, state=blob)
    assert c.session is not None
    got_step = c.session.step
    return {
        "backend": c.backend,
        "step": step,
        "init_s": c.init_s,
        "ttfb_s": times["ttfb_s"],
        "first_step": got_step,
        "matches_uninterrupted": got_step == step and zf.batch_digest(batch) == expect_digest,
    }


def measure_state(state: dict[str, Any]) -> dict[str, Any]:
    import zephon_flow as zf

    start = time.perf_counter()
    blob = zf.encode_state(zf.LoaderState.from_plain(state))
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


def versions() -> dict[str, str]:
    """The versions of what the measured work runs on."""
    import apache_beam
    import numpy
    import pyarrow
    import tokenizers

    import zephon_flow

    return {
        "zephon_flow": zephon_flow.__version__,
        "tokenizers": tokenizers.__version__,
        "apache_beam": apache_beam.__version__,
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
    }


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


@dataclass(frozen=True)
class LimitWork:
    """The limit's documents: mixed like the pipeline, as many tokens as the timed loader steps
    (``work``) and as the loader packs before its first batch (``warm``), cut in ``WORKERS``
    parts of equal token count."""

    warm: list[list[DocRef]]
    work: list[list[DocRef]]
    tokens: int
    bytes: int
    target: int  # tokens of the loader's timed steps


def limit_work(data: Any, steps: int) -> LimitWork:
    from tokenizers import Tokenizer

    _say("counting tokens per document (setup, not timed)")
    texts = load_texts(data.docs_jsonl, data.code_parquet)
    tokenizer = Tokenizer.from_file(data.tokenizer_json)
    counts = [[len(e.ids) for e in tokenizer.encode_batch(t, add_special_tokens=False)] for t in texts]
    doc_bytes = [[len(t.encode("utf-8")) for t in source] for source in texts]
    target = steps * GLOBAL_BATCH * SEQ_LEN
    fill = LANES * SHUFFLE_BUFFER * SEQ_LEN  # tokens the loader packs before its first batch
    work = plan_documents(counts, target, seed=SEED)
    warm = plan_documents(counts, fill, seed=SEED + 1)
    return LimitWork(
        warm=split_by_tokens(warm, counts, WORKERS),
        work=split_by_tokens(work, counts, WORKERS),
        tokens=sum(counts[s][r] for s, r in work),
        bytes=sum(doc_bytes[s][r] for s, r in work),
        target=target,
    )


@dataclass
class Runs:
    """What the repeats gather: every run, the checkpoints' sizes, the determinism checks, and
    the first loader run's digests and checkpoints (what resumes are compared with)."""

    raw: dict[str, list[Any]] = field(default_factory=lambda: {n: [] for n in (*CONTENDERS, "resume")})
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: dict[str, bool] = field(
        default_factory=lambda: {
            "resume_matches_uninterrupted": True,
            "states_identical_across_backends": True,
            "batches_identical_across_backends": True,
            "limit_used_every_worker": True,
        }
    )
    reference: dict[str, Any] = field(default_factory=dict)


def run_contenders(
    args: argparse.Namespace, rep: int, runs: Runs, data: Any, limit: LimitWork, loaders: dict[str, Any]
) -> None:
    """One repeat of the throughput contenders, their order rotated by the repeat."""
    capture = (args.early_step, args.late_step)
    workload = demo_workload(data)
    for name in stats.rotated(CONTENDERS, rep):
        _say(f"repeat {rep + 1}/{args.repeats}: {name}")
        if name == "limit":
            result = run_limit(data, limit.warm, limit.work, limit.bytes)
            runs.checks["limit_used_every_worker"] &= result["distinct_workers"] == WORKERS
        else:
            result = run_loader(loaders[name], workload, args.steps, args.warmup_steps, capture)
            found_states, found_digests = result.pop("_states"), result.pop("_digests")
            blobs = {s: measure_state(found_states[s]) for s in capture}
            if not runs.reference:
                runs.reference = {"digests": found_digests, "states": blobs}
                runs.states = {
                    "early": {k: v for k, v in blobs[args.early_step].items() if k != "_blob"},
                    "late": {k: v for k, v in blobs[args.late_step].items() if k != "_blob"},
                }
            else:
                runs.checks["batches_identical_across_backends"] &= found_digests == runs.reference["digests"]
                runs.checks["states_identical_across_backends"] &= all(
                    blobs[s]["_blob"] == runs.reference["states"][s]["_blob"] for s in capture
                )
        runs.raw[name].append({"repeat": rep, **result})


def run_resumes(args: argparse.Namespace, rep: int, runs: Runs, data: Any, loaders: dict[str, Any]) -> None:
    """One repeat of the resumes: early and late alternated, each backend in turn."""
    capture = (args.early_step, args.late_step)
    steps_order = capture if rep % 2 == 0 else capture[::-1]
    resume: dict[str, dict[str, Any]] = {"processes": {}, "inline": {}}
    for step in steps_order:
        which = "early" if step == args.early_step else "late"
        for backend in ("processes", "inline"):
            _say(f"repeat {rep + 1}/{args.repeats}: resume {backend} at step {step}")
            blob = runs.reference["states"][step]["_blob"]
            loader = loaders[f"zephon_{backend}"]
            got = run_resume(loader, demo_workload(data), blob, runs.reference["digests"][step], step)
            runs.checks["resume_matches_uninterrupted"] &= got["matches_uninterrupted"]
            resume[backend][which] = got
    runs.raw["resume"].append({"repeat": rep, **resume})


def run_config(args: argparse.Namespace, data: Any, limit: LimitWork) -> dict[str, Any]:
    return {
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
        "loader_tokens_timed": limit.target,
        "limit_tokens": limit.tokens,
        "limit_bytes": limit.bytes,
        "bytes_per_token": limit.bytes / limit.tokens,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from zephon_flow.demo_data import build_demo_data, default_demo_root

    root = args.data_root or default_demo_root()
    data = build_demo_data(
        root, max_code_files=args.max_code_files, vocab_size=args.vocab_size, progress=True
    )
    machine = {**stats.machine(), "versions": versions()}
    limit = limit_work(data, args.steps)

    tokenize, engine_note = tokenize_options(args.engine)
    engine_used = selected_engine(data, tokenize)
    spec = make_spec(data, tokenize, per_element=args.per_element_tokenize)
    _ = spec.fingerprint  # computed once per spec; kept out of every timing
    loaders = {n: ZephonEmbedded({"backend": n.removeprefix("zephon_")}, spec) for n in CONTENDERS[1:]}
    # The first processes Loader of a Python process also starts the backend's process
    # machinery (a forkserver that imports Beam): timed once here, kept out of the repeats.
    # (Skipped by --quick, whose single repeat then includes that start.)
    cold: dict[str, Any] | None = None
    if not args.quick:
        _say("cold start: the first processes Loader of this process, to its first batch")
        first = loaders["zephon_processes"]
        _, times = first_batch(first, demo_workload(data), workers=WORKERS, state=None)
        cold = {"init_s": first.init_s, **times}

    runs = Runs()
    for rep in range(args.repeats):
        run_contenders(args, rep, runs, data, limit, loaders)
        run_resumes(args, rep, runs, data, loaders)

    results = report.summarise_throughput(
        config=run_config(args, data, limit),
        machine=machine,
        raw=runs.raw,
        states=runs.states,
        checks=runs.checks,
    )
    results["cold_start_processes"] = cold
    results["config"]["tokenize_engine"] = {"requested": engine_note, "selected": engine_used}
    results["config"]["tokenize_batched"] = not args.per_element_tokenize
    results["machine"]["loadavg_before"] = machine["loadavg"]
    results["machine"]["loadavg_after"] = stats.loadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(report.markdown_throughput(results))
    print(f"\nresults: {out}")
    return results


if __name__ == "__main__":
    main()
