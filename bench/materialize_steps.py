"""``zephon materialize --steps N``: what the first N global batches cost, against the whole pass.

Run from the repository root::

    .venv/bin/python -m bench.materialize_steps            # full run (a few minutes on 2 cores)
    .venv/bin/python -m bench.materialize_steps --quick    # a small smoke run

The pipeline is the README's text mix (prose and code mixed 3:7, tokenize with an end-of-text
token, pack, shuffle) over one pass of each source of the demo corpus (``zephon_flow.demo_data``,
cached in ``<demo root>-beam-bench``), with a stateless DoFn after each source that counts the
records it sees (one byte appended to a file per record: the records read and decoded). On
Beam's ``FnApiRunner`` in this process, each pair (bounded, before) run back to back, which
goes first alternating, ``--repeats`` times:

- ``steps N, bounded``: ``materialize(spec, steps=N)``: each lane reads only what its windows
  of steps ``< N`` need (``runners/beam/bounded.py``);
- ``steps N, whole pass``: what ``materialize`` ran before: the whole translation
  (``GlobalBatches(spec)``: every step of the pass), steps ``>= N`` dropped at the sink;
- ``whole pass, bounded`` and ``whole pass, per chunk``: every step (``steps`` past the end),
  each lane's chain in one call against the translation that spreads chunks over workers.

With ``--workers 2`` Beam runs two worker processes (``direct_running_mode=multi_processing``),
and ``--lanes 1`` shows what the bounded run gives up: one lane is one worker's work.

Reported per contender: seconds (median), records read, steps written, and whether the
batches equal the ``Loader``'s; and the ratios bounded / before for N steps and for the whole
pass (medians of each round's ratio: the two runs of a round share the machine's load). Nothing is
asserted on time; results go to stdout as Markdown and, with ``--out``, to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner

import zephon_flow as zf
from bench.stats import fmt, machine, median
from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest
from zephon_flow.demo_data import build_demo_data, default_demo_root
from zephon_flow.engine.materialize import GlobalBatches, WriteSteps, materialize, read_materialized


class Counted(beam.DoFn):  # type: ignore[misc]
    """Passes each record on, appending one byte to ``path`` (its size: the records seen)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    def process(self, record: Any) -> Iterator[Any]:
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)
        yield record


