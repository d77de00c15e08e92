"""Per-element overhead of stateless DoFns in the front segment: per element vs batched vs a plain loop.

Run from the repository root::

    .venv/bin/python -m bench.stateless_overhead              # full run (about 1 min on 2 cores)
    .venv/bin/python -m bench.stateless_overhead --quick      # a small smoke run

Two measurements, each in this one process, contenders alternated within each repeat and the
median over ``--repeats`` reported, as ratios to the plain loop of the same run:

1. **overhead**: ``FrontSegment.run_chunk`` over ``--elements`` int elements in chunks of
   ``--chunk`` records (one element each), through one stateless DoFn whose work is
   ``x * 2 + 1``: none (the segment's own per-record cost: decode, lists), a user ``beam.DoFn`` with ``process`` (called per element), Beam's own
   ``beam.Map``, ``ops.Map(fn)`` (its ``process_batch`` loops over the chunk) and
   ``ops.Map(fn_on_lists, batched=True)``; against a plain Python loop calling ``fn``.
2. **tokenize**: ``Tokenize`` on the demo corpus documents (built by ``zephon_flow.demo_data``
   and cached), per element (``process_batch`` hidden) and batched (HF ``encode_batch``, or a
   tiktoken loop), in chunks of ``--chunk`` documents; against a loop calling the engine alone.
   The ids of both paths are compared: they must be identical.

Nothing here is asserted on time; results go to stdout as a Markdown table and, with ``--out``,
to JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import apache_beam as beam
import numpy as np

from bench._per_element import PerElementTokenize
from bench.stats import median
from zephon_flow import operators as ops
from zephon_flow.core.source import Record, Source
from zephon_flow.runners.dofns import StatelessInvoker
from zephon_flow.runners.segment import Chunk, FrontSegment


class _Memory(Source):
    """A source whose records are already the elements (only ``decode`` is used here)."""

    def decode(self, record: Record, operator: str) -> list[Any]:
        return [record.payload]


def work(x: int) -> int:
    return x * 2 + 1


def work_on_lists(xs: list[int]) -> list[int]:
    return [x * 2 + 1 for x in xs]


class PerElement(beam.DoFn):  # type: ignore[misc]
    """A user DoFn doing the same work in ``process``."""

    def process(self, x: int) -> Any:
        yield work(x)


def _segment(label: str, dofn: beam.DoFn) -> FrontSegment:
    return FrontSegment([_Memory("memory")], [[StatelessInvoker(label, dofn)]], [])


def _chunks(values: Sequence[Any], size: int) -> list[Chunk]:
    records = [(0, Record(v, "memory", f"element {i}", i)) for i, v in enumerate(values)]
    return [records[i : i + size] for i in range(0, len(records), size)]


def _run(segment: FrontSegment, chunks: list[Chunk]) -> list[Any]:
    out: list[Any] = []
    for chunk in chunks:
        result = segment.run_chunk(chunk)
        assert isinstance(result, list), result
        for outputs in result:
            out.extend(cast(list[Any], outputs))  # no source here skips records
    return out


def _timed(contenders: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per contender, the order rotated from repeat to repeat."""
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    return {n: median(t) for n, t in times.items()}


def overhead(elements: int, chunk: int, repeats: int) -> dict[str, Any]:
    values = list(range(elements))
    chunks = _chunks(values, chunk)
    segments = {
        "no DoFn (decode only)": FrontSegment([_Memory("memory")], [[]], []),
        "DoFn.process per element": _segment("user", PerElement()),
        "beam.Map(fn)": _segment("beam", beam.Map(work).fn),
        "ops.Map(fn)": _segment("map", ops.Map(work)),
        "ops.Map(fn, batched=True)": _segment("batched", ops.Map(work_on_lists, batched=True)),
    }
    want = [work(v) for v in values]
    for name, seg in segments.items():
        assert _run(seg, chunks) == (values if name.startswith("no DoFn") else want), name
    contenders: dict[str, Callable[[], Any]] = {"plain loop": lambda: [work(v) for v in values]}
    contenders.update({name: partial(_run, seg, chunks) for name, seg in segments.items()})
    medians = _timed(contenders, repeats)
    base = medians["plain loop"]
    return {
        name: {"ns_per_element": 1e9 * t / elements, "ratio_to_plain_loop": t / base}
        for name, t in medians.items()
    }


def tokenize(texts: list[str], tokenizer_json: str, chunk: int, repeats: int, engine: str) -> dict[str, Any]:
    batched = ops.Tokenize(tokenizer_json, engine=engine)
    per_element = PerElementTokenize(tokenizer_json, engine=engine)
    chunks = _chunks(texts, chunk)
    segs = {"per element": _segment("tok", per_element), "batched": _segment("tok", batched)}
    a, b = (_run(s, chunks) for s in segs.values())  # also past the engines' checked first documents
    assert len(a) == len(b) == len(texts) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    engine_alone = batched._tokenizer
    assert engine_alone is not None

    def alone() -> None:
        for text in texts:
            np.asarray(engine_alone.encode(text), dtype=np.int32)

    contenders: dict[str, Callable[[], Any]] = {f"{engine_alone.name} engine alone (loop)": alone}
    contenders.update({f"Tokenize {n}": partial(_run, seg, chunks) for n, seg in segs.items()})
    medians = _timed(contenders, repeats)
    base = medians[next(iter(contenders))]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    return {
        name: {"mb_per_s": mb / t, "ratio_to_engine_alone": t / base, "seconds": t}
        for name, t in medians.items()
    }


def _demo_texts(data_root: str | None, limit: int) -> tuple[list[str], str]:
    """The first ``limit`` demo documents, prose and code alternating, and the tokenizer."""
    from bench.demo import load_texts
    from zephon_flow.demo_data import build_demo_data

    data = build_demo_data(data_root, progress=True)
    prose, code = load_texts(data.docs_jsonl, data.code_parquet)
    mixed = [t for pair in zip(prose, code, strict=False) for t in pair]
    return mixed[:limit], data.tokenizer_json


def _table(title: str, rows: dict[str, dict[str, float]]) -> str:
    keys = list(next(iter(rows.values())))
    lines = [f"### {title}", "", "| contender | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {n} | " + " | ".join(f"{v[k]:.3g}" for k in keys) + " |" for n, v in rows.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=200_000)
    parser.add_argument("--chunk", type=int, default=16, help="records per chunk (Loader's default)")
    parser.add_argument("--documents", type=int, default=2000, help="demo documents to tokenize")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engines", default="hf,auto")
    parser.add_argument("--data-root", default=None, help="demo corpus directory (default: its cache)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.elements, args.documents, args.repeats = 2000, 40, 1
    result: dict[str, Any] = {"args": vars(args)}
    result["overhead"] = overhead(args.elements, args.chunk, args.repeats)
    print(_table(f"overhead: {args.elements} elements, chunks of {args.chunk}", result["overhead"]))
    texts, tokenizer_json = _demo_texts(args.data_root, args.documents)
    for engine in args.engines.split(","):
        rows = tokenize(texts, tokenizer_json, args.chunk, args.repeats, engine)
        result[f"tokenize_{engine}"] = rows
        print()
        print(
            _table(f"Tokenize(engine={engine!r}): {len(texts)} demo documents, chunks of {args.chunk}", rows)
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
