"""Beam translation vs the deterministic runner: the same pipeline, the same batches, throughput.

Run from the repository root::

    .venv/bin/python -m bench.beam_translation            # full run (a few minutes on 2 cores)
    .venv/bin/python -m bench.beam_translation --quick    # a small smoke run

The pipeline is the README's text mix (prose and code mixed 3:7, tokenize with an end-of-text
token, pack, shuffle) over the demo corpus (``zephon_flow.demo_data``, built once and
cached in ``<demo root>-beam-bench``), one pass of each source so that both contenders do the same, finite work. In this one process,
contenders alternated within each repeat, median over ``--repeats``:

- ``loader inline``: ``zf.Loader(spec)`` (world size 1, inline backend) to the end, each batch
  digested;
- ``beam FnApiRunner``: the translation (``GlobalBatches(spec)``) on Beam's ``FnApiRunner`` in
  this process, each batch digested in a DoFn and the digests written to a file;
- with ``--parallel``, also ``loader processes x2`` and ``beam FnApiRunner x2 processes``
  (``direct_num_workers=2, direct_running_mode=multi_processing``).

Reported: global batches per second and tokens per second (``steps * B * seq_len``), and each
Beam row's ratio to the loader row of the same parallelism. Every run's digests are compared
with the first loader run's: a contender whose batches differ is reported as such. Nothing is
asserted on time; results go to stdout as Markdown and, with ``--out``, to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner

import zephon_flow as zf
from bench.stats import fmt, machine, median, ratio
from zephon_flow import operators as ops
from zephon_flow.core.batches import Batch, batch_digest
from zephon_flow.demo_data import build_demo_data, default_demo_root
from zephon_flow.engine.materialize import GlobalBatches


def text_mix(
    docs_jsonl: str, code_parquet: str, tokenizer_json: str, *, seq_len: int, lanes: int, batch: int
) -> zf.LoaderSpec:
    """The README's pipeline over one pass of each source (finite: both contenders do it all)."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(docs_jsonl, field="text", split_bytes=64 * 1024, epochs=1)
        code = p | "code" >> ops.ReadParquet(code_parquet, column="content", epochs=1)
        mixed = (docs, code) | "mix" >> ops.Mix(weights=[0.3, 0.7], exhausted="renormalize")
        toks = mixed | "tok" >> beam.ParDo(ops.Tokenize(tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=seq_len))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=32))

    return zf.LoaderSpec(build, lanes=lanes, seed=1234, global_batch_size=batch)


def run_loader(spec: zf.LoaderSpec, backend: str, workers: int) -> list[str]:
    with zf.Loader(spec, backend=backend, workers=workers) as loader:
        return [batch_digest(b) for _, b in loader]


class _Digest(beam.DoFn):  # type: ignore[misc]
    """``(step, batch) -> "step digest"`` lines, one file per step in ``folder``."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self._folder = folder

    def process(self, element: tuple[int, Batch]) -> Iterator[int]:
        step, batch = element
        with open(os.path.join(self._folder, f"{step:08d}"), "w") as f:
            f.write(batch_digest(batch))
        yield step


def run_beam(spec: zf.LoaderSpec, beam_args: list[str]) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="zephon-beam-bench-") as folder:
        with beam.Pipeline(runner=FnApiRunner(), options=PipelineOptions(beam_args)) as p:
            _ = p | GlobalBatches(spec) | beam.ParDo(_Digest(folder))
        steps = sorted(os.listdir(folder))
        digests = []
        for name in steps:
            with open(os.path.join(folder, name)) as f:
                digests.append(f.read())
        return digests


MULTI = ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]


def contenders(spec: zf.LoaderSpec, parallel: bool) -> dict[str, Callable[[], list[str]]]:
    out: dict[str, Callable[[], list[str]]] = {
        "loader inline": lambda: run_loader(spec, "inline", 1),
        "beam FnApiRunner": lambda: run_beam(spec, []),
    }
    if parallel:
        out["loader processes x2"] = lambda: run_loader(spec, "processes", 2)
        out["beam FnApiRunner x2 processes"] = lambda: run_beam(spec, MULTI)
    return out


#: Which loader row each Beam row is divided by.
BASELINE = {"beam FnApiRunner": "loader inline", "beam FnApiRunner x2 processes": "loader processes x2"}


def measure(spec: zf.LoaderSpec, *, repeats: int, parallel: bool, tokens_per_step: int) -> dict[str, Any]:
    runs = contenders(spec, parallel)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    same: dict[str, bool] = dict.fromkeys(runs, True)
    reference: list[str] | None = None
    steps = 0
    for r in range(repeats):
        names = list(runs)
        names = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        for name in names:
            start = time.perf_counter()
            digests = runs[name]()
            seconds[name].append(time.perf_counter() - start)
            if reference is None:
                reference, steps = digests, len(digests)
            same[name] = same[name] and digests == reference
    rows: dict[str, dict[str, Any]] = {}
    for name in runs:
        s = median(seconds[name])
        rows[name] = {
            "seconds": s,
            "samples": seconds[name],
            "steps": steps,
            "steps_per_s": steps / s,
            "tokens_per_s": steps * tokens_per_step / s,
            "same_batches": same[name],
        }
    for name, base in BASELINE.items():
        if name in rows:
            rows[name]["vs_loader"] = ratio(rows[name]["steps_per_s"], rows[base]["steps_per_s"])
    return rows


def report(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| contender | global batches | s (median) | batches/s | tokens/s | / loader | same batches |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['steps']} | {row['seconds']:.2f} | {row['steps_per_s']:.1f} | "
            f"{fmt(row['tokens_per_s'])} | {fmt(row.get('vs_loader'), '.2f')} | "
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parallel", action="store_true", help="also 2 processes on each side")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_code_files, args.repeats = 20, 1
    data = build_demo_data(args.root, max_code_files=args.max_code_files, vocab_size=1024)
    spec = text_mix(
        data.docs_jsonl,
        data.code_parquet,
        data.tokenizer_json,
        seq_len=args.seq_len,
        lanes=args.lanes,
        batch=args.batch,
    )
    rows = measure(
        spec, repeats=args.repeats, parallel=args.parallel, tokens_per_step=args.batch * args.seq_len
    )
    print(report(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
