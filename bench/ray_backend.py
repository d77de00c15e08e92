"""Stateless throughput per core: ``backend="ray"`` against ``backend="processes"``, same pipeline, one run.

Run from the repository root::

    .venv/bin/python -m bench.ray_backend              # 3 repeats, 400 steps, chunks of 16 and 128
    .venv/bin/python -m bench.ray_backend --quick      # a small smoke run

The pipeline: ``ReadJsonl`` over generated documents (random words, 20 to 300 each, written
once to a temporary folder), ``Tokenize`` with a BPE tokenizer of 2,000 ids trained on them
here, then a stateless ``ops.Map`` that turns the ids into a fixed-shape sample (token count and
sum), so one sample is one document; 8 lanes, global batch 64, one rank, ``--workers`` workers.
Everything but the backend is the same for both contenders.

Each repeat runs both backends, in alternating order, each with a new ``zf.Loader``, from
its first batch to its last (start-up, which for Ray includes the actors' start, is reported
apart). Per core is measured two ways: documents per CPU second spent by this process and all
its descendants (worker processes and the forkserver; the local Ray's GCS, raylet and actors),
which neighbours on a shared machine barely move, and wall-clock documents per second divided
by ``--workers``. The bench starts one local Ray (loopback, ``num_cpus=workers``) that every
ray loader joins (so its background processes count in both contenders' CPU), and checks that
both backends give the same batch digests. Medians over the repeats; the ratio is ray over
processes, of the medians and paired within each repeat. Nothing is asserted on time.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import psutil
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import zephon_flow as zf
from bench.stats import machine, median
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest
from zephon_flow.runners import ray_env

BACKENDS = ("processes", "ray")
WORDS = [
    f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta", "ve", "zo") for b in ("r", "n", "st", "", "ll")
]


def make_data(root: Path, documents: int) -> tuple[str, str]:
    """``documents`` JSONL texts of random words and a BPE tokenizer trained on them."""
    rng = random.Random(13)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(20, 300))) for _ in range(documents)]
    docs = root / "docs.jsonl"
    with docs.open("w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts[:2000], trainer)
    tokenizer = root / "tokenizer.json"
    tok.save(str(tokenizer))
    return str(docs), str(tokenizer)


def summarise(ids: np.ndarray) -> dict[str, np.int64]:
    return {"tokens": np.int64(len(ids)), "total": np.int64(ids.sum())}


def make_spec(docs: str, tokenizer: str) -> zf.LoaderSpec:
    def build(p: beam.Pipeline) -> beam.PCollection:
        text = p | "docs" >> ops.ReadJsonl(docs, field="text", split_bytes=64 * 1024)
        ids = text | "tok" >> beam.ParDo(ops.Tokenize(tokenizer))
        return ids | "summary" >> beam.ParDo(ops.Map(summarise))

    return zf.LoaderSpec(build, lanes=8, seed=3, global_batch_size=64)


def cpu_seconds() -> dict[int, float]:
    """User + system CPU seconds of this process and every descendant (worker processes, the
    forkserver; a local Ray's GCS, raylet and actors), by pid."""
    out: dict[int, float] = {}
    me = psutil.Process()
    for proc in (me, *me.children(recursive=True)):
        try:
            times = proc.cpu_times()
        except psutil.Error:  # ended while being read
            continue
        out[proc.pid] = times.user + times.system
    return out


def spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two ``cpu_seconds()`` readings (a process new in ``after``
    counts from 0)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def run_once(spec: zf.LoaderSpec, backend: str, *, steps: int, workers: int, chunk: int) -> dict[str, Any]:
    """One loader from creation to ``steps`` batches: start-up, docs/s after the first batch, digests."""
    started = time.perf_counter()
    digests: list[str] = []
    with zf.Loader(spec, backend=backend, workers=workers, chunk_records=chunk) as loader:
        for step, batch in loader:
            digests.append(batch_digest(batch))
            if step == 0:
                first, cpu_first = time.perf_counter(), cpu_seconds()
            if step + 1 == steps:
                break
        last, cpu = time.perf_counter(), spent(cpu_first, cpu_seconds())
    docs = (steps - 1) * spec.global_batch_size
    return {
        "startup_s": first - started,
        "docs_per_s": docs / (last - first),
        "docs_per_s_per_core": docs / (last - first) / workers,
        "cpu_s": cpu,
        "docs_per_cpu_s": docs / cpu,
        "digests": digests,
    }


def measure(
    spec: zf.LoaderSpec, *, steps: int, workers: int, chunks: list[int], repeats: int
) -> dict[str, Any]:
    """Per chunk size: both backends' runs, medians and the ray/processes ratios."""
    out: dict[str, Any] = {}
    for chunk in chunks:
        runs: dict[str, list[dict[str, Any]]] = {b: [] for b in BACKENDS}
        for r in range(repeats):
            for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                runs[backend].append(run_once(spec, backend, steps=steps, workers=workers, chunk=chunk))
        same = all(a["digests"] == b["digests"] for a, b in zip(runs["processes"], runs["ray"], strict=True))
        row: dict[str, Any] = {"digests_equal": same}
        for backend in BACKENDS:
            row[backend] = {
                "docs_per_cpu_s": median(x["docs_per_cpu_s"] for x in runs[backend]),
                "docs_per_s_per_core": median(x["docs_per_s_per_core"] for x in runs[backend]),
                "startup_s": median(x["startup_s"] for x in runs[backend]),
                "runs": [{k: v for k, v in x.items() if k != "digests"} for x in runs[backend]],
            }
        row["ray_over_processes"] = row["ray"]["docs_per_cpu_s"] / row["processes"]["docs_per_cpu_s"]
        row["ray_over_processes_paired"] = median(
            a["docs_per_cpu_s"] / b["docs_per_cpu_s"]
            for a, b in zip(runs["ray"], runs["processes"], strict=True)
        )
        row["ray_over_processes_wall"] = median(
            a["docs_per_s"] / b["docs_per_s"] for a, b in zip(runs["ray"], runs["processes"], strict=True)
        )
        out[str(chunk)] = row
    return out


def render(results: dict[str, Any], workers: int) -> str:
    lines = [
        "| chunk (records) | processes docs/CPU-s | ray docs/CPU-s | ray / processes (paired) "
        "| wall docs/s/core (processes, ray) | ray / processes, wall | start-up s (processes, ray) "
        "| digests equal |",
        "| ---: | ---: | ---: | ---: | --- | ---: | --- | --- |",
    ]
    for chunk, row in results.items():
        p, r = row["processes"], row["ray"]
        lines.append(
            f"| {chunk} | {p['docs_per_cpu_s']:,.0f} | {r['docs_per_cpu_s']:,.0f} | "
            f"{row['ray_over_processes']:.2f} ({row['ray_over_processes_paired']:.2f}) | "
            f"{p['docs_per_s_per_core']:,.0f}, {r['docs_per_s_per_core']:,.0f} | "
            f"{row['ray_over_processes_wall']:.2f} | "
            f"{p['startup_s']:.1f}, {r['startup_s']:.1f} | {row['digests_equal']} |"
        )
    return "\n".join(lines) + (
        f"\n\n{workers} workers. docs/CPU-s: documents per CPU second of this process and all its "
        f"descendants (workers, a local Ray's processes); wall docs/s/core: documents per second "
        f"divided by the workers."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunks", default="16,128", help="chunk_records values, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2,000 documents, 40 steps, 1 repeat")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.documents, args.steps, args.repeats = 2_000, 40, 1
    chunks = [int(c) for c in args.chunks.split(",")]
    started_ray = ray_env.connect("bench.ray_backend", None, num_cpus=args.workers)
    try:
        with tempfile.TemporaryDirectory(prefix="zephon-bench-ray-") as tmp:
            spec = make_spec(*make_data(Path(tmp), args.documents))
            results = measure(
                spec, steps=args.steps, workers=args.workers, chunks=chunks, repeats=args.repeats
            )
    finally:
        ray_env.disconnect_if_started(started_ray)
    print(render(results, args.workers))
    if args.out:
        config = {k: getattr(args, k) for k in ("documents", "steps", "workers", "chunks", "repeats")}
        payload = {"config": config, "machine": machine(), "results": results}
        Path(args.out).write_text(json.dumps(payload, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
