"""Helpers for the batch service tests: a pipeline file, starting and stopping servers by PID."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import Corpus

import zephon_flow as zf

TESTS = Path(__file__).resolve().parent
CLIENT_SCRIPT = TESTS / "service_client.py"


def write_pipeline(path: Path, corpus: Corpus, **spec_options: int) -> Path:
    """A pipeline file whose ``spec`` is ``helpers.example_spec(corpus, **spec_options)``."""
    path.write_text(
        textwrap.dedent(
            f"""
            import sys
            from pathlib import Path

            sys.path.insert(0, {str(TESTS)!r})
            from helpers import Corpus, example_spec

            corpus = Corpus(
                root=Path({str(corpus.root)!r}),
                web_jsonl={corpus.web_jsonl!r},
                code_parquet={corpus.code_parquet!r},
                tokenizer_json={corpus.tokenizer_json!r},
                web_texts=(),
                code_texts=(),
            )
            spec = example_spec(corpus, **{spec_options!r})
            """
        )
    )
    return path


class ServerProcess:
    """``zephon serve`` in a subprocess on 127.0.0.1; ``port`` is read from its first line."""

    def __init__(self, target: str, *args: str, port: int = 0, log: Path) -> None:
        self.log = log
        self._log_file = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zephon_flow.cli", "serve", target, "--port", str(port), *args],
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            cwd=TESTS,
        )
        lines: queue.Queue[bytes] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
        try:
            line = lines.get(timeout=90).decode()
        except queue.Empty:
            line = ""
        if "listening on" not in line:
            self.kill()
            raise AssertionError(f"server did not start: {line!r}\n{log.read_text(errors='replace')}")
        self.port = int(line.rsplit(":", 1)[1])
        self.address = f"127.0.0.1:{self.port}"
        wait_serving(self.address)

    def kill(self, sig: int = signal.SIGTERM) -> None:
        """Sends ``sig`` to the server's PID and waits for it (SIGKILL after 15 s)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log_file.close()


def wait_serving(address: str, credentials: grpc.ChannelCredentials | None = None) -> None:
    """Blocks until the standard health service reports SERVING (no token needed)."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=60, wait_for_ready=True)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def start_clients(address: str, runs: list[tuple[int | float, ...]]) -> list[subprocess.Popen[str]]:
    """One process per ``(rank, world_size, start_step, steps[, pause])``, printing ``STEP DIGEST``."""
    return [
        subprocess.Popen(
            [sys.executable, str(CLIENT_SCRIPT), address, *(str(v) for v in run)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=TESTS,
        )
        for run in runs
    ]


def rank_digests(spec: zf.LoaderSpec, rank: int, world_size: int, steps: int) -> list[tuple[int, str]]:
    """``(step, digest)`` of this rank's slices from the embedded Loader."""
    out = []
    with zf.Loader(spec, rank=rank, world_size=world_size) as loader:
        for step, batch in loader:
            out.append((step, zf.batch_digest(batch)))
            if len(out) == steps:
                break
    return out


def parse_digests(text: str) -> list[tuple[int, str]]:
    return [(int(s), d) for s, d in (line.split() for line in text.splitlines() if line.strip())]