def text_mix(
    docs_jsonl: str,
    code_parquet: str,
    tokenizer_json: str,
    counter: str,
    *,
    seq_len: int,
    lanes: int,
    batch: int,
) -> zf.LoaderSpec:
    """The README's pipeline over one pass of each source, each source's records counted."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(docs_jsonl, field="text", split_bytes=64 * 1024, epochs=1)
        code = p | "code" >> ops.ReadParquet(code_parquet, column="content", epochs=1)
        seen_docs = docs | "count docs" >> beam.ParDo(Counted(counter))
        seen_code = code | "count code" >> beam.ParDo(Counted(counter))
        mixed = (seen_docs, seen_code) | "mix" >> ops.Mix(weights=[0.3, 0.7], exhausted="renormalize")
        toks = mixed | "tok" >> beam.ParDo(ops.Tokenize(tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=seq_len))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=32))

    return zf.LoaderSpec(build, lanes=lanes, seed=1234, global_batch_size=batch)


def bounded(spec: zf.LoaderSpec, steps: int, out: str, beam_args: list[str]) -> None:
    materialize(spec, steps=steps, out=out, beam_args=beam_args)


def whole_translation(spec: zf.LoaderSpec, steps: int, out: str, beam_args: list[str]) -> None:
    """What ``materialize`` ran before: every step of the pass, those ``>= steps`` dropped."""
    with beam.Pipeline(runner=FnApiRunner(), options=PipelineOptions(beam_args)) as p:
        _ = p | GlobalBatches(spec) | beam.ParDo(WriteSteps(out, steps))


Run = Callable[[zf.LoaderSpec, int, str, list[str]], None]


def _run(
    spec: zf.LoaderSpec, counter: str, run: Run, steps: int, beam_args: list[str]
) -> tuple[float, int, list[str]]:
    """One run: its seconds, the records it read and the digests of the steps it wrote."""
    with tempfile.TemporaryDirectory(prefix="zephon-materialize-bench-") as out:
        if os.path.exists(counter):
            os.unlink(counter)
        start = time.perf_counter()
        run(spec, steps, out, beam_args)
        seconds = time.perf_counter() - start
        digests = [batch_digest(b) for _, b in read_materialized(out)]
    return seconds, os.path.getsize(counter) if os.path.exists(counter) else 0, digests


def measure(
    spec: zf.LoaderSpec,
    counter: str,
    *,
    steps: int,
    repeats: int,
    reference: list[str],
    beam_args: Sequence[str] = (),
) -> dict[str, dict[str, Any]]:
    """Each pair (bounded, before) ``repeats`` times, its two runs back to back (which goes
    first alternates), for ``steps`` steps and for the whole pass; ``reference``: the
    Loader's digests. Ratios are medians of each round's ratio (the pair shares the load)."""
    everything = len(reference) + 1  # past the end: every step of the pass
    pairs: dict[str, tuple[int, tuple[str, Run], tuple[str, Run]]] = {
        f"steps {steps}": (
            steps,
            (f"steps {steps}, bounded", bounded),
            (f"steps {steps}, whole pass (before)", whole_translation),
        ),
        "whole pass": (
            everything,
            ("whole pass, bounded", bounded),
            ("whole pass, per chunk (before)", whole_translation),
        ),
    }
    rows: dict[str, dict[str, Any]] = {}
    for label, (n, new, old) in pairs.items():
        ratios: dict[str, list[float]] = {"seconds": [], "records_read": []}
        for r in range(repeats):
            measured = {}
            for name, run in [new, old] if r % 2 == 0 else [old, new]:
                seconds, read, digests = _run(spec, counter, run, n, list(beam_args))
                measured[name] = (seconds, read)
                row = rows.setdefault(name, {"samples": [], "records_read": read, "same_batches": True})
                row["samples"].append(seconds)
                row["steps"], row["records_read"] = len(digests), max(row["records_read"], read)
                row["same_batches"] = row["same_batches"] and digests == reference[: min(n, len(reference))]
            for i, key in enumerate(ratios):
                ratios[key].append(measured[new[0]][i] / measured[old[0]][i])
        rows[new[0]]["vs_before"] = {"what": label, **{k: median(v) for k, v in ratios.items()}}
    for row in rows.values():
        row["seconds"] = median(row["samples"])
    return rows


def report(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| contender | steps written | records read | s (median) | s / before | records / before | same batches |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, row in rows.items():
        vs = row.get("vs_before", {})
        lines.append(
            f"| {name} | {row['steps']} | {row['records_read']:,} | {row['seconds']:.2f} | "
            f"{fmt(vs.get('seconds'), '.3f')} | {fmt(vs.get('records_read'), '.3f')} | "
            f"{'yes' if row['same_batches'] else '**no**'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root", default=default_demo_root() + "-beam-bench", help="demo corpus folder (built if missing)"
    )
    parser.add_argument("--max-code-files", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--workers", type=int, default=1, help="Beam worker processes (direct_num_workers; 1: in process)"
    )
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_code_files, args.repeats = 20, 1
    data = build_demo_data(args.root, max_code_files=args.max_code_files, vocab_size=1024)
    with tempfile.TemporaryDirectory(prefix="zephon-materialize-count-") as scratch:
        counter = os.path.join(scratch, "records")
        spec = text_mix(
            data.docs_jsonl,
            data.code_parquet,
            data.tokenizer_json,
            counter,
            seq_len=args.seq_len,
            lanes=args.lanes,
            batch=args.batch,
        )
        with zf.Loader(spec) as loader:
            reference = [batch_digest(b) for _, b in loader]
        beam_args = (
            []
            if args.workers == 1
            else [f"--direct_num_workers={args.workers}", "--direct_running_mode=multi_processing"]
        )
        rows = measure(
            spec, counter, steps=args.steps, repeats=args.repeats, reference=reference, beam_args=beam_args
        )
    print(report(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
