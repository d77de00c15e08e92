"""Cost of self-verifying resume: bytes per checkpoint, time per save, time on resume, throughput.

```bash
.venv/bin/python examples/make_data.py /tmp/zf-data
.venv/bin/python -m bench.verify_cost --data /tmp/zf-data
```

The README's pipeline (``ReadJsonl`` + ``ReadParquet``, ``Mix``, ``Tokenize``, ``Pack``,
``Shuffle``; 8 lanes, one rank holding every lane, inline backend). Reported:

- bytes the next-window checks add to a checkpoint (per lane and in all), against its size;
- milliseconds ``state()`` takes to complete a state with the checks (hashing the next window
  and the records read for it, plus any wait for the producer), per call;
- seconds per batch when ``state()`` is called after every batch against never (``--rounds``
  alternating pairs): what the checks cost a trainer that saves at every step;
- seconds to the first batch of a resume, verified against ``verify_resume=False``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import zephon_flow as zf
from bench.state_dict_cost import make_spec  # the README's pipeline
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.checkpoint.window_check import WindowCheck


def per_batch(
    spec: zf.LoaderSpec, steps: int, *, save_every_step: bool, train: float = 0.0, state: Any = None
) -> tuple[float, list[float], float]:
    """Seconds per batch (wall time, state() included), the state() times in ms, and the ms to
    hash the checks of one step's next windows (every lane), measured apart. ``train``: seconds
    a simulated training step takes after each batch (the trainer-bound regime)."""
    calls: list[float] = []
    with zf.Loader(spec, state=state) as loader:
        batches = iter(loader)
        next(batches)
        start = time.perf_counter()
        for _ in range(steps):
            next(batches)
            if train:
                time.sleep(train)  # the trainer's step (a benchmark, not a test)
            if save_every_step:
                t = time.perf_counter()
                loader.state()
                calls.append((time.perf_counter() - t) * 1e3)
        took = time.perf_counter() - start
        made = [ln.made for ln in loader._lanes if ln.made is not None and ln.made.samples]
        t = time.perf_counter()
        for m in made:
            WindowCheck.of(m.samples, m.fed)
        hashing = (time.perf_counter() - t) * 1e3
    return took / steps, calls, hashing


def first_batch(spec: zf.LoaderSpec, state: Any, *, verify: bool) -> float:
    t = time.perf_counter()
    with zf.Loader(spec, state=state, verify_resume=verify) as loader:
        next(iter(loader))
        return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the folder examples/make_data.py wrote")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--buffer", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--train-ms", type=float, default=0.0, help="a simulated training step after each batch"
    )
    args = parser.parse_args()

    def fresh() -> zf.LoaderSpec:  # a spec per loader: each loader owns (and tears down) its DoFns
        return make_spec(args.data, args.seq_len, args.buffer, args.batch)

    spec = fresh()
    # the checkpoint at --steps, with and without the checks
    with zf.Loader(spec) as loader:
        for step, _ in loader:
            if step + 1 == args.steps:
                break
        state = loader.state()
    bare = dataclasses.replace(
        state, lane_states={k: dataclasses.replace(v, next_window=None) for k, v in state.lane_states.items()}
    )
    with_checks, without = len(zf.encode_state(state)), len(zf.encode_state(bare))
    records = [ls.next_window.records for ls in state.lane_states.values() if ls.next_window is not None]
    print(
        f"checkpoint at step {state.step}: {with_checks} bytes, {without} without the checks: "
        f"{with_checks - without} bytes added ({(with_checks - without) / spec.lanes:.0f} per lane; "
        f"{100 * (with_checks - without) / without:.2f} %); records read per next window: {records}"
    )
    times: dict[bool, list[float]] = {True: [], False: []}
    calls: list[float] = []
    hashing: list[float] = []
    for _ in range(args.rounds):
        for save in (False, True):
            took, ms, hashed = per_batch(fresh(), args.steps, save_every_step=save, train=args.train_ms / 1e3)
            times[save].append(took)
            calls += ms
            if not save:  # the last windows' checks were not computed by state()
                hashing.append(hashed)
    never, every = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"wall seconds per batch, state() never: {never:.4f} ({[round(t, 4) for t in times[False]]}), "
        f"after every batch: {every:.4f} ({[round(t, 4) for t in times[True]]}): "
        f"{100 * (every - never) / never:+.1f} %"
    )
    print(
        f"state() ms per call (checks of {spec.lanes} lanes): median {statistics.median(calls):.2f}, "
        f"max {max(calls):.2f} (the wait for the producer included); hashing alone, ms per step: "
        f"{statistics.median(hashing):.2f} ({[round(h, 2) for h in hashing]})"
    )
    data = zf.encode_state(state)
    firsts: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for verify in (False, True):
            firsts[verify].append(first_batch(fresh(), data, verify=verify))
    off, on = statistics.median(firsts[False]), statistics.median(firsts[True])
    print(
        f"seconds to the first batch of a resume, verify_resume=False: {off:.3f} "
        f"({[round(t, 3) for t in firsts[False]]}), verified: {on:.3f} "
        f"({[round(t, 3) for t in firsts[True]]}): {1e3 * (on - off):+.1f} ms"
    )
    loaded = to_loader_state(zf.decode_state(data))
    assert all(ls.next_window is not None for ls in loaded.lane_states.values())


if __name__ == "__main__":
    main()
