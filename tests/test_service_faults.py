"""The batch service under faults: a failed pipeline is reported (health, streams, exit status),
checkpoints are written on their own, a rank's new stream replaces its old one, idle streams are
dropped, full servers are waited for, and tokens and TLS mistakes get clear messages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import chain_spec, write_jsonl
from service_helpers import wait_serving
from test_service_requests import _self_signed

import zephon_flow as zf
from zephon_flow.core.checkpoint.store import load_state, save_state
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service.server import EXIT_PIPELINE_FAILED, BatchServer

pytestmark = pytest.mark.timeout(120)
TESTS = Path(__file__).resolve().parent
STREAM = "/zephon.v1.BatchService/StreamBatches"


class Number(beam.DoFn):  # type: ignore[misc]
    """``"17"`` -> ``{"n": 17}``; raises on record ``fail_at`` (never when it is negative)."""

    def __init__(self, fail_at: int = -1) -> None:
        self.fail_at = fail_at

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        n = int(text)
        if n == self.fail_at:
            raise ValueError(f"record {n} is poison")
        yield {"n": np.int64(n)}


def numbers_spec(root: Path, fail_at: int = -1, batch: int = 1) -> zf.LoaderSpec:
    path = root / "numbers.jsonl"
    if not path.exists():
        write_jsonl(path, [str(i) for i in range(400)])
    return chain_spec(str(path), ("number", Number(fail_at)), lanes=1, global_batch_size=batch, epochs=1)


def _address(server: BatchServer) -> str:
    return f"127.0.0.1:{server.port}"


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        return int(reply.status)


def _steps(client: zf.Client, n: int) -> list[int]:
    out = []
    for _step, batch in client:
        out.append(int(batch["n"][0]))
        if len(out) == n:
            break
    return out


def test_a_failed_pipeline_turns_health_not_serving_and_tells_the_clients(tmp_path: Path) -> None:
    srv = BatchServer(numbers_spec(tmp_path, fail_at=12), ahead=4).start()
    address = _address(srv)
    try:
        wait_serving(address)
        with zf.Client(address, 0, 1, retries=0) as client, pytest.raises(zf.ServiceError) as info:
            _steps(client, 100)
        assert info.value.code == "INTERNAL"
        text = str(info.value)
        assert "INTERNAL: the pipeline failed at step " in text
        assert "DoFn 'number' raised ValueError: record 12 is poison" in text
        assert f"exiting with status {EXIT_PIPELINE_FAILED}" in text and "--resume" in text
        assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert srv.failed is not None
    finally:
        srv.stop(grace=None)


PIPELINE = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_service_faults import numbers_spec
spec = numbers_spec(Path({root!r}), fail_at={fail_at})
"""


def _serve(tmp_path: Path, *args: str, fail_at: int = -1) -> subprocess.Popen[str]:
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(
        textwrap.dedent(PIPELINE.format(tests=str(TESTS), root=str(tmp_path), fail_at=fail_at))
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "zephon_flow.cli", "serve", f"{pipeline}:spec", "--port", "0", *args],
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


def _reap(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 9)
            proc.communicate(timeout=10)
    return int(proc.returncode), err


def test_serve_exits_non_zero_after_the_pipeline_fails(tmp_path: Path) -> None:
    proc = _serve(tmp_path, "--ahead", "2", fail_at=8)
    try:
        with zf.Client(proc.address, 0, 1, retries=0) as client, pytest.raises(zf.ServiceError) as info:  # type: ignore[attr-defined]
            _steps(client, 100)
        assert "record 8 is poison" in str(info.value)
    finally:
        code, err = _reap(proc)
    assert code == EXIT_PIPELINE_FAILED
    assert "zephon serve: error: the pipeline failed" in err and "restart with --resume" in err


def test_checkpoints_every_n_steps_keep_the_newest_and_resume_exactly(tmp_path: Path) -> None:
    spec = numbers_spec(tmp_path)
    directory = tmp_path / "ckpt"
    srv = BatchServer(
        spec, ahead=2, keep=1, checkpoint_dir=str(directory), checkpoint_every=5, keep_checkpoints=2
    ).start()
    try:
        with zf.Client(_address(srv), 0, 1) as client:
            first = _steps(client, 40)
    finally:
        srv.stop(grace=None)
    # Written on acknowledgements (coalesced): at least 5 steps apart, the newest two kept.
    steps = sorted(int(name[len("step-") : -len(".zfstate")]) for name in os.listdir(directory))
    assert len(steps) == 2 and steps[1] - steps[0] >= 5 and steps[1] >= 30, steps
    for at in steps:
        with zf.Loader(spec, state=load_state(directory / f"step-{at}.zfstate")) as resumed:
            step, batch = next(iter(resumed))
        assert (step, int(batch["n"][0])) == (at, at)  # record n is step n's only row
    assert first == list(range(40))


