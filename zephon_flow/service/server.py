"""The gRPC batch server: one embedded Loader over all lanes, each rank streamed its row slice."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from zephon_flow.core.batches import Batch
from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.checkpoint.store import load_state, save_state
from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import FingerprintMismatchError, SpecError, StateError, ZephonError
from zephon_flow.core.lanes import RankRows, RankSlice
from zephon_flow.core.options import check_int
from zephon_flow.engine.balance import RankBalance, RowCost
from zephon_flow.engine.loader import Loader
from zephon_flow.engine.options import (
    CheckpointOptions,
    EndpointOptions,
    HoldOptions,
    ResumeOptions,
    WorkOptions,
)
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.engine.steps import produce
from zephon_flow.service import auth
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service.held import HeldSteps, HeldStepsError
from zephon_flow.service.mixing import MixChange, naming_the_flag
from zephon_flow.service.rpc import unary_handler
from zephon_flow.service.wire import CHUNK_BYTES, MAX_MESSAGE_BYTES, encode_step, slice_rows

SERVICE = "zephon.v1.BatchService"
MAX_REQUEST_BYTES = 64 << 10
CHECKPOINT_TIMEOUT = 120.0
#: Whose options the server's are, in messages: ``zephon serve``'s flags.
SERVE = "zephon serve"
#: ``zephon serve`` exits with this status when the pipeline fails (a supervisor restarts it).
EXIT_PIPELINE_FAILED = 3
#: How long a failed server keeps serving the error to connected clients before it exits.
FAILURE_NOTICE_SECONDS = 2.0
#: ``zephon serve --ray`` waits until each rank has been told, at most this long: a rank learns
#: of a lost owner only when it next asks the coordinator, after its own retries.
FAILURE_NOTICE_MAX_SECONDS = 30.0
_CHECKPOINT_NAME = re.compile(r"^step-(\d+)\.zfstate$")
_log = logging.getLogger("zephon_flow.serve")


def checkpoint_path(directory: str, step: int) -> str:
    """Where ``Checkpoint(step)`` writes: ``DIR/step-<step>.zfstate``."""
    return os.path.join(directory, f"step-{step}.zfstate")


def prune_checkpoints(directory: str, keep: int) -> list[str]:
    """Deletes all but the ``keep`` newest ``step-<step>.zfstate`` files of ``directory``
    (other files are left alone); returns the paths deleted."""
    steps = sorted(
        int(m.group(1)) for name in os.listdir(directory) if (m := _CHECKPOINT_NAME.match(name)) is not None
    )
    doomed = [checkpoint_path(directory, step) for step in steps[: max(0, len(steps) - keep)]]
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        shutil.rmtree(path + ".parts", ignore_errors=True)  # a manifest's parts (lane owners)
    # Lane owners' parts of a checkpoint whose manifest was never written (the server stopped
    # while it was written), older than the newest manifest: nothing can read them.
    for name in os.listdir(directory):
        m = _CHECKPOINT_NAME.match(name.removesuffix(".parts")) if name.endswith(".parts") else None
        if m is not None and int(m.group(1)) not in steps and int(m.group(1)) < max(steps, default=-1):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            doomed.append(os.path.join(directory, name))
    return doomed


@dataclass(eq=False)
class _OpenStream:
    """A stream being served: what the idle watchdog needs to judge and drop it."""

    rank: int
    world_size: int
    context: grpc.ServicerContext
    step: int
    progress: float  # when its client last took a message or acknowledged


def _abort(context: grpc.ServicerContext, code: str, message: str) -> NoReturn:
    """Ends the call with status ``code`` (a ``grpc.StatusCode`` name) and ``message``."""
    context.abort(getattr(grpc.StatusCode, code), message)
    raise AssertionError("grpc's abort returned")


class ServedLoader(Protocol):
    """What the server serves from: the embedded ``Loader``, or any object that iterates
    ``(step, batch)``, says the state after the last batch yielded, and closes."""

    def __iter__(self) -> Iterator[tuple[int, Batch]]: ...

    def state(self) -> LoaderState: ...

    def close(self) -> None: ...


class BatchServer:
    """Serves ``spec``'s global batches to ranks of any world size over gRPC.

    Runs one ``zf.Loader`` (world size 1, all lanes, on ``backend`` with ``workers``) from
    ``resume`` (a checkpoint file) or the start, holding global batches (``HeldSteps``) up to
    ``ahead`` steps past the slowest rank's acknowledged step and ``keep`` behind it, and, with
    ``held_bytes``, at most that many bytes of them (the step the slowest rank needs next is
    always made); each rank's stream sends at most ``ahead`` steps past its acknowledged step.
    ``token`` (shared secret) is required on every call but health checks; ``tls`` is
    ``(cert_path, key_path)``. ``loader`` replaces the embedded Loader by any ``ServedLoader``
    (benchmarks feed synthetic batches this way). The options are checked as the groups of
    ``zephon_flow.options`` (``EndpointOptions``, ``WorkOptions``, ``ResumeOptions``,
    ``HoldOptions``, ``CheckpointOptions``), named in messages by their ``zephon serve`` flags.

    Faults: when the pipeline fails, health turns NOT_SERVING, every stream and checkpoint call
    gets the error (``INTERNAL``), and ``failed`` is set (``zephon serve`` then exits with
    ``EXIT_PIPELINE_FAILED`` so a supervisor restarts it with ``--resume``). With
    ``checkpoint_every`` N, the state at the slowest rank's acknowledged step is written to
    ``checkpoint_dir`` (on the acknowledgement that moves that step N steps past the last
    one written), keeping the newest
    ``keep_checkpoints`` files. A rank's new stream replaces its old one; a stream whose client
    has taken nothing (no message, no acknowledgement) for ``stream_timeout`` seconds while data
    waits for it is dropped (its client reconnects when it reads again). Resumed, the loader's
    lanes verify their first windows against the checkpoint (``ResumeMismatchError``, a
    pipeline failure) unless ``verify_resume`` is False (``zephon serve --no-verify-resume``).
    ``allow_mix_change`` (``--allow-mix-change``) accepts a ``resume`` checkpoint whose pipeline
    differs only in its ``Mix``'s weights, schedule or interpolation, as ``zf.Loader`` does.
    ``ChangeMixture`` (``zephon mix``) puts new weights in force from a step the loader has not
    begun, while it runs; checkpoints written from then on record it (``mix_history``).
    ``allow_batch_change`` (``--allow-batch-change``) accepts a ``resume`` checkpoint whose
    pipeline differs only in its ``global_batch_size`` (an int or a schedule): the new sizes
    apply from the checkpoint's step on, as ``zf.Loader(allow_batch_change=True)`` does.

    ``balance`` (``zephon serve --balance``: ``"tokens"``, ``"attention"``, ``"images"``, or
    here a function of a row; see ``zf.RankBalance``) sends each rank, instead of its
    contiguous rows, the rows of each held global batch that even out that cost across the
    ranks of its world size, with a ``rows`` field (their global indices); the held batches
    and the checkpoints are the same as without it.

    ``clock`` is what the held steps' waits, the streams' idle timeouts, the rate and the
    embedded Loader's chunk deadlines (``chunk_timeout``) read (tests pass a ``ManualClock``;
    each wait on it moves it, so the chunks in flight age with the server's waits too).
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
        ahead: int = 32,
        keep: int = 8,
        held_bytes: int | None = None,
        token: str | None = None,
        tls: tuple[str, str] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        max_streams: int = 64,
        loader: ServedLoader | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
        stream_timeout: float = 300.0,
        chunk_timeout: float = 300.0,
        verify_resume: bool = True,
        allow_mix_change: bool = False,
        allow_batch_change: bool = False,
        balance: str | RowCost | RankBalance | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        # Phases: check the options, open the loader, hold its steps, set up checkpoints and
        # streams, listen.
        self._clock = clock
        endpoint = EndpointOptions(
            host=host, port=port, token=token, tls=tls, stream_timeout=stream_timeout, owner=SERVE
        )
        work = WorkOptions(backend=backend, workers=workers, chunk_timeout=chunk_timeout, owner=SERVE)
        resumed = ResumeOptions(
            verify_resume=verify_resume,
            allow_mix_change=allow_mix_change,
            allow_batch_change=allow_batch_change,
            owner=SERVE,
        )
        hold = HoldOptions(ahead=ahead, keep=keep, held_bytes=held_bytes, owner=SERVE)
        checkpoints = CheckpointOptions(
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            owner=SERVE,
        )
        _check_stream_options(max_streams, chunk_bytes)
        self._balance = _Balanced.of(balance)
        self.spec, self.fingerprint = spec, spec.fingerprint["total"]
        self._loader = loader if loader is not None else _embedded_loader(spec, resume, work, resumed, clock)
        first = self._state_now()
        self._first_step = first.step
        self._held = _hold(first, hold, checkpoints, clock)
        self._set_up_checkpoints(checkpoints, first.step)
        self._set_up_streams(endpoint.stream_timeout, chunk_bytes)
        self._server = self._grpc_server(endpoint.token, max_streams)
        self.host, self.port = endpoint.host, self._listen(endpoint.host, endpoint.port, endpoint.tls)

    def _state_now(self) -> LoaderState:
        """The loader's state after its last batch, as held: the embedded Loader's
        ``snapshot()``, whose next-window checks are computed only if it is saved (a state
        is completed when written), else ``state()``."""
        snapshot = getattr(self._loader, "snapshot", None)
        return snapshot() if callable(snapshot) else self._loader.state()

    def _set_up_checkpoints(self, options: CheckpointOptions, first_step: int) -> None:
        """Where ``Checkpoint`` and ``--checkpoint-every`` write, and the last step written."""
        self._checkpoint_dir = directory = options.checkpoint_dir
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self._checkpoint_every, self._keep_checkpoints = options.checkpoint_every, options.keep_checkpoints
        self._last_checkpoint = first_step
        self._checkpoint_lock = threading.Lock()

    def _set_up_streams(self, stream_timeout: float, chunk_bytes: int) -> None:
        """The open streams, the producer and watchdog threads, health and the byte count."""
        self._stream_timeout = float(stream_timeout)
        self._open: set[_OpenStream] = set()
        self._open_lock = threading.Lock()
        #: The pipeline's error once it has failed (the server then only reports it).
        self.failed: BaseException | None = None
        self._chunk_bytes = chunk_bytes
        self._stop = threading.Event()
        self._producer = threading.Thread(target=self._produce, name="zephon-serve-producer", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="zephon-serve-watchdog", daemon=True)
        self._bytes_served = 0
        self._bytes_lock = threading.Lock()
        self._started = self._clock.now()
        self._health = health.HealthServicer()

    def _grpc_server(self, token: str | None, max_streams: int) -> grpc.Server:
        """The gRPC server with the batch service, health, and the token check if any."""
        interceptors = [auth.TokenInterceptor(token)] if token else []
        server = grpc.server(
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
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        return server

    def _listen(self, host: str, port: int, tls: tuple[str, str] | None) -> int:
        """Binds ``host:port`` (TLS with ``tls``); returns the port. On failure the loader is
        closed and the error names the address."""
        address = f"{host}:{port}"
        try:
            if tls is not None:
                bound = self._server.add_secure_port(address, auth.server_credentials(*tls))
            else:
                bound = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            self._loader.close()
            raise ZephonError(f"zephon serve: cannot listen on {address}: {exc}") from exc
        if not bound:
            self._loader.close()
            raise ZephonError(f"zephon serve: cannot listen on {address} (in use?)")
        return int(bound)

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> BatchServer:
        self._producer.start()
        self._server.start()
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._watchdog.start()
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        self._stop.set()
        if self._watchdog.is_alive():
            self._watchdog.join(timeout=5)
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self._loader.close()
        if self._producer.is_alive():
            self._producer.join(timeout=30)

    def wait(self) -> None:
        self._server.wait_for_termination()

    def _produce(self) -> None:
        """The producer thread: the embedded Loader makes its batches here, straight into the
        held steps (``Loader.feed``: the engine's loop, ``engine/steps.py``, with no queue in
        between); any other ``ServedLoader`` is drained into them by the same loop."""
        if isinstance(self._loader, Loader):
            self._loader.feed(_HeldSink(self))
            return
        produce(
            _Drained(self._loader, self._state_now, self._first_step),
            room=self._room,
            put=self._hold_step,
            fail=self._fail,
            end=self._held.finish,
        )

    def _room(self, step: int) -> bool:
        return self._held.wait_for_room(self._stop.is_set)

    def _hold_step(self, made: tuple[Batch, LoaderState]) -> bool:
        self._held.add(*made)
        return True

    def _fail(self, exc: BaseException) -> None:
        """The pipeline failed: health says so, and every stream and checkpoint call gets the
        error, which tells clients that the server is going down to be restarted."""
        self.failed = exc
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        _log.error("zephon serve: the pipeline failed: %s", exc)
        self._held.finish(
            RuntimeError(
                f"{type(exc).__name__}: {exc}\n(the server is exiting with status {EXIT_PIPELINE_FAILED}; "
                f"a supervisor restarts it with --resume from its last checkpoint)"
            )
        )

    # -- background duties: checkpoints every N steps, dropping idle streams -------------------
    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self._drop_idle()

    def _maybe_checkpoint(self) -> None:
        """After an acknowledgement: writes the state at the slowest rank's step once that has
        moved ``checkpoint_every`` steps past the last one written (a resume from it serves
        every rank's next step), then prunes to the newest ``keep_checkpoints``."""
        if self._checkpoint_every is None or self._checkpoint_dir is None or self.failed is not None:
            return
        with self._checkpoint_lock:
            step = self._held.slowest()
            if step < self._last_checkpoint + self._checkpoint_every:
                return
            try:
                state = self._held.state_for(step, timeout=0.0)
            except HeldStepsError:
                return  # released meanwhile: the next acknowledgement brings another
            path = checkpoint_path(self._checkpoint_dir, step)
            try:
                save_state(self._saved(state), path)
                prune_checkpoints(self._checkpoint_dir, self._keep_checkpoints)
            except OSError as exc:
                _log.error("zephon serve: cannot write the checkpoint %s: %s", path, exc)
                return
            self._last_checkpoint = step
            _log.info("zephon serve: wrote %s", path)

    def _drop_idle(self) -> None:
        now = self._clock.now()
        with self._open_lock:
            idle = [
                o
                for o in self._open
                if now - o.progress > self._stream_timeout
                and self._held.waiting_for_client(o.rank, o.world_size, o.step)
            ]
        for o in idle:
            _log.warning(
                "zephon serve: dropping rank %d's stream at step %d: its client has taken nothing for "
                "%g s (--stream-timeout)",
                o.rank,
                o.step,
                self._stream_timeout,
            )
            o.context.cancel()
            with self._open_lock:
                self._open.discard(o)

    def _touch(self, rank: int, world_size: int) -> None:
        """``rank``'s client acknowledged: its stream is alive."""
        now = self._clock.now()
        with self._open_lock:
            for o in self._open:
                if o.rank == rank and o.world_size == world_size:
                    o.progress = now

    # -- RPCs ----------------------------------------------------------------------------------
    def _handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                # Messages are serialized by wire.encode_step, straight from the arrays.
                "StreamBatches": grpc.unary_stream_rpc_method_handler(
                    self._stream, request_deserializer=pb.StreamBatchesRequest.FromString
                ),
                "Ack": unary_handler(self._ack, pb.AckRequest, pb.AckReply),
                "Checkpoint": unary_handler(self._checkpoint, pb.CheckpointRequest, pb.CheckpointReply),
                "Status": unary_handler(self._status, pb.StatusRequest, pb.StatusReply),
                "ChangeMixture": unary_handler(
                    self._change_mixture, pb.ChangeMixtureRequest, pb.ChangeMixtureReply
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

    def _rank_slice(self, rank: int, world_size: int, context: grpc.ServicerContext, step: int) -> RankSlice:
        """``rank``'s rows of step ``step``; under a batch size schedule, ``world_size`` must
        divide the size of every step from ``step`` on (``rows_at`` gives the later ones)."""
        try:
            rows = RankRows(
                rank=rank, world_size=world_size, lanes=self.spec.lanes, schedule=self.spec.batch_schedule
            )
            rows.check_from(step)
            return rows.at(step)
        except SpecError as exc:
            _abort(context, "INVALID_ARGUMENT", str(exc))

    def _stream(self, request: pb.StreamBatchesRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._check_fingerprint(request.fingerprint, context)
        rank, world_size, step = int(request.rank), int(request.world_size), int(request.start_step)
        rows = self._rank_slice(rank, world_size, context, step)
        held = self._held
        try:
            stream = held.join(rank, world_size, step)
        except HeldStepsError as exc:
            _abort(context, exc.code, str(exc))
        me = _OpenStream(rank, world_size, context, step, self._clock.now())
        with self._open_lock:
            self._open.add(me)
        try:
            while True:
                try:
                    batch = held.take(rank, world_size, step, context.is_active, stream)
                except HeldStepsError as exc:
                    _abort(context, exc.code, str(exc))
                if batch is None:
                    return
                messages = encode_step(
                    step,
                    self._rows_of(step, batch, rows, context)
                    if self._balance
                    else slice_rows(batch, *rows_at(self.spec, rows, step)),
                    chunk_bytes=self._chunk_bytes,
                    ahead=held.advised_ahead(),
                )
                with self._bytes_lock:
                    self._bytes_served += sum(len(m) for m in messages)
                for message in messages:
                    yield message
                    me.progress = self._clock.now()
                step += 1
                me.step = step
        finally:
            with self._open_lock:
                self._open.discard(me)
            held.leave(rank, world_size, stream)

    def _rows_of(self, step: int, batch: Batch, rows: RankSlice, context: grpc.ServicerContext) -> Batch:
        """``rows.rank``'s balanced rows of held global batch ``step`` (``balance``)."""
        assert self._balance is not None
        try:
            return self._balance.rows(step, batch, rows.rank, rows.world_size)
        except ZephonError as exc:
            _abort(context, "FAILED_PRECONDITION", f"zephon serve --balance: {exc}")

    def _ack(self, request: pb.AckRequest, context: grpc.ServicerContext) -> pb.AckReply:
        self._check_fingerprint(request.fingerprint, context)
        rank, world_size = int(request.rank), int(request.world_size)
        self._rank_slice(rank, world_size, context, int(request.step))
        try:
            self._held.ack(rank, world_size, int(request.step))
        except HeldStepsError as exc:
            _abort(context, exc.code, str(exc))
        self._touch(rank, world_size)
        self._maybe_checkpoint()
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
            state = self._held.state_for(step, timeout=timeout)
        except HeldStepsError as exc:
            _abort(context, exc.code, str(exc))
        path = checkpoint_path(directory, step)
        try:
            save_state(self._saved(state), path)
        except OSError as exc:
            _abort(context, "INTERNAL", f"cannot write the checkpoint {path}: {exc}")
        return pb.CheckpointReply(step=step, path=os.path.abspath(path))

    def _saved(self, state: LoaderState) -> LoaderState:
        """A held state as a checkpoint writes it: the embedded Loader's ``saved_form`` (with
        the mixture history as it is now, changes made while running included)."""
        saved_form = getattr(self._loader, "saved_form", None)
        return saved_form(state) if callable(saved_form) else state

    def _change_mixture(
        self, request: pb.ChangeMixtureRequest, context: grpc.ServicerContext
    ) -> pb.ChangeMixtureReply:
        self._check_fingerprint(request.fingerprint, context)
        change = getattr(self._loader, "change_mixture", None)
        if not callable(change):
            _abort(context, "UNIMPLEMENTED", "this server's loader cannot change its mixture while running")
        wanted = MixChange.from_request(request)
        try:
            history = change(wanted.at_step, schedule=wanted.schedule(), interpolation=wanted.interpolation)
        except StateError as exc:
            _abort(context, "FAILED_PRECONDITION", str(exc))
        except SpecError as exc:
            _abort(context, "INVALID_ARGUMENT", str(exc))
        except ZephonError as exc:
            _abort(context, "FAILED_PRECONDITION", str(exc))
        _log.info("zephon serve: mixture changed from step %d on: %s", wanted.at_step, wanted.schedule())
        return pb.ChangeMixtureReply(at_step=wanted.at_step, history_json=json.dumps(history))

    def _status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        st = self._held.status()
        with self._bytes_lock:
            served = self._bytes_served
        lanes = [
            pb.LaneProgress(lane=lane.lane, records=lane.cursor.mix_position, ended=lane.ended)
            for _, lane in sorted(st.latest_state.lane_states.items())
        ]
        ranks = [
            pb.RankPosition(
                rank=r, next_step=st.positions[r], connected=st.connected[r], sent_step=st.sent[r]
            )
            for r in sorted(st.positions)
        ]
        elapsed = max(self._clock.now() - self._started, 1e-9)
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


class _HeldSink:
    """The server's held steps as the embedded Loader's ``StepSink``: room while the held
    steps have it (and the server runs), each batch held with the state after it, the end or
    the failure told to them."""

    def __init__(self, server: BatchServer) -> None:
        self._server = server

    def room(self, step: int) -> bool:
        return self._server._room(step)

    def add(self, step: int, batch: Batch, after: LoaderState) -> None:
        self._server._held.add(batch, after)

    def end(self, error: BaseException | None) -> None:
        if error is None:
            self._server._held.finish()
        else:
            self._server._fail(error)


class _Drained:
    """A served loader as the engine's source of steps: each batch it yields, with the state
    after it (``state_now``); None once it has no more. Iterating starts at the first step
    asked for, in the producer's thread."""

    def __init__(self, loader: ServedLoader, state_now: Callable[[], LoaderState], first_step: int) -> None:
        self._loader, self._state_now = loader, state_now
        self._batches: Iterator[tuple[int, Batch]] | None = None
        self.step = first_step

    def make(self) -> tuple[Batch, LoaderState] | None:
        if self._batches is None:
            self._batches = iter(self._loader)
        item = next(self._batches, None)
        if item is None:
            return None
        self.step += 1
        return item[1], self._state_now()


class _Balanced:
    """A server's balanced slices: each (step, world size)'s assignment made once, for the
    ranks that ask for it (the last ``keep`` kept)."""

    def __init__(self, balance: RankBalance, keep: int = 64) -> None:
        self.balance, self._keep = balance, keep
        self._made: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, value: str | RowCost | RankBalance | None) -> _Balanced | None:
        balance = RankBalance.of(value)
        return None if balance is None else cls(balance)

    def rows(self, step: int, batch: Batch, rank: int, world_size: int) -> Batch:
        where = f"global batch {step}"
        with self._lock:
            made = self._made.get((step, world_size))
        if made is None:
            made = self.balance.assign(batch, world_size, where=where)
            with self._lock:
                self._made[(step, world_size)] = made
                while len(self._made) > self._keep:
                    self._made.popitem(last=False)
        return self.balance.select(batch, made[rank], where=where)


def rows_at(spec: LoaderSpec, rows: RankSlice, step: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rows.rank``'s rows of global batch ``step`` (its size under
    ``spec``'s batch size schedule; ``rows`` is the rank's slice of some step)."""
    size = spec.batch_size(step)
    if size == rows.global_batch_size:
        return rows.start, rows.stop
    per_rank = size // rows.world_size
    return rows.rank * per_rank, (rows.rank + 1) * per_rank


def serve_forever(server: BatchServer) -> int:
    """Starts ``server``, prints where it listens, and serves until SIGTERM or SIGINT (status
    0), or until the pipeline fails: then, once connected clients have had the error, it exits
    with ``EXIT_PIPELINE_FAILED`` for a supervisor to restart it with ``--resume``."""
    import signal

    done = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    server.start()
    print(f"zephon serve: listening on {server.host}:{server.port}", flush=True)
    print(f"zephon serve: fingerprint {server.fingerprint}", file=sys.stderr, flush=True)
    while server.failed is None and not done.wait(0.2):
        pass
    # Read before stopping, whatever ended the wait: a signal that came after a failure (even
    # before this loop saw it) still exits as a failure, and stopping itself fails nothing.
    return exit_status(server.failed, "the pipeline failed", done, lambda: server.stop(grace=1.0))


def exit_status(
    failed: object | None,
    what: str,
    done: threading.Event,
    stop: Callable[[], None],
    told: Callable[[], bool] | None = None,
) -> int:
    """How ``zephon serve`` (and ``serve --ray``) ends once its wait is over: 0 after a signal
    with nothing failed; else the failure said on stderr, ``FAILURE_NOTICE_SECONDS`` for the
    ranks' streams to get it (with ``told``: until it says every rank was answered with the
    failure, at most ``FAILURE_NOTICE_MAX_SECONDS``; a signal cuts either short), and
    ``EXIT_PIPELINE_FAILED``."""
    if failed is None:
        stop()
        return 0
    print(
        f"zephon serve: error: {what}: {failed}\n"
        f"zephon serve: exiting with status {EXIT_PIPELINE_FAILED}; restart with --resume "
        f"from the last checkpoint",
        file=sys.stderr,
        flush=True,
    )
    if told is None:
        done.wait(FAILURE_NOTICE_SECONDS)
    else:
        for _ in range(int(FAILURE_NOTICE_MAX_SECONDS / 0.1)):
            if told() or done.wait(0.1):
                break
    stop()
    return EXIT_PIPELINE_FAILED


def _embedded_loader(
    spec: LoaderSpec, resume: str | None, work: WorkOptions, resumed: ResumeOptions, clock: Clock
) -> Loader:
    """The server's own Loader: world size 1, every lane, from ``resume`` or the start (its
    lanes' first windows verified against the checkpoint unless ``verify_resume`` is False;
    a changed mixture accepted with ``allow_mix_change``; refused, the error names the flag);
    its backend's chunk deadlines read the server's ``clock``."""
    state = load_state(resume, codecs=spec.compile().derived_codecs) if resume is not None else None
    try:
        return Loader(
            spec, rank=0, world_size=1, state=state, clock=clock, **work.kwargs(), **resumed.kwargs()
        )
    except FingerprintMismatchError as exc:
        named = naming_the_flag(exc, "zephon serve")
        if "allow_batch_change=True" in str(exc):  # a changed global_batch_size: its flag
            named = FingerprintMismatchError(f"{named}; zephon serve: pass --allow-batch-change")
        raise named from exc


def _hold(
    first: LoaderState, hold: HoldOptions, checkpoints: CheckpointOptions, clock: Clock
) -> HeldSteps[LoaderState]:
    """The held steps, from the loader's first state. Resumed from its own --checkpoint-every
    checkpoint, the server can be up to N steps (plus ``ahead`` and an acknowledgement stride)
    behind its ranks: they may reconnect that far ahead, and production replays the steps in
    between."""
    every = checkpoints.checkpoint_every
    reach = hold.ahead if every is None else 2 * hold.ahead + every
    return HeldSteps(
        first_step=first.step,
        first_state=first,
        ahead=hold.ahead,
        keep=hold.keep,
        reach=reach,
        max_bytes=hold.held_bytes,
        clock=clock,
    )


def _check_stream_options(max_streams: int, chunk_bytes: int) -> None:
    """Refuses a bound on open calls or a message size the server cannot use."""
    check_int(max_streams, "max_streams", owner=SERVE)
    if not 0 < chunk_bytes <= CHUNK_BYTES:
        raise SpecError(f"chunk_bytes must be in (0, {CHUNK_BYTES}], got {chunk_bytes!r}")
