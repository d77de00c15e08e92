"""Throughput of a ramped global batch size against a fixed one, side by side in one run.

```bash
.venv/bin/python examples/make_data.py /tmp/zf-data
.venv/bin/python -m bench.batch_schedule --data /tmp/zf-data
```

The README's pipeline (``ReadJsonl`` + ``ReadParquet``, ``Mix``, ``Tokenize``, ``Pack``,
``Shuffle``; 8 lanes, one rank holding every lane) is run four ways, each until it has made
the same number of rows (``--rows``), in alternating rounds (``--rounds``):

- **fixed**: ``global_batch_size=STOP`` (an int, as before schedules);
- **schedule, one size**: a ``BatchSchedule`` whose size is ``STOP`` for every step run (its
  one change lies past the run): the schedule's code path at the fixed run's sizes;
- **ramp**: ``Ramp(start=START, stop=STOP, steps=RAMP)``: small batches first, as a run that
  warms its batch size up;
- **fixed, the ramp's start**: ``global_batch_size=START``: what small batches cost without a
  schedule (a step has costs that do not grow with its rows: the lanes' snapshots, the queue).

Reported: rows per second and tokens per second (median over the rounds, timed from the first
batch to the last, so the plan's compile is not counted), the CPU seconds the process spent
per 1,000 rows (every thread: with the inline backend all the work; far less disturbed than
wall time by other processes on a shared machine), and each one's ratio to **fixed**.
The lanes make the same outputs in all of them (the sizes only cut them into windows), so the
work per row is the same; what differs is the number of batches and the schedule's lookups.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import zephon_flow as zf
from bench.state_dict_cost import make_spec  # the README's pipeline


def specs(
    data: str, *, seq_len: int, buffer: int, start: int, stop: int, ramp: int
) -> dict[str, zf.LoaderSpec]:
    base = make_spec(data, seq_len, buffer, batch=stop)
    far = 1 << 40  # a change no run reaches

    def spec(size: int | zf.BatchSchedule) -> zf.LoaderSpec:
        return zf.LoaderSpec(base.build, lanes=base.lanes, seed=base.seed, global_batch_size=size)

    return {
        "fixed": base,
        "schedule, one size": spec(zf.BatchSchedule({0: stop, far: 2 * stop})),
        "ramp": spec(zf.BatchSchedule(zf.Ramp(start=start, stop=stop, steps=ramp))),
        "fixed, the ramp's start": spec(start),
    }


def run(spec: zf.LoaderSpec, rows: int, backend: str, workers: int) -> tuple[float, float, int, float]:
    """Rows per second and tokens per second after the first batch, the batches made, and the
    CPU seconds of this process (every thread) per 1,000 rows."""
    made = tokens = steps = 0
    with zf.Loader(spec, backend=backend, workers=workers) as loader:
        batches = iter(loader)
        next(batches)
        t, cpu = time.perf_counter(), time.process_time()
        for _step, batch in batches:
            ids = batch["input_ids"]
            made += len(ids)
            tokens += int(np.count_nonzero(batch["segment_ids"] >= 0)) if "segment_ids" in batch else ids.size
            steps += 1
            if made >= rows:
                break
        seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    return made / seconds, tokens / seconds, steps, cpu / made * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the folder examples/make_data.py wrote")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--buffer", type=int, default=64, help="Shuffle's buffer per lane")
    parser.add_argument("--start", type=int, default=64, help="the ramp's first size")
    parser.add_argument("--stop", type=int, default=512, help="the ramp's last size, and the fixed size")
    parser.add_argument("--ramp", type=int, default=32, help="steps the ramp takes")
    parser.add_argument("--rows", type=int, default=12_000, help="rows each run makes after its first batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", default="inline")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    contenders = specs(
        args.data, seq_len=args.seq_len, buffer=args.buffer, start=args.start, stop=args.stop, ramp=args.ramp
    )
    results: dict[str, list[tuple[float, float, int, float]]] = {name: [] for name in contenders}
    for i in range(args.rounds):
        order = list(contenders) if i % 2 == 0 else list(reversed(contenders))
        for name in order:
            last = run(contenders[name], args.rows, args.backend, args.workers)
            results[name].append(last)
            print(
                f"  round {i + 1}: {name}: {last[0]:,.0f} rows/s, {last[3]:.3f} CPU s per 1k rows", flush=True
            )
    print(
        f"\nREADME pipeline, 8 lanes, seq_len {args.seq_len}, {args.backend} x{args.workers}, "
        f"{args.rows:,} rows a run, median of {args.rounds} rounds; ramp {args.start} -> {args.stop} "
        f"over {args.ramp} steps, fixed {args.stop}\n"
    )
    fixed = statistics.median(r[0] for r in results["fixed"])
    fixed_cpu = statistics.median(r[3] for r in results["fixed"])
    print("| run | batches | rows/s | tokens/s | rows/s / fixed | CPU s per 1k rows | CPU / fixed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in results.items():
        rows_s = statistics.median(r[0] for r in runs)
        tokens_s = statistics.median(r[1] for r in runs)
        cpu = statistics.median(r[3] for r in runs)
        print(
            f"| {name} | {runs[0][2]} | {rows_s:,.0f} | {tokens_s:,.0f} | {rows_s / fixed:.3f} | "
            f"{cpu:.3f} | {cpu / fixed_cpu:.3f} |"
        )


if __name__ == "__main__":
    main()
