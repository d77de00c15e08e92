"""What the text pipeline's consumer costs: CPU-seconds per million tokens, per thread.

Run from the repository root::

    .venv/bin/python -m bench.consumer_cost                 # the bench's text data, 3 rounds
    .venv/bin/python -m bench.consumer_cost --steps 60 --rounds 1 --workload W.json

On 2 cores the text pipeline's rate against its tokenizer's limit is bounded by the cores the
workers do not get, mostly the consumer's (``bench/README.md``, speed.py). This measures that
cost alone, with a tokenizer stand-in that costs the workers almost nothing (one ``arange`` per
document, a third as many ids as the text has characters), so the consumer is the bottleneck
and the figure does not depend on the engine's speed:

- ``ReadJsonl`` x 3 -> ``Mix`` -> stand-in -> ``Pack`` -> ``Shuffle``, as ``bench.run``'s text
  workload (``full``), and the same without ``Shuffle`` (``pack``);
- on the processes backend (the consumer's threads: the lane thread, the dispatcher that
  receives results, the trainer's thread) and inline (everything on the lane thread, decoding
  included: an upper bound of what the lane thread does besides transfers).

CPU time comes from ``psutil`` per thread of this process and for the worker processes, between
batch ``--warmup`` and batch ``--warmup + --steps``; tokens are the real (non-padding) tokens of
those batches. Variants alternate within each round; medians over rounds are reported, with the
rounds. CPU per token is steadier than wall time on a shared machine, but it still moves with
the machine's speed: compare variants of one run. Nothing is asserted on time.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import psutil

from bench.contenders.zephon_embedded import make_spec
from bench.stats import median
from bench.workload import TextWorkload, load_workload

VARIANTS = ("full/processes", "pack/processes", "full/inline")


class StandInTokenize(beam.DoFn):  # type: ignore[misc]
    """Ids for a text at almost no cost: ``len(text) // 3 + 1`` of them (about what a BPE
    vocabulary gives), so the documents keep their real lengths for ``Pack``."""

    def process(self, text: str) -> Any:
        n = len(text) // 3 + 1
        yield (np.arange(n, dtype=np.int32) * 7919) % 50000


def _threads() -> dict[str, float]:
    """CPU seconds so far of each thread of this process, by thread name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, "other")
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


def _children() -> float:
    return sum(sum(c.cpu_times()[:2]) for c in psutil.Process().children(recursive=True))


def measure(w: TextWorkload, variant: str, *, steps: int, warmup: int, workers: int) -> dict[str, Any]:
    """One run of ``variant``: CPU-seconds per million real tokens, per consumer thread."""
    import zephon_flow as zf

    shape, backend = variant.split("/")
    spec = make_spec(w, "hf", tokenize=StandInTokenize(), shuffle=shape == "full")
    tokens = 0
    before: tuple[dict[str, float], float, float] | None = None
    with zf.Loader(spec, backend=backend, workers=workers if backend != "inline" else 1) as loader:
        for step, batch in loader:
            if step == warmup:
                before = (_threads(), _children(), time.perf_counter())
            elif step > warmup:
                tokens += int((batch["segment_ids"] >= 0).sum())
            if step == warmup + steps:
                break
        assert before is not None, "the data ended during the warm-up"
        threads, children, seconds = _threads(), _children() - before[1], time.perf_counter() - before[2]
    per_m = 1e6 / max(1, tokens)
    by_thread = {
        name: (cpu - before[0].get(name, 0.0)) * per_m
        for name, cpu in threads.items()
        if cpu > before[0].get(name, 0.0)
    }
    return {
        "variant": variant,
        "consumer_cpu_s_per_m_tokens": sum(by_thread.values()),
        "by_thread": by_thread,
        "workers_cpu_s_per_m_tokens": children * per_m,
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
    }


def run(w: TextWorkload, *, rounds: int, steps: int, warmup: int, workers: int) -> dict[str, Any]:
    raw: list[dict[str, Any]] = []
    for _ in range(rounds):
        for variant in VARIANTS:
            raw.append(measure(w, variant, steps=steps, warmup=warmup, workers=workers))
    table = {}
    for variant in VARIANTS:
        mine = [r for r in raw if r["variant"] == variant]
        threads = sorted({t for r in mine for t in r["by_thread"]})
        table[variant] = {
            "consumer_cpu_s_per_m_tokens": median([r["consumer_cpu_s_per_m_tokens"] for r in mine]),
            "rounds": [round(r["consumer_cpu_s_per_m_tokens"], 4) for r in mine],
            "by_thread": {t: median([r["by_thread"].get(t, 0.0) for r in mine]) for t in threads},
            "workers_cpu_s_per_m_tokens": median([r["workers_cpu_s_per_m_tokens"] for r in mine]),
            "tokens_per_s": median([r["tokens_per_s"] for r in mine]),
        }
    return {"table": table, "raw": raw}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| variant | consumer CPU-s per M tokens [rounds] | by thread | workers CPU-s per M tokens | tokens/s |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for variant, row in result["table"].items():
        threads = ", ".join(f"{t} {v:.4f}" for t, v in sorted(row["by_thread"].items()))
        lines.append(
            f"| {variant} | {row['consumer_cpu_s_per_m_tokens']:.4f} {row['rounds']} | {threads} "
            f"| {row['workers_cpu_s_per_m_tokens']:.4f} | {row['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", help="a text workload JSON (default: bench.run's real data)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.workload:
        w = load_workload(args.workload)
    else:
        from bench.run import parse_args, real_workload

        w, _ = real_workload(parse_args([]))
    result = run(w, rounds=args.rounds, steps=args.steps, warmup=args.warmup, workers=args.workers)
    print(markdown(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
