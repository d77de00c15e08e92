"""Served lane owners (``zephon serve --ray``) as guarded as ``zephon serve``: token and TLS on
the coordinator and every owner, requests checked against the run before any work, control
calls that cannot spend the run's replacements, a bound on one client's open calls, deadlines
on every call, a run that cannot go on saying so, and a joining rank of another pipeline
refused by name. Real loopback sockets and a local Ray; processes are killed by PID."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import Corpus, example_spec
from service_helpers import rank_digests, wait_serving
from test_service_requests import _self_signed

import zephon_flow as zf
from zephon_flow.core.batches import batch_digest, concat
from zephon_flow.core.errors import SpecError
from zephon_flow.engine.simulate import global_digests
from zephon_flow.service._proto import lane_owners_pb2 as lo

pytest.importorskip("ray")
from zephon_flow.cluster import OwnedLoader
from zephon_flow.cluster.serve import OwnersServer

LANES, BATCH = 6, 12
_M = "/zephon.v1.LaneOwners/"


@pytest.fixture(scope="module")
def spec(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=LANES, global_batch_size=BATCH)


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import ray

    from zephon_flow.runners.ray_env import connect

    started = connect("tests", None, num_cpus=2)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _stream(channel: grpc.Channel, request: lo.RowsRequest, metadata: Any = ()) -> Any:
    method = channel.unary_stream(_M + "StreamRows", request_serializer=lo.RowsRequest.SerializeToString)
    return list(method(request, metadata=metadata, timeout=30))


def _unary(channel: grpc.Channel, name: str, request: Any, reply: Any) -> Any:
    return channel.unary_unary(
        _M + name, request_serializer=request.SerializeToString, response_deserializer=reply.FromString
    )


def _client_refusal(client: zf.Client) -> zf.ServiceError:
    with client, pytest.raises(zf.ServiceError) as info:
        next(iter(client))
    return info.value


def test_token_tls_and_requests_checked_before_any_work(
    ray_session: None, spec: zf.LoaderSpec, tmp_path: Any
) -> None:
    cert, key = _self_signed(tmp_path)
    roots = cert.read_bytes()
    creds = grpc.ssl_channel_credentials(root_certificates=roots)
    server = OwnersServer(
        spec,
        owners=2,
        world_size=2,
        token="s3cret",
        tls=(str(cert), str(key)),
        max_replacements=1,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=4,
    )
    address = f"127.0.0.1:{server.port}"
    auth = (("authorization", "Bearer s3cret"),)
    fp = spec.fingerprint["total"]
    try:
        wait_serving(address, creds)  # health needs no token
        refused = _client_refusal(zf.Client(address, 0, 2, lane_owners=True, root_certificates=roots))
        assert refused.code == "UNAUTHENTICATED" and "this server requires a token" in str(refused)
        refused = _client_refusal(zf.Client(address, 0, 2, lane_owners=True, token="s3cret", retries=0))
        assert refused.code == "UNAVAILABLE"  # plaintext to a TLS endpoint

        coordinator = grpc.secure_channel(address, creds)
        table = _unary(coordinator, "Table", lo.TableRequest, lo.TableReply)(lo.TableRequest(), metadata=auth)
        owner_address = table.owners[0].address
        owner = grpc.secure_channel(owner_address, creds)
        wait_serving(owner_address, creds)
        # Every owner checks the token before any work.
        exc = _refused(lambda: _stream(owner, lo.RowsRequest(rank=0, world_size=2, start_step=0)))
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        live = _unary(owner, "Live", lo.LiveRequest, lo.LiveReply)
        exc = _refused(lambda: live(lo.LiveRequest(step=0), metadata=(("authorization", "Bearer guess"),)))
        assert (exc.code(), exc.details()) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "the token sent does not match the server's token",
        )
        # Authenticated, a request is still checked against the run before any work.
        for request, code, message in [
            (
                lo.RowsRequest(rank=0, world_size=2, start_step=10**6, stop_step=10**6 + 1),
                grpc.StatusCode.OUT_OF_RANGE,
                "step 1000000 is too far ahead: rank 0 is at step 0 on lane owner 0 (lanes [0, 1, 2]), "
                # ahead 8 + 24 + --checkpoint-every 4, and 32 for a first ask (FLOOR_REACH)
                "and a rank may ask at most 68 steps past it",
            ),
            (
                lo.RowsRequest(rank=3, world_size=4, start_step=0, stop_step=1),
                grpc.StatusCode.FAILED_PRECONDITION,
                "these lane owners serve world_size=2, not 4: restart zephon serve --ray with "
                "--world-size 4 (and --resume from a checkpoint)",
            ),
            (
                lo.RowsRequest(fingerprint="0" * 16, rank=0, world_size=2, start_step=0, stop_step=1),
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the client was built for pipeline fingerprint {'0' * 16}, but these lane owners run "
                f"fingerprint {fp}: connect to the server of that pipeline",
            ),
            (
                lo.RowsRequest(rank=1, world_size=2, start_step=0, stop_step=1),
                grpc.StatusCode.INVALID_ARGUMENT,
                "rank 1 of 2 has no rows on this owner's lanes [0, 1, 2]",
            ),
        ]:
            exc = _refused(lambda request=request: _stream(owner, request, auth))
            assert exc.code() == code and str(exc.details()).startswith(message), exc.details()
        exc = _refused(lambda: live(lo.LiveRequest(step=10**6), metadata=auth))
        assert exc.code() == grpc.StatusCode.OUT_OF_RANGE and "Live(step=1000000) is too far ahead" in str(
            exc.details()
        )

        # Control calls: an owner out of range is named; one that is alive is not replaced.
        replace = _unary(coordinator, "Replace", lo.ReplaceRequest, lo.TableReply)
        exc = _refused(lambda: replace(lo.ReplaceRequest(owner=99), metadata=auth))
        assert (exc.code(), exc.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "Replace(owner=99): no such lane owner; this run's owners are 0..1",
        )
        exc = _refused(lambda: replace(lo.ReplaceRequest(owner=0)))
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        for _ in range(3):
            assert [o.generation for o in replace(lo.ReplaceRequest(owner=0), metadata=auth).owners] == [0, 0]
        assert server.table().generations == (0, 0)

        # 40 idle Live calls on one connection: 16 are held, the rest refused; ranks unaffected.
        done = threading.Semaphore(0)
        futures = [live.future(lo.LiveRequest(step=30), metadata=auth) for _ in range(40)]
        for f in futures:
            f.add_done_callback(lambda _f: done.release())
        for _ in range(24):
            assert done.acquire(timeout=60)
        exhausted = [f for f in futures if f.done() and f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(exhausted) == 24
        assert "this client already holds 16 open calls" in str(exhausted[0].details())

        # An honest client starting past what the owners can reach is refused, as zephon serve does.
        refused = _client_refusal(
            zf.Client(address, 0, 2, 5000, lane_owners=True, token="s3cret", root_certificates=roots)
        )
        assert refused.code == "OUT_OF_RANGE" and "step 5000 is too far ahead" in str(refused)

        # The run's ranks, over TLS with the token, get the Loader's bytes; the spoofed
        # Replace calls spent nothing, so owner 1 killed mid-run is still replaced.
        steps = 10
        clients = [
            zf.Client(
                address, r, 2, lane_owners=True, token="s3cret", root_certificates=roots, fingerprint=fp
            )
            for r in range(2)
        ]
        try:
            iters = [iter(c) for c in clients]
            got = []
            for i in range(steps):
                if i == 2:  # replaced before the checkpoint at step 8
                    os.kill(server.owner_pids()[1], signal.SIGKILL)
                parts = [next(it) for it in iters]
                got.append((parts[0][0], batch_digest(concat([p[1] for p in parts]))))
            reference = global_digests(spec, steps=steps + 2)
            assert got == reference[:steps]
            assert server.table().generations == (0, 1)
            # --checkpoint-every 4: written once both ranks reported step 8 (every 8 steps),
            # beside the reports: the manifest may come a little after the ranks' step 10.
            path = tmp_path / "ckpt" / "step-8.zfstate"
            for _ in range(600):
                if path.exists():
                    break
                time.sleep(0.1)
            assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-8.zfstate", "step-8.zfstate.parts"]
            resumed = global_digests(spec, steps=4, world_size=2, state=zf.load_state(str(path)))
            assert resumed[:2] == reference[8:10]
        finally:
            for c in clients:
                c.close()
        for f in futures:
            f.cancel()
        owner.close()
        coordinator.close()
    finally:
        server.stop()


def test_deadlines_close_and_a_run_that_cannot_go_on(ray_session: None, spec: zf.LoaderSpec) -> None:
    server = OwnersServer(spec, owners=1, world_size=2, max_replacements=0)
    address = f"127.0.0.1:{server.port}"
    expected = rank_digests(spec, 0, 2, 12)
    try:
        # Rank 1 takes 2 steps and stops: the owner runs 8 (ahead) past rank 1's asks, no further.
        stopped = zf.Client(address, 1, 2, lane_owners=True)
        it1 = iter(stopped)
        assert [next(it1)[0] for _ in range(2)] == [0, 1]

        # Rank 0, blocked at the first step not made, is closed from another thread: it ends cleanly.
        blocked = zf.Client(address, 0, 2, lane_owners=True)
        got: list[tuple[int, str]] = []
        errors: list[BaseException] = []

        def read() -> None:
            try:
                for step, batch in blocked:
                    got.append((step, batch_digest(batch)))
            except BaseException as exc:
                errors.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 60
        while len(got) < 12 and time.monotonic() < deadline and reader.is_alive():
            reader.join(0.05)
        assert got == expected  # steps 0..11; step 12 waits for rank 1
        blocked.close()
        reader.join(30)
        assert not reader.is_alive() and errors == [] and len(got) == 12

        # With Client(timeout=2), the wait ends with a project error naming step and owner.
        waiting = zf.Client(address, 0, 2, 12, lane_owners=True, timeout=2.0)
        began = time.monotonic()
        with pytest.raises(zf.ServiceError) as info:
            next(iter(waiting))
        elapsed = time.monotonic() - began
        message = str(info.value)
        assert info.value.code == "DEADLINE_EXCEEDED"
        assert message.startswith(
            "rank 0 waited more than 2 s (Client(timeout=)) for step 12 from lane owner 0 (lanes "
            "[0, 1, 2, 3, 4, 5])"
        ), message
        assert elapsed < 2 * 2.0 + 2, elapsed  # at most one more full wait
        waiting.close()

        # The only owner dies with no replacement left: the rank is told, and the run says it
        # cannot go on (health NOT_SERVING; zephon serve exits with status 3).
        os.kill(server.owner_pids()[0], signal.SIGKILL)
        with pytest.raises(zf.ServiceError) as info:
            for _ in range(12):
                next(it1)
        assert re.search(r"cannot be restarted: max_replacements=0", str(info.value)), info.value
        assert server.failed is not None and "max_replacements=0" in server.failed
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        stopped.close()
    finally:
        server.stop()


def test_a_rank_of_another_pipeline_is_refused_by_the_runs_name(
    ray_session: None, spec: zf.LoaderSpec, corpus: Corpus
) -> None:
    name = f"zephon-test-{uuid.uuid4().hex[:8]}"
    other_seed = example_spec(corpus, lanes=LANES, global_batch_size=BATCH, seed=1)
    with OwnedLoader(spec, lane_owners=2, rank=0, world_size=2, name=name) as first:
        fp = spec.fingerprint["total"]
        with pytest.raises(SpecError) as info:
            OwnedLoader(other_seed, lane_owners=2, rank=1, world_size=2, name=name)
        assert str(info.value).startswith(
            f"lane owners: the run named {name!r} runs pipeline fingerprint {fp} on 2 owners, but this "
            f"rank asks for fingerprint {other_seed.fingerprint['total']} on 2 owners"
        )
        with pytest.raises(
            SpecError,
            match=f"runs pipeline fingerprint {fp} on 2 owners, but this rank asks for fingerprint {fp} on 3 owners",
        ):
            OwnedLoader(spec, lane_owners=3, rank=1, world_size=2, name=name)
        assert first.table.generations == (0, 0)


def test_a_full_owner_is_retried_with_the_clients_backoff(spec: zf.LoaderSpec) -> None:
    """An owner refusing a call with RESOURCE_EXHAUSTED (its per-client limit) is asked again
    after the client's backoff, read on its clock; the bytes are the Loader's."""
    from concurrent import futures as cf

    from zephon_flow.core.clock import ManualClock
    from zephon_flow.service.rpc import unary_handler
    from zephon_flow.service.wire import encode_step

    with zf.Loader(spec) as loader:
        batches = [batch for _, (_, batch) in zip(range(4), loader, strict=False)]
    refused: list[int] = []

    def stream(request: lo.RowsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        step = int(request.start_step)
        if step == 1 and len(refused) < 2:
            refused.append(step)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this client already holds 16 open calls")
        if step < len(batches):
            yield from encode_step(step, batches[step], ahead=4)

    server = grpc.server(cf.ThreadPoolExecutor(max_workers=16))
    port = server.add_insecure_port("127.0.0.1:0")
    address = f"127.0.0.1:{port}"

    def table(request: lo.TableRequest, context: grpc.ServicerContext) -> lo.TableReply:
        owner = lo.OwnerEntry(lanes=list(range(LANES)), address=address, generation=0)
        return lo.TableReply(lanes=LANES, global_batch_size=BATCH, finite=False, owners=[owner])

    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "zephon.v1.LaneOwners",
                {
                    "Table": unary_handler(table, lo.TableRequest, lo.TableReply),
                    "StreamRows": grpc.unary_stream_rpc_method_handler(
                        stream, request_deserializer=lo.RowsRequest.FromString
                    ),
                },
            )
        ]
    )
    server.start()
    clock = ManualClock()
    try:
        with zf.Client(address, 0, 1, lane_owners=True, clock=clock, backoff=0.1) as client:
            got = [(step, batch_digest(batch)) for _, (step, batch) in zip(range(3), client, strict=False)]
        assert got == [(s, batch_digest(b)) for s, b in enumerate(batches[:3])]
        assert refused == [1, 1]
        assert clock.waited == pytest.approx(0.1 + 0.2)  # backoff, doubling
    finally:
        server.stop(None)


def test_serve_exits_with_status_3_when_an_owner_is_lost_for_good(
    ray_session: None, spec: zf.LoaderSpec, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``zephon serve --ray`` (its ``serve`` loop, in this process's Ray): the only owner dies
    with ``--max-replacements 0``; the rank is told and the server exits with status 3. The
    server notices first (it polls every 0.2 s here) and the rank asks to replace the owner
    only 3 s after it lost it (its backoff): the server keeps answering until it has told the
    rank (it used to stop 2 s after the failure, and the rank met a closed port)."""
    import argparse

    from zephon_flow.cluster import serve as serve_module
    from zephon_flow.service.server import EXIT_PIPELINE_FAILED

    made: list[OwnersServer] = []
    ready = threading.Event()

    class Recorded(OwnersServer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)
            ready.set()

    monkeypatch.setattr(serve_module, "OwnersServer", Recorded)
    monkeypatch.setattr(serve_module, "POLL_SECONDS", 0.2)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    args = argparse.Namespace(
        lane_owners=1,
        world_size=1,
        ray_address=None,
        host="127.0.0.1",
        port=0,
        resume=None,
        checkpoint_dir=None,
        backend="inline",
        workers=1,
        ahead=8,
        keep=8,
        no_verify_resume=False,
        token_file=str(token),
        tls_cert=None,
        tls_key=None,
        stream_timeout=300.0,
        checkpoint_every=None,
        keep_checkpoints=3,
        held_bytes=None,
        max_replacements=0,
    )
    told: list[BaseException] = []

    def rank() -> None:
        assert ready.wait(120)
        server = made[0]
        address = f"127.0.0.1:{server.port}"
        with zf.Client(address, 0, 1, lane_owners=True, token="s3cret", backoff=3.0) as client:
            it = iter(client)
            assert next(it)[0] == 0
            os.kill(server.owner_pids()[0], signal.SIGKILL)
            try:
                for _ in range(20):
                    next(it)
            except zf.ServiceError as exc:
                told.append(exc)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    worker = threading.Thread(target=rank)
    worker.start()
    try:
        assert serve_module.serve(args, spec) == EXIT_PIPELINE_FAILED
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        worker.join(60)
    assert len(told) == 1 and "lane owner 0 (lanes [0, 1, 2, 3, 4, 5]) died at step" in str(told[0])
    assert "max_replacements=0" in str(told[0]) and "the run cannot go on" in str(told[0])


def test_a_failed_owner_pipeline_stops_the_run(ray_session: None, tmp_path: Any) -> None:
    """An owner's pipeline that raises: the rank gets the error by name (INTERNAL), and the
    run says it cannot go on (``failed``, health NOT_SERVING: ``zephon serve`` exits with 3)."""
    import ray
    import test_service_faults

    ray.cloudpickle.register_pickle_by_value(test_service_faults)  # type: ignore[no-untyped-call]
    spec = test_service_faults.numbers_spec(tmp_path, fail_at=12)
    server = OwnersServer(spec, owners=1, world_size=1, ahead=4)
    address = f"127.0.0.1:{server.port}"
    try:
        with zf.Client(address, 0, 1, lane_owners=True) as client, pytest.raises(zf.ServiceError) as info:
            for _ in client:
                pass
        assert info.value.code == "INTERNAL"
        assert "DoFn 'number' raised ValueError: record 12 is poison" in str(info.value)
        assert server.poll() is not None and "record 12 is poison" in str(server.failed)
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop()
