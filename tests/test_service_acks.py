"""Ranks' positions are what they have taken (``Ack``): a slow trainer checkpoints the step it
is at, the server sends and produces at most ``ahead`` steps past acknowledged steps, and the new
RPC is validated and token-checked like the others (an in-process server on loopback)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers import Corpus, example_spec
from service_helpers import rank_digests

import zephon_flow as zf
from zephon_flow.service import auth
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service.server import BatchServer

pytestmark = pytest.mark.timeout(120)
WINDOW = 3


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus)


@pytest.fixture
def server(spec: zf.LoaderSpec, tmp_path: Path) -> Iterator[BatchServer]:
    # keep=0: nothing is held behind the slowest rank's acknowledged step.
    srv = BatchServer(spec, ahead=WINDOW, keep=0, checkpoint_dir=str(tmp_path)).start()
    yield srv
    srv.stop(grace=None)


def _address(server: BatchServer) -> str:
    return f"127.0.0.1:{server.port}"


def _acked(client: zf.Client, rank: int, step: int) -> dict[str, object]:
    """The server's status once it has ``rank``'s acknowledgement of ``step`` (sent in the background)."""
    deadline = time.monotonic() + 30  # a hang guard, not a speed check
    while True:
        status = client.status()
        if status["ranks"][rank]["next_step"] >= step:  # type: ignore[index]
            return status
        assert time.monotonic() < deadline, f"rank {rank}'s acknowledgement of step {step} never arrived"
        time.sleep(0.01)


def test_a_slow_rank_checkpoints_the_step_it_is_at(
    server: BatchServer, spec: zf.LoaderSpec, tmp_path: Path
) -> None:
    steps, world = 10, 2
    clients = [zf.Client(_address(server), r, world, fingerprint=spec.fingerprint) for r in range(world)]
    streams = [iter(c) for c in clients]
    got: list[list[tuple[int, str]]] = [[], []]
    for step in range(steps):
        for rank in range(world):  # rank 1 is always one batch behind rank 0
            s, batch = next(streams[rank])
            got[rank].append((s, zf.batch_digest(batch)))
            time.sleep(0.05)  # a slow trainer: gRPC alone would stream far ahead of it
        status = _acked(clients[0], 1, step + 1)
        ranks = status["ranks"]
        slowest = min(r["next_step"] for r in ranks)  # type: ignore[attr-defined]
        assert status["produced_step"] <= slowest + WINDOW
        for r in ranks:  # type: ignore[attr-defined]
            assert r["next_step"] <= r["sent_step"] <= r["next_step"] + WINDOW
        # The step the trainer is at (the next it will take) is still held.
        path = clients[0].checkpoint(step + 1)
        assert path == str(tmp_path / f"step-{step + 1}.zfstate")
        assert zf.load_state(path).step == step + 1
    assert status["first_step"] == steps  # keep=0: released up to the slowest acknowledged step
    with pytest.raises(zf.ServiceError, match=f"step {steps - 1} is no longer held") as info:
        clients[1].checkpoint(steps - 1)
    assert info.value.code == "OUT_OF_RANGE"
    for c in clients:
        c.close()
    for rank in range(world):
        assert got[rank] == rank_digests(spec, rank, world, steps)
    # The last checkpoint resumes the sequence in an embedded Loader.
    with zf.Loader(spec, rank=0, world_size=world, state=zf.load_state(path)) as loader:
        step, batch = next(iter(loader))
    assert (step, zf.batch_digest(batch)) == rank_digests(spec, 0, world, steps + 1)[steps]


def _raw_ack(address: str, request: pb.AckRequest, token: str | None = None) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        ack = channel.unary_unary("/zephon.v1.BatchService/Ack")
        with pytest.raises(grpc.RpcError) as info:
            ack(request.SerializeToString(), timeout=30, metadata=auth.bearer(token) if token else None)
        return info.value


def test_acks_are_validated(server: BatchServer, spec: zf.LoaderSpec) -> None:
    address = _address(server)
    err = _raw_ack(address, pb.AckRequest(rank=5, world_size=4, step=1))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "rank must be in [0, 4), got 5")
    err = _raw_ack(address, pb.AckRequest(fingerprint="f" * 16, rank=0, world_size=1, step=1))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"but this server serves fingerprint {spec.fingerprint['total']}" in err.details()
    with zf.Client(address, 0, 1) as client:
        next(iter(client))
        err = _raw_ack(address, pb.AckRequest(rank=0, world_size=2, step=1))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "the server is serving world_size=1, not 2" in err.details()
        err = _raw_ack(address, pb.AckRequest(rank=0, world_size=1, step=1000))
        assert err.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "rank 0 acknowledged step 999, which was never served" in err.details()


def test_acks_need_the_token(spec: zf.LoaderSpec) -> None:
    srv = BatchServer(spec, token="s3cret").start()
    try:
        request = pb.AckRequest(rank=0, world_size=1, step=0)
        err = _raw_ack(_address(srv), request)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        err = _raw_ack(_address(srv), request, token="guess")
        assert (err.code(), err.details()) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "the token sent does not match the server's token",
        )
        with zf.Client(_address(srv), 0, 1, token="s3cret") as client:
            assert [step for step, _ in zip(range(WINDOW * 3), client, strict=False)] == list(range(9))
    finally:
        srv.stop(grace=None)


@pytest.mark.parametrize("ahead", [1, 8])
def test_acks_every_half_ahead_and_a_checkpoint_after_unacked_steps(
    spec: zf.LoaderSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead: int
) -> None:
    stride = max(1, ahead // 2)
    steps = 3 * ahead + stride - 1  # ends stride - 1 steps past the last acknowledgement sent
    srv = BatchServer(spec, ahead=ahead, keep=0, checkpoint_dir=str(tmp_path)).start()
    try:
        client = zf.Client(_address(srv), 0, 1, fingerprint=spec.fingerprint)
        sent: list[int] = []
        send = client._send_ack

        def recording(step: int, timeout: float | None = None) -> None:
            sent.append(step)
            send(step, timeout)

        monkeypatch.setattr(client, "_send_ack", recording)
        # ahead=1: the stream waits for each step's acknowledgement, so this never finishes
        # if one is held back; ahead=8: the acknowledgements go every 4 steps (coalesced).
        got = [(s, zf.batch_digest(b)) for _, (s, b) in zip(range(steps), client, strict=False)]
        assert got == rank_digests(spec, 0, 1, steps)
        background = list(sent)
        assert background and all(s % stride == 0 for s in background)
        assert max(background) <= steps
        # The checkpoint at the step the trainer is at acknowledges what was taken first.
        path = client.checkpoint()
        assert path == str(tmp_path / f"step-{steps}.zfstate")
        assert zf.load_state(path).step == steps
        status = client.status()
        assert status["ranks"][0]["next_step"] == steps  # type: ignore[index]
        assert status["first_step"] == steps  # keep=0: every step before it is released
        with pytest.raises(zf.ServiceError, match=f"step {steps - 1} is no longer held") as info:
            client.checkpoint(steps - 1)
        assert info.value.code == "OUT_OF_RANGE"
        client.close()
    finally:
        srv.stop(grace=None)


def test_close_acknowledges_the_steps_taken(spec: zf.LoaderSpec) -> None:
    srv = BatchServer(spec, ahead=8, keep=0).start()
    try:
        with zf.Client(_address(srv), 0, 1) as client:
            assert [s for _, (s, _) in zip(range(3), client, strict=False)] == [0, 1, 2]  # below the stride
        with zf.Client(_address(srv), 0, 1) as observer:
            status = observer.status()
        assert status["ranks"][0]["next_step"] == 3  # type: ignore[index]
        assert status["first_step"] == 3
    finally:
        srv.stop(grace=None)
