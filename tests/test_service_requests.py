"""The batch service refuses bad requests with clear statuses and keeps serving; tokens, TLS,
status, checkpoints and the end of the data (an in-process server on a loopback socket)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers import Corpus, DocKey, chain_spec, example_spec, tagged_texts, write_jsonl
from service_helpers import rank_digests, wait_serving

import zephon_flow as zf
from zephon_flow.core.clock import ManualClock
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service.server import BatchServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus)


@pytest.fixture
def server(spec: zf.LoaderSpec) -> Iterator[BatchServer]:
    srv = BatchServer(spec, ahead=4, keep=2).start()
    yield srv
    srv.stop(grace=None)


def _raw_stream(address: str, request: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream("/zephon.v1.BatchService/StreamBatches")(request, timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        return info.value


def _refusal(client: zf.Client) -> zf.ServiceError:
    with client, pytest.raises(zf.ServiceError) as info:
        next(iter(client))
    return info.value


def _address(server: BatchServer) -> str:
    return f"127.0.0.1:{server.port}"


def test_bad_requests_are_refused_and_other_ranks_keep_being_served(
    server: BatchServer, spec: zf.LoaderSpec
) -> None:
    address = _address(server)
    request = pb.StreamBatchesRequest(rank=5, world_size=4).SerializeToString()
    err = _raw_stream(address, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "rank must be in [0, 4), got 5"
    err = _raw_stream(address, pb.StreamBatchesRequest(rank=0, world_size=0).SerializeToString())
    assert (err.code(), err.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "world_size must be a positive integer, got 0",
    )
    err = _raw_stream(address, b"\xff\xff\xff")  # not a StreamBatchesRequest
    assert err.code() == grpc.StatusCode.INTERNAL
    err = _raw_stream(address, pb.StreamBatchesRequest(fingerprint="x" * 100_000).SerializeToString())
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    refused = _refusal(zf.Client(address, 0, 5))
    assert refused.code == "INVALID_ARGUMENT"
    assert "global_batch_size=12 is not divisible by world_size=5" in str(refused)
    refused = _refusal(zf.Client(address, 1, 2, fingerprint="0" * 64))
    assert refused.code == "FAILED_PRECONDITION"
    assert f"built for pipeline fingerprint {'0' * 64}, but this server serves fingerprint " in str(refused)
    assert spec.fingerprint["total"] in str(refused)

    # The server still serves: both ranks of 2 get the embedded Loader's slices.
    steps = 8
    clients = [zf.Client(address, r, 2, fingerprint=spec.fingerprint) for r in range(2)]
    got: dict[int, list[tuple[int, str]]] = {0: [], 1: []}
    iters = [iter(c) for c in clients]
    for _ in range(steps):
        for r, it in enumerate(iters):
            step, batch = next(it)
            got[r].append((step, zf.batch_digest(batch)))
    for r in range(2):
        assert got[r] == rank_digests(spec, r, 2, steps)
    # Step 0 has left the window (keep=2 behind the slowest rank).
    refused = _refusal(zf.Client(address, 0, 2))
    assert refused.code == "OUT_OF_RANGE"
    assert "step 0 is no longer held: the server holds steps [" in str(refused)
    with pytest.raises(zf.ServiceError, match="started without --checkpoint-dir"):
        clients[0].checkpoint()
    status = clients[1].status()
    assert status["fingerprint"] == spec.fingerprint["total"]
    assert status["world_size"] == 2 and status["produced_step"] >= steps
    assert [lane["lane"] for lane in status["lanes"]] == list(range(spec.lanes))
    assert [(p["rank"], p["connected"]) for p in status["ranks"]] == [(0, True), (1, True)]
    assert status["bytes_served"] > 0
    for c in clients:
        c.close()


def test_held_bytes_bound_the_server_and_the_batches_stay_the_same(spec: zf.LoaderSpec) -> None:
    # A budget below one global batch: the server holds one step at a time and still serves
    # both ranks the embedded Loader's slices.
    srv = BatchServer(spec, ahead=4, keep=2, held_bytes=1).start()
    try:
        address = _address(srv)
        clients = [zf.Client(address, r, 2, fingerprint=spec.fingerprint) for r in range(2)]
        iters = [iter(c) for c in clients]
        got: dict[int, list[tuple[int, str]]] = {0: [], 1: []}
        for _ in range(6):
            for r, it in enumerate(iters):
                step, batch = next(it)
                got[r].append((step, zf.batch_digest(batch)))
        status = clients[0].status()
        assert status["produced_step"] - status["first_step"] <= 2  # never the 4 + 2 steps allowed
        for r in range(2):
            assert got[r] == rank_digests(spec, r, 2, 6)
        for c in clients:
            c.close()
    finally:
        srv.stop(grace=None)


def test_retries_back_off_on_the_client_clock() -> None:
    import socket

    with socket.socket() as sock:  # a loopback port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    clock = ManualClock()
    client = zf.Client(f"127.0.0.1:{port}", 0, 1, retries=3, backoff=1.0, max_backoff=3.0, clock=clock)
    with pytest.raises(
        zf.ServiceError,
        match=r"status from 127\.0\.0\.1:\d+ failed after 4 tries over 6\.0 s \(a server that takes longer "
        r"to come back needs more: Client\(retries=, max_backoff=\); now retries=3, max_backoff=3\): UNAVAILABLE",
    ):
        client.status()
    assert clock.waited == 1.0 + 2.0 + 3.0  # doubling, capped at max_backoff, and no real sleep
    client.close()


def test_checkpoints_are_written_for_held_steps(spec: zf.LoaderSpec, tmp_path: Path) -> None:
    srv = BatchServer(spec, ahead=4, keep=2, checkpoint_dir=str(tmp_path)).start()
    try:
        with zf.Client(_address(srv), 0, 1) as client:
            it = iter(client)
            for _ in range(3):
                next(it)
            path = client.checkpoint()
            assert path == str(tmp_path / "step-3.zfstate")
            state = zf.load_state(path)
            assert state.step == 3
            with pytest.raises(zf.ServiceError, match="step 50 is not produced yet") as info:
                client.checkpoint(50)
            assert info.value.code == "OUT_OF_RANGE"
    finally:
        srv.stop(grace=None)
    # The checkpoint resumes the same sequence in an embedded Loader.
    with zf.Loader(spec, state=state) as loader:
        step, batch = next(iter(loader))
    assert (step, zf.batch_digest(batch)) == rank_digests(spec, 0, 1, 4)[3]


def test_iteration_ends_with_the_data(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "docs.jsonl", tagged_texts("web", 9, seed=3))
    finite = chain_spec(jsonl, ("key", DocKey()), lanes=1, global_batch_size=4, epochs=1)
    srv = BatchServer(finite).start()
    try:
        with zf.Client(_address(srv), 0, 2) as client:
            got = list(client)
        # 9 documents in batches of 4: the last step holds one and three rows of padding.
        assert [step for step, _ in got] == [0, 1, 2]
        assert [b["valid"].tolist() for _, b in got] == [[True, True], [True, True], [True, False]]
        refused = _refusal(zf.Client(_address(srv), 0, 2, start_step=7))
        assert str(refused).endswith("step 7 is past the end of the data: the last step is 2")
    finally:
        srv.stop(grace=None)


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def test_tls_and_a_token_on_every_call(spec: zf.LoaderSpec, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    roots = cert.read_bytes()
    srv = BatchServer(spec, token="s3cret", tls=(str(cert), str(key))).start()
    address = _address(srv)
    try:
        # The health service stays open: probes need no token.
        wait_serving(address, grpc.ssl_channel_credentials(root_certificates=roots))
        refused = _refusal(zf.Client(address, 0, 1, root_certificates=roots))
        assert refused.code == "UNAUTHENTICATED"
        assert "this server requires a token: pass Client(token=...)" in str(refused)
        refused = _refusal(zf.Client(address, 0, 1, root_certificates=roots, token="guess"))
        assert (refused.code, str(refused).split(": ", 2)[-1]) == (
            "UNAUTHENTICATED",
            "the token sent does not match the server's token",
        )
        with (
            zf.Client(address, 0, 1, root_certificates=roots, token="guess") as client,
            pytest.raises(zf.ServiceError, match="UNAUTHENTICATED"),
        ):
            client.status()
        with zf.Client(address, 0, 1, root_certificates=roots, token="s3cret") as client:
            step, batch = next(iter(client))
            assert (step, zf.batch_digest(batch)) == rank_digests(spec, 0, 1, 1)[0]
            assert client.status()["produced_step"] >= 1
        # Plain text to a TLS server does not get through.
        refused = _refusal(zf.Client(address, 0, 1, token="s3cret", retries=0))
        assert refused.code == "UNAVAILABLE"
    finally:
        srv.stop(grace=None)


def test_serve_command_refuses_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zephon_flow.cli import main

    assert main(["serve", "pipeline.py:spec", "--port", "0", "--tls-cert", "cert.pem"]) == 2
    assert "zephon serve: --tls-cert and --tls-key go together" in capsys.readouterr().err
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert main(["serve", "pipeline.py:spec", "--port", "0", "--token-file", str(empty)]) == 2
    assert f"zephon serve: --token-file {empty} is empty" in capsys.readouterr().err
