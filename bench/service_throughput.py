"""Throughput of the gRPC batch service, side by side with its baselines in the same run.

Run from the repository root::

    .venv/bin/python -m bench.service_throughput            # full run
    .venv/bin/python -m bench.service_throughput --quick    # a small smoke run

Two measurements:

1. **transport**: a client (``zf.Client``, one rank) reading synthetic batches of 1 MiB and
   ~4 MiB per message from a ``BatchServer`` fed by a loader that repeats one batch (once with
   the default bounds, once with ``held_bytes`` = ``HELD_MESSAGES`` messages, ``--held-bytes``),
   against a raw gRPC server-streaming method that sends pre-made ``bytes`` of the same message size,
   with identity (de)serializers on both ends. Each server runs in its own spawned process;
   the client is this process. Client-observed MB/s and batches/s, and the service/raw ratio.
2. **end to end**: tokens/s of ``zephon serve`` on the demo pipeline (``zephon_flow.demo``),
   read by one client rank, against the embedded ``zf.Loader`` on the same pipeline with the
   same backend and workers; both timed after a warm-up, in the same run.

Contenders alternate within each repeat; medians over repeats are reported. Timings are never
asserted anywhere. See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from bench.stats import median
from zephon_flow.core.checkpoint.state import LoaderState

COLS = 4096  # int32 tokens per row: 16 KiB rows
SIZES = {"1MiB": 64, "4MiB": 252}  # rows per message; 252 rows stay under the 4 MiB chunk
RAW_METHOD = "/bench.Raw/Stream"
DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "service_throughput.json")
TOKENS_PER_STEP = 32 * 512  # the demo pipeline's global batch
AHEAD = 32  # the server's ahead (its default); messages carry it, so the raw ones are as long


class RepeatingLoader:
    """Loader-like: yields the same global batch forever (the server's producer outpaces any client)."""

    def __init__(self, batch: dict[str, np.ndarray]) -> None:
        self.batch, self.step = batch, 0

    def __iter__(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        while True:
            self.step += 1
            yield self.step - 1, self.batch

    def state(self) -> LoaderState:
        return LoaderState(step=self.step, lanes=1, fingerprint={}, lane_states={})

    def close(self) -> None:
        pass


def synthetic_batch(rows: int) -> dict[str, np.ndarray]:
    return {"tokens": np.arange(rows * COLS, dtype=np.int32).reshape(rows, COLS)}


#: ``--held-bytes`` of the bounded service contender, in messages: 8 MiB at 1 MiB per message.
HELD_MESSAGES = 8


def _serve_service(config: tuple[int, int | None], ports: Any) -> None:
    import apache_beam as beam

    import zephon_flow as zf
    from zephon_flow import operators as ops
    from zephon_flow.service.server import BatchServer

    tmp = tempfile.mkdtemp()
    with open(os.path.join(tmp, "one.jsonl"), "w") as f:
        f.write('{"text": "x"}\n')

    def build(p: beam.Pipeline) -> beam.PCollection:
        return p | "src" >> ops.ReadJsonl(os.path.join(tmp, "one.jsonl"))

    rows, held_bytes = config
    spec = zf.LoaderSpec(build, lanes=1, global_batch_size=rows)
    # Every repeat reconnects where the previous one stopped: keep enough steps for that
    # (with ``held_bytes``, the kept steps go first, and the reconnect is at the next step).
    server = BatchServer(
        spec, loader=RepeatingLoader(synthetic_batch(rows)), ahead=AHEAD, keep=64, held_bytes=held_bytes
    ).start()
    ports.put(server.port)
    server.wait()


def _serve_raw(size: int, ports: Any) -> None:
    from concurrent import futures

    import grpc

    message = bytes(size)

    def stream(request: bytes, context: Any) -> Iterator[bytes]:
        for _ in range(int(request)):
            yield message

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        handlers=[handler],
        options=[("grpc.max_send_message_length", 8 << 20)],
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ports.put(port)
    server.wait_for_termination()


def _start(target: Any, arg: object) -> tuple[Any, int]:
    ctx = get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=target, args=(arg, ports), daemon=True)
    proc.start()
    return proc, int(ports.get(timeout=120))


def read_raw(port: int, messages: int) -> tuple[float, int]:
    import grpc

    options = [("grpc.max_receive_message_length", 8 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        call = channel.unary_stream(RAW_METHOD)(str(messages + 1).encode())
        received = 0
        for n, msg in enumerate(call):
            if n == 0:
                start = time.perf_counter()  # timed from the first message on
                continue
            received += len(msg)
    return time.perf_counter() - start, received


def read_service(port: int, messages: int, message_bytes: int, start_step: int) -> tuple[float, int, int]:
    import zephon_flow as zf

    with zf.Client(f"127.0.0.1:{port}", 0, 1, start_step=start_step) as client:
        for n, (_, batch) in enumerate(client):
            if n == 0:
                start = time.perf_counter()
            elif n == messages:
                break
            assert batch["tokens"].shape[1] == COLS
        return time.perf_counter() - start, messages * message_bytes, client.next_step


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads; Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def transport(repeats: int, total_mib: int) -> dict[str, Any]:
    from zephon_flow.service.wire import encode_step

    out: dict[str, Any] = {}
    for label, rows in SIZES.items():
        (message,) = encode_step(0, synthetic_batch(rows), ahead=AHEAD)
        size = len(message)
        messages = max(20, (total_mib << 20) // size)
        procs = {
            "raw": _start(_serve_raw, size),
            "service": _start(_serve_service, (rows, None)),
            "service_held": _start(_serve_service, (rows, HELD_MESSAGES * size)),
        }
        runs: dict[str, list[float]] = {name: [] for name in procs}
        # CPU milliseconds per message of each side: steadier than MB/s on a shared machine.
        cpu: dict[str, list[float]] = {f"{n}_{side}": [] for n in runs for side in ("server", "client")}
        next_step = dict.fromkeys(procs, 0)
        try:
            for rep in range(repeats):
                order = list(procs) if rep % 2 == 0 else list(reversed(procs))
                for name in order:
                    proc, port = procs[name]
                    pid = proc.pid
                    server_cpu, client_cpu = _cpu_seconds(pid), time.process_time()
                    if name == "raw":
                        seconds, nbytes = read_raw(port, messages)
                    else:
                        seconds, nbytes, next_step[name] = read_service(port, messages, size, next_step[name])
                    cpu[f"{name}_server"].append((_cpu_seconds(pid) - server_cpu) * 1e3 / messages)
                    cpu[f"{name}_client"].append((time.process_time() - client_cpu) * 1e3 / messages)
                    runs[name].append(nbytes / seconds)
                    _say(f"{label} {name}: {nbytes / seconds / 1e6:,.0f} MB/s")
        finally:
            for proc, _ in procs.values():
                proc.kill()
                proc.join()
        raw_bps, svc_bps, held_bps = (median(runs[n]) for n in ("raw", "service", "service_held"))
        out[label] = {
            "message_bytes": size,
            "messages": messages,
            "raw_mb_per_s": raw_bps / 1e6,
            "raw_batches_per_s": raw_bps / size,
            "service_mb_per_s": svc_bps / 1e6,
            "service_batches_per_s": svc_bps / size,
            "service_over_raw": svc_bps / raw_bps,
            "paired_ratios": [s / r for s, r in zip(runs["service"], runs["raw"], strict=True)],
            "held_bytes": HELD_MESSAGES * size,
            "service_held_mb_per_s": held_bps / 1e6,
            "service_held_over_raw": held_bps / raw_bps,
            **{f"{key}_cpu_ms_per_message": median(v) for key, v in cpu.items()},
        }
    return out


def _tokens_per_s(batches: Iterator[Any], warmup: int, steps: int) -> float:
    for _ in range(warmup + 1):
        next(batches)
    start = time.perf_counter()
    for _ in range(steps):
        next(batches)
    return steps * TOKENS_PER_STEP / (time.perf_counter() - start)


def end_to_end(repeats: int, warmup: int, steps: int, backend: str, workers: int) -> dict[str, Any]:
    import zephon_flow as zf
    from zephon_flow.demo import demo_spec

    spec = demo_spec()  # builds the demo corpus once (cached)
    runs: dict[str, list[float]] = {"embedded": [], "service": []}
    for rep in range(repeats):
        order = ["embedded", "service"] if rep % 2 == 0 else ["service", "embedded"]
        for name in order:
            if name == "embedded":
                with zf.Loader(spec, backend=backend, workers=workers) as loader:
                    rate = _tokens_per_s(iter(loader), warmup, steps)
            else:
                rate = _service_tokens_per_s(warmup, steps, backend, workers)
            runs[name].append(rate)
            _say(f"end to end {name}: {rate:,.0f} tokens/s")
    emb, svc = median(runs["embedded"]), median(runs["service"])
    return {
        "backend": backend,
        "workers": workers,
        "warmup_steps": warmup,
        "steps": steps,
        "embedded_tokens_per_s": emb,
        "service_tokens_per_s": svc,
        "service_over_embedded": svc / emb,
        "runs": runs,
    }


def _service_tokens_per_s(warmup: int, steps: int, backend: str, workers: int) -> float:
    import zephon_flow as zf

    cmd = [sys.executable, "-m", "zephon_flow.cli", "serve", "zephon_flow.demo:demo_spec", "--port", "0"]
    cmd += ["--backend", backend, "--workers", str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        port = int(line.rsplit(":", 1)[1])
        with zf.Client(f"127.0.0.1:{port}", 0, 1) as client:
            return _tokens_per_s(iter(client), warmup, steps)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        if proc.stdout is not None:
            proc.stdout.close()


def _say(message: str) -> None:
    print(f"[service bench] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transport-mib", type=int, default=512, help="MiB read per transport run")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=100, help="timed end-to-end steps")
    parser.add_argument("--backend", default="processes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-end-to-end", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 32 MiB, 2 + 5 steps")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.transport_mib, args.warmup_steps, args.steps = 1, 32, 2, 5
    results: dict[str, Any] = {
        "loadavg_before": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "transport": transport(args.repeats, args.transport_mib),
    }
    if not args.skip_end_to_end:
        results["end_to_end"] = end_to_end(
            args.repeats, args.warmup_steps, args.steps, args.backend, args.workers
        )
    results["loadavg_after"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
