"""``zephon serve``'s exit status: a failed pipeline exits with ``EXIT_PIPELINE_FAILED`` (for a
supervisor to restart it with ``--resume``) even when SIGTERM arrives before the server has
reported the failure; a clean SIGTERM exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import chain_spec, write_jsonl
from test_service_faults import _reap

import zephon_flow as zf
from zephon_flow.service.server import EXIT_PIPELINE_FAILED

pytestmark = pytest.mark.timeout(120)
TESTS = Path(__file__).resolve().parent


class Gate(beam.DoFn):  # type: ignore[misc]
    """``"17"`` -> ``{"n": 17}``; on record ``fail_at`` waits until the test writes to the FIFO
    ``gate`` (so the test chooses when the pipeline fails), then raises."""

    def __init__(self, gate: str, fail_at: int) -> None:
        self.gate, self.fail_at = gate, fail_at

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        n = int(text)
        if n == self.fail_at:
            with open(self.gate, "rb") as fifo:
                fifo.read()
            raise ValueError(f"record {n} is poison")
        yield {"n": np.int64(n)}


def gated_spec(root: Path, fail_at: int) -> zf.LoaderSpec:
    path = root / "numbers.jsonl"
    write_jsonl(path, [str(i) for i in range(400)])
    gate = ("number", Gate(str(root / "gate"), fail_at))
    return chain_spec(str(path), gate, lanes=1, global_batch_size=1, epochs=1)


PIPELINE = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_serve_exit_status import gated_spec
spec = gated_spec(Path({root!r}), fail_at={fail_at})
"""


def _serve(tmp_path: Path, fail_at: int) -> subprocess.Popen[str]:
    """``zephon serve`` of ``gated_spec`` in a subprocess on 127.0.0.1 (an ephemeral port)."""
    os.mkfifo(tmp_path / "gate")
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(
        textwrap.dedent(PIPELINE.format(tests=str(TESTS), root=str(tmp_path), fail_at=fail_at))
    )
    command = [sys.executable, "-m", "zephon_flow.cli", "serve", f"{pipeline}:spec"]
    proc = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", "0", "--ahead", "8", "--backend", "threads"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening on" in line, line
    proc.address = "127.0.0.1:" + line.rsplit(":", 1)[1].strip()  # type: ignore[attr-defined]
    return proc


def _wait_for_health(address: str, wanted: int) -> None:
    """Blocks until the server's health turns ``wanted``: the health service's own ``Watch``
    stream, which sends each change as it happens (no polling, no sleep)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for reply in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=90, wait_for_ready=True):
            if reply.status == wanted:
                return


def _terminate(proc: subprocess.Popen[str]) -> tuple[int, str]:
    os.kill(proc.pid, signal.SIGTERM)  # by PID, never by name
    return _reap(proc)


def test_sigterm_right_after_a_pipeline_failure_still_exits_non_zero(tmp_path: Path) -> None:
    # Record 3 fails the pipeline when the test opens the gate, with no client connected;
    # SIGTERM follows the failure at once, before the server's main loop has looked again.
    proc = _serve(tmp_path, fail_at=3)
    try:
        _wait_for_health(proc.address, health_pb2.HealthCheckResponse.SERVING)  # type: ignore[attr-defined]
        with open(tmp_path / "gate", "wb") as gate:  # blocks until the DoFn waits on it
            gate.write(b"fail now")
        _wait_for_health(proc.address, health_pb2.HealthCheckResponse.NOT_SERVING)  # type: ignore[attr-defined]
    finally:
        code, err = _terminate(proc)
    assert code == EXIT_PIPELINE_FAILED, err[-2000:]
    assert "zephon serve: error: the pipeline failed" in err and "record 3 is poison" in err, err[-2000:]
    assert f"exiting with status {EXIT_PIPELINE_FAILED}" in err and "restart with --resume" in err


def test_sigterm_while_the_pipeline_is_well_exits_zero(tmp_path: Path) -> None:
    proc = _serve(tmp_path, fail_at=-1)
    try:
        _wait_for_health(proc.address, health_pb2.HealthCheckResponse.SERVING)  # type: ignore[attr-defined]
    finally:
        code, err = _terminate(proc)
    assert code == 0, err[-2000:]
    assert "the pipeline failed" not in err
