"""The gRPC batch server: one embedded Loader over all lanes, each rank streamed its row slice."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from zephon_flow.errors import SpecError, ZephonError
from zephon_flow.lanes import RankSlice
from zephon_flow.loader import Loader
from zephon_flow.service import auth
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service.window import StepWindow, WindowError
from zephon_flow.service.wire import CHUNK_BYTES, MAX_MESSAGE_BYTES, encode_step, slice_rows
from zephon_flow.spec import LoaderSpec
from zephon_flow.state import load_state, save_state

SERVICE = "zephon.v1.BatchService"
MAX_REQUEST_BYTES = 64 << 10
CHECKPOINT_TIMEOUT = 120.0


def checkpoint_path(directory: str, step: int) -> str:
    """Where ``Checkpoint(step)`` writes: ``DIR/step-<step>.zfstate``."""
    return os.path.join(directory, f"step-{step}.zfstate")


def _abort(context: grpc.ServicerContext, code: str, message: str) -> NoReturn:
    """Ends the call with status ``code`` (a ``grpc.StatusCode`` name) and ``message``."""
    context.abort(getattr(grpc.StatusCode, code), message)
    raise AssertionError("grpc's abort returned")


class BatchServer:
    """Serves ``spec``'s global batches to ranks of any world size over gRPC.

    Runs one ``zf.Loader`` (world size 1, all lanes, on ``backend`` with ``workers``) from
    ``resume`` (a checkpoint file) or the start, holding a ``StepWindow`` of ``window`` steps
    ahead of the slowest rank's acknowledged step and ``keep`` behind it; each rank's stream
    sends at most ``window`` steps past its acknowledged step. ``token`` (shared secret) is required
    on every call but health checks; ``tls`` is ``(cert_path, key_path)``. ``loader`` replaces
    the embedded Loader by any object with its iteration, ``state_dict()`` and ``close()``
    (benchmarks feed synthetic batches this way).
    """

    def __init__(
        self,
        spec: LoaderSpec,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "inline",
        workers: int = 1,
        checkpoint_dir: str | None = None,
        resume: str | None = None,
        window: int = 32,
        keep: int = 8,
        token: str | None = None,
        tls: tuple[str, str] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        max_streams: int = 64,
        loader: Any = None,
    ) -> None:
        for name, value, low in (("window", window, 1), ("keep", keep, 0), ("max_streams", max_streams, 1)):
            if not isinstance(value, int) or value < low:
                raise SpecError(
                    f"zephon serve: --{name.replace('_', '-')} must be an integer >= {low}, got {value!r}"
                )
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise SpecError(f"zephon serve: --port must be in [0, 65535], got {port!r}")
        if not 0 < chunk_bytes <= CHUNK_BYTES:
            raise SpecError(f"chunk_bytes must be in (0, {CHUNK_BYTES}], got {chunk_bytes!r}")
        self.spec = spec
        self.fingerprint = spec.fingerprint["total"]
        self._checkpoint_dir = checkpoint_dir
        if checkpoint_dir is not None:
            os.makedirs(checkpoint_dir, exist_ok=True)
        if loader is None:
            state = load_state(resume) if resume is not None else None
            loader = Loader(spec, rank=0, world_size=1, backend=backend, workers=workers, state=state)
        self._loader = loader
        first = self._loader.state_dict()
        self._window = StepWindow(first_step=int(first["step"]), first_state=first, ahead=window, keep=keep)
        self._chunk_bytes = chunk_bytes
        self._stop = threading.Event()
        self._producer = threading.Thread(target=self._produce, name="zephon-serve-producer", daemon=True)
        self._bytes_served = 0
        self._bytes_lock = threading.Lock()
        self._started = time.monotonic()
        self._health = health.HealthServicer()
        interceptors = [auth.TokenInterceptor(token)] if token else []
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_streams + 4, thread_name_prefix="zephon-serve"),
            handlers=[self._handlers()],
            interceptors=interceptors,
            maximum_concurrent_rpcs=max_streams,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        address = f"{host}:{port}"
        try:
            if tls is not None:
                self.port = self._server.add_secure_port(address, auth.server_credentials(*tls))
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            self._loader.close()
            raise ZephonError(f"zephon serve: cannot listen on {address}: {exc}") from exc
        if not self.port:
            self._loader.close()
            raise ZephonError(f"zephon serve: cannot listen on {address} (in use?)")
        self.host = host

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> BatchServer:
        self._producer.start()
        self._server.start()
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        self._stop.set()
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self._loader.close()
        if self._producer.is_alive():
            self._producer.join(timeout=30)

    def wait(self) -> None:
        self._server.wait_for_termination()

    def _produce(self) -> None:
        try:
            batches = iter(self._loader)
            while self._window.wait_for_room(self._stop.is_set):
                item = next(batches, None)
                if item is None:
                    self._window.finish()
                    return
                self._window.add(item[1], self._loader.state_dict())
        except BaseException as exc:  # carried to every stream as INTERNAL
            self._window.finish(exc)

    # -- RPCs ----------------------------------------------------------------------------------
    def _handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                # Messages are serialized by wire.encode_step, straight from the arrays.
                "StreamBatches": grpc.unary_stream_rpc_method_handler(
                    self._stream, request_deserializer=pb.StreamBatchesRequest.FromString
                ),
                "Ack": grpc.unary_unary_rpc_method_handler(
                    self._ack,
                    request_deserializer=pb.AckRequest.FromString,
                    response_serializer=pb.AckReply.SerializeToString,
                ),
                "Checkpoint": grpc.unary_unary_rpc_method_handler(
                    self._checkpoint,
                    request_deserializer=pb.CheckpointRequest.FromString,
                    response_serializer=pb.CheckpointReply.SerializeToString,
                ),
                "Status": grpc.unary_unary_rpc_method_handler(
                    self._status,
                    request_deserializer=pb.StatusRequest.FromString,
                    response_serializer=pb.StatusReply.SerializeToString,
                ),
            },
        )

    def _check_fingerprint(self, sent: str, context: grpc.ServicerContext) -> None:
        if sent and sent != self.fingerprint:
            _abort(
                context,
                "FAILED_PRECONDITION",
                f"the client was built for pipeline fingerprint {sent}, but this server serves "
                f"fingerprint {self.fingerprint}: connect to the server of that pipeline",
            )

    def _rank_slice(self, rank: int, world_size: int, context: grpc.ServicerContext) -> RankSlice:
        try:
            return RankSlice(
                rank=rank,
                world_size=world_size,
                lanes=self.spec.lanes,
                global_batch_size=self.spec.global_batch_size,
            )
        except SpecError as exc:
            _abort(context, "INVALID_ARGUMENT", str(exc))

    def _stream(self, request: pb.StreamBatchesRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._check_fingerprint(request.fingerprint, context)
        rank, world_size, step = int(request.rank), int(request.world_size), int(request.start_step)
        rows = self._rank_slice(rank, world_size, context)
        window = self._window
        try:
            window.join(rank, world_size, step)
        except WindowError as exc:
            _abort(context, exc.code, str(exc))
        start, stop, ahead = rows.start, rows.stop, window.ahead
        try:
            while True:
                try:
                    batch = window.take(rank, world_size, step, context.is_active)
                except WindowError as exc:
                    _abort(context, exc.code, str(exc))
                if batch is None:
                    return
                messages = encode_step(
                    step, slice_rows(batch, start, stop), chunk_bytes=self._chunk_bytes, window=ahead
                )
                with self._bytes_lock:
                    self._bytes_served += sum(len(m) for m in messages)
                yield from messages
                step += 1
        finally:
            window.leave(rank, world_size)

    def _ack(self, request: pb.AckRequest, context: grpc.ServicerContext) -> pb.AckReply:
        self._check_fingerprint(request.fingerprint, context)
        rank, world_size = int(request.rank), int(request.world_size)
        self._rank_slice(rank, world_size, context)
        try:
            self._window.ack(rank, world_size, int(request.step))
        except WindowError as exc:
            _abort(context, exc.code, str(exc))
        return pb.AckReply()

    def _checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointReply:
        self._check_fingerprint(request.fingerprint, context)
        directory = self._checkpoint_dir
        if directory is None:
            _abort(
                context,
                "FAILED_PRECONDITION",
                "this server was started without --checkpoint-dir: it cannot write checkpoints",
            )
        remaining = context.time_remaining()
        timeout = CHECKPOINT_TIMEOUT if remaining is None else min(CHECKPOINT_TIMEOUT, remaining)
        step = int(request.step)
        try:
            state = self._window.state_for(step, timeout=timeout)
        except WindowError as exc:
            _abort(context, exc.code, str(exc))
        path = checkpoint_path(directory, step)
        try:
            save_state(state, path)
        except OSError as exc:
            _abort(context, "INTERNAL", f"cannot write the checkpoint {path}: {exc}")
        return pb.CheckpointReply(step=step, path=os.path.abspath(path))

    def _status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        st = self._window.status()
        with self._bytes_lock:
            served = self._bytes_served
        lanes = [
            pb.LaneProgress(
                lane=int(ls["lane"]), records=int(ls["cursor"]["mix_position"]), ended=bool(ls["ended"])
            )
            for ls in st.latest_state["lane_states"]
        ]
        ranks = [
            pb.RankPosition(
                rank=r, next_step=st.positions[r], connected=st.connected[r], sent_step=st.sent[r]
            )
            for r in sorted(st.positions)
        ]
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return pb.StatusReply(
            fingerprint=self.fingerprint,
            world_size=st.world_size,
            first_step=st.low,
            produced_step=st.produced,
            ended=st.ended,
            lanes=lanes,
            ranks=ranks,
            batches_per_second=st.batches_per_second,
            bytes_per_second=served / elapsed,
            bytes_served=served,
        )


def serve_forever(server: BatchServer) -> int:
    """Starts ``server``, prints where it listens, and serves until SIGTERM or SIGINT."""
    import signal
    import sys

    done = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    server.start()
    print(f"zephon serve: listening on {server.host}:{server.port}", flush=True)
    print(f"zephon serve: fingerprint {server.fingerprint}", file=sys.stderr, flush=True)
    while not done.wait(0.5):
        pass
    server.stop(grace=1.0)
    return 0
