"""Cost of ``ZephonDataset.state_dict()`` per call, of serialising it, and of the state ring.

```bash
.venv/bin/python examples/make_data.py /tmp/zf-data
.venv/bin/python -m bench.state_dict_cost --data /tmp/zf-data                     # README settings
.venv/bin/python -m bench.state_dict_cost --data /tmp/zf-data --seq-len 2048 --buffer 1024
```

The README's pipeline (``ReadJsonl`` + ``ReadParquet``, ``Mix``, ``Tokenize``, ``Pack``,
``Shuffle``; 8 lanes, global batch 32, one process holding every lane, inline backend) is run
until its shuffle buffers are full (``--warm`` steps), then for ``--steps`` steps calling
``ds.state_dict()`` after every batch, as torchdata's ``StatefulDataLoader`` and accelerate do.
Reported: milliseconds per ``state_dict()`` call (median and max), the milliseconds to
serialise one (``torch.save`` to memory: what a checkpoint pays once), and seconds per batch
with ``keep_states=8`` against ``keep_states=1`` (the ring's throughput cost), when the
dataset has that option.
"""

from __future__ import annotations

import argparse
import inspect
import io
import statistics
import time
from typing import Any

# isort: off
import zephon_flow as zf  # first: it quiets notices Beam logs when imported

import apache_beam as beam
import torch

# isort: on
from zephon_flow import operators as ops
from zephon_flow.torch import ZephonDataset


def make_spec(data: str, seq_len: int, buffer: int, batch: int = 32) -> zf.LoaderSpec:
    """The README's pipeline over ``examples/make_data.py``'s files (8 lanes)."""

    def text_mix(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(f"{data}/web/*.jsonl.gz", field="text")
        code = p | "code" >> ops.ReadParquet(f"{data}/code/*.parquet", column="content")
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.7, 0.3])
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(f"{data}/tokenizer.json", append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=seq_len))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=buffer))

    return zf.LoaderSpec(text_mix, lanes=8, seed=1234, global_batch_size=batch)


def run(spec: zf.LoaderSpec, warm: int, steps: int, **options: Any) -> tuple[list[float], float, float]:
    """``state_dict()`` milliseconds per call, serialise milliseconds, seconds per batch."""
    ds = ZephonDataset.from_loader(spec, **options)
    calls: list[float] = []
    batches = iter(ds)
    for _ in range(warm):
        next(batches)
    start = time.perf_counter()
    for _ in range(steps):
        next(batches)
        t = time.perf_counter()
        state = ds.state_dict()
        calls.append((time.perf_counter() - t) * 1e3)
    per_batch = (time.perf_counter() - start - sum(calls) / 1e3) / steps
    t = time.perf_counter()
    torch.save(state, io.BytesIO())
    serialise = (time.perf_counter() - t) * 1e3
    if hasattr(ds, "local_state"):  # the same state encoded whole, once more (for comparison)
        t = time.perf_counter()
        ds.local_state()
        print(f"  encoding this rank's state whole: {(time.perf_counter() - t) * 1e3:.1f} ms")
    ds.close()
    return calls, serialise, per_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the folder examples/make_data.py wrote")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--buffer", type=int, default=256)
    parser.add_argument("--warm", type=int, default=0, help="steps before measuring (default: fill)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    spec = make_spec(args.data, args.seq_len, args.buffer)
    # A lane's shuffle buffer is full once it has taken `buffer` sequences; a step takes 4 a lane.
    warm = args.warm or args.buffer // (spec.global_batch_size // spec.lanes) + 1
    ring = "keep_states" in inspect.signature(ZephonDataset.from_loader).parameters
    calls, serialise, per_batch = run(spec, warm, args.steps)
    print(
        f"seq_len {args.seq_len} buffer {args.buffer} lanes 8: state_dict() "
        f"median {statistics.median(calls):.3f} ms, max {max(calls):.3f} ms per call "
        f"({args.steps} calls after {warm} steps); serialising one: {serialise:.1f} ms; "
        f"{per_batch * 1e3:.2f} ms per batch" + (" (keep_states=8)" if ring else "")
    )
    if ring:
        _, _, single = run(spec, warm, args.steps, keep_states=1)
        print(f"  keep_states=1: {single * 1e3:.2f} ms per batch")


if __name__ == "__main__":
    main()