def test_checkpoint_every_needs_a_directory(tmp_path: Path) -> None:
    with pytest.raises(zf.SpecError, match="--checkpoint-every needs --checkpoint-dir"):
        BatchServer(numbers_spec(tmp_path), checkpoint_every=5)


def test_a_ranks_new_stream_replaces_its_old_one(tmp_path: Path) -> None:
    srv = BatchServer(numbers_spec(tmp_path), ahead=4).start()
    address = _address(srv)
    try:
        with grpc.insecure_channel(address) as channel:
            old = channel.unary_stream(STREAM)(
                pb.StreamBatchesRequest(rank=0, world_size=1).SerializeToString()
            )
            next(old)  # the old stream is open and has sent its first message
            with zf.Client(address, 0, 1) as client:
                assert _steps(client, 10) == list(range(10))
            with pytest.raises(grpc.RpcError) as info:
                for _ in old:
                    pass
            assert info.value.code() == grpc.StatusCode.ABORTED
            assert "rank 0 opened a new stream: this one is replaced" in str(info.value.details())
    finally:
        srv.stop(grace=None)


def test_streams_that_do_not_read_are_dropped_and_a_full_server_is_waited_for(tmp_path: Path) -> None:
    srv = BatchServer(numbers_spec(tmp_path, batch=2), ahead=2, max_streams=2, stream_timeout=1.0).start()
    address = _address(srv)
    try:
        with grpc.insecure_channel(address) as channel:
            idle = [
                channel.unary_stream(STREAM)(
                    pb.StreamBatchesRequest(rank=r, world_size=2).SerializeToString()
                )
                for r in (0, 1)
            ]
            time.sleep(0.3)  # both streams hold the server's two call slots
            started = time.monotonic()
            with zf.Client(address, 1, 2, retries=8, backoff=0.2) as client:
                step, _ = next(iter(client))
            assert step == 0
            assert time.monotonic() - started < 15
            for call in idle:
                with pytest.raises(grpc.RpcError) as info:
                    for _ in call:
                        pass
                assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED)
    finally:
        srv.stop(grace=None)


def test_a_token_with_a_trailing_newline_is_stripped_and_a_bad_one_refused(tmp_path: Path) -> None:
    srv = BatchServer(numbers_spec(tmp_path), token="s3cret").start()
    try:
        with zf.Client(_address(srv), 0, 1, token="s3cret\n") as client:
            assert _steps(client, 2) == [0, 1]
        with pytest.raises(
            zf.SpecError, match=r"Client: the token holds characters gRPC metadata cannot carry \('\\x00'\)"
        ):
            zf.Client(_address(srv), 0, 1, token="s3\x00cret")
    finally:
        srv.stop(grace=None)


def test_a_plaintext_client_against_a_tls_server_is_told_so(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    srv = BatchServer(numbers_spec(tmp_path), tls=(str(cert), str(key))).start()
    try:
        with zf.Client(_address(srv), 0, 1, retries=0) as client, pytest.raises(zf.ServiceError) as info:
            next(iter(client))
        assert info.value.code == "UNAVAILABLE"
        assert "pass Client(root_certificates=" in str(info.value)
    finally:
        srv.stop(grace=None)


def test_ranks_that_outran_the_last_checkpoint_reconnect_to_the_resumed_server(tmp_path: Path) -> None:
    # With --checkpoint-every N the newest checkpoint can be N steps (and a window) behind the
    # ranks when the server dies; resumed from it, the server replays up to their steps.
    spec = numbers_spec(tmp_path)
    with zf.Loader(spec) as loader:
        for step, _ in loader:
            if step == 9:
                break
        state = loader.state()
    path = tmp_path / "step-10.zfstate"
    save_state(state, path)
    srv = BatchServer(
        spec, ahead=2, resume=str(path), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=5
    ).start()
    try:
        with zf.Client(_address(srv), 0, 1, start_step=17, retries=0) as client:
            assert _steps(client, 3) == [17, 18, 19]
    finally:
        srv.stop(grace=None)
