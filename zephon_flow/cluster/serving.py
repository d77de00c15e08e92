"""The LaneOwners gRPC service: each owner streams ranks their rows; the coordinator, its table.

An owner's ``StreamRows`` sends rank ``r`` of ``W``, step by step, the rows of ``r``'s slice
that lie on the owner's lanes, as the batch service's ``BatchChunk`` messages (``wire``), over
one long call: the client acknowledges on the call's request stream the step it needs next,
and the owner sends at most the client's ``window`` steps past it; the client concatenates the
owners' shares in lane order (``zephon_flow.service.fanin``). The
coordinator's endpoint (in the ``zephon serve --ray`` process) answers ``Table``, ``Replace``
and ``Checkpoint`` by asking the coordinator actor. Nothing here holds a batch for long.

Every endpoint is as guarded as ``zephon serve``'s (``Serving``): the shared token on every
call but health checks, TLS, and each request checked against the run before any work (the
pipeline's fingerprint, the run's world size, the rank, a start step the owner holds or can
reach), with a bound on the calls one client connection may hold open at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from zephon_flow.cluster.coordinator import OwnerTable
from zephon_flow.cluster.owner import FLOOR_REACH, LaneOwner, OwnerError, share_of
from zephon_flow.core.clock import Clock, wait_until
from zephon_flow.core.errors import SpecError, ZephonError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.core.options import check_int, check_seconds
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.service import auth
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service._proto import lane_owners_pb2 as lo
from zephon_flow.service.fanin import ACKS_METADATA
from zephon_flow.service.rpc import unary_handler
from zephon_flow.service.wire import MAX_MESSAGE_BYTES, encode_step

SERVICE = "zephon.v1.LaneOwners"

_log = logging.getLogger("zephon_flow.serve")


def _abort(context: grpc.ServicerContext, code: str, message: str) -> NoReturn:
    context.abort(getattr(grpc.StatusCode, code), message)
    raise AssertionError("grpc's abort returned")


#: Steps past a rank's last asked step that it may ask for: its prefetch (4), the stride of its
#: progress reports (8, what a replacement owner knows of it) and some slack, beyond ``ahead``.
ASK_SLACK = 24
#: How long stopping waits for a scheduled checkpoint being written.
STOP_WRITE_SECONDS = 10.0
#: Requests are small; a larger one is refused before it is read.
MAX_REQUEST_BYTES = 64 << 10


class _Acks:
    """A ``StreamRows`` call's acknowledgements, read from its request stream by a thread of
    their own: the owner sends step ``s`` only once the client needs a step past
    ``s - window`` (so a rank holds at most ``window`` steps it has not taken). Its waits read
    ``clock`` (the owner's)."""

    def __init__(self, requests: Iterator[lo.RowsRequest], window: int, first: int, clock: Clock) -> None:
        self._requests, self._window, self._taken, self._clock = requests, window, first, clock
        self._cond = threading.Condition()
        self._ended = False
        self._thread = threading.Thread(target=self._read, name="zephon-owner-acks", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for request in self._requests:
                with self._cond:
                    self._taken = max(self._taken, int(request.taken))
                    self._cond.notify_all()
        except Exception:  # the call ended (cancelled, closed): the sender sees it too
            pass
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def wait_for(self, step: int, context: grpc.ServicerContext, timeout: float) -> bool:
        """Waits until ``step`` may be sent; False if no acknowledgement allowed it within
        ``timeout`` seconds on the clock while the call was active (an inactive call returns
        True: the caller's loop ends)."""
        with self._cond:
            return wait_until(
                self._clock,
                self._cond,
                lambda: step < self._taken + self._window or not context.is_active(),
                timeout,
            )

    def close(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()


@dataclass(frozen=True)
class Serving:
    """How the lane owners' gRPC endpoints serve (``zephon serve --ray``'s options): where
    (``host``), for which ``world_size``, the shared ``token`` (None: none), TLS as PEM bytes
    (``tls_cert``, ``tls_key``: shipped to the owners, which may run on other nodes), the
    pipeline's ``fingerprint`` as the serving process computed it (what clients compare), how long
    a call waits for its step (``stream_timeout``) and how many calls one client connection may
    hold open at once (``max_client_calls``; more are refused with ``RESOURCE_EXHAUSTED``,
    which clients retry). ``replay``: how many steps past where the owners hold a rank may come
    back at, beyond the usual slack: ``--checkpoint-every``, since a server resumed from its
    newest checkpoint is that far behind ranks that read on (the owners replay the steps in
    between, as ``zephon serve`` does)."""

    host: str = "127.0.0.1"
    world_size: int = 1
    token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    stream_timeout: float = 300.0
    max_client_calls: int = 16
    max_calls: int = 256
    fingerprint: str = ""
    replay: int = 0

    def __post_init__(self) -> None:
        check_int(self.replay, "replay", owner="lane owners", low=0)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SpecError("zephon serve: --tls-cert and --tls-key go together")
        check_seconds(self.stream_timeout, "stream_timeout", owner="zephon serve")
        for name in ("world_size", "max_client_calls", "max_calls"):
            check_int(getattr(self, name), name, owner="lane owners")


class _CallLimit:
    """Counts the calls each client connection (its peer address) holds open."""

    def __init__(self, limit: int) -> None:
        self._limit, self._open, self._lock = limit, Counter[str](), threading.Lock()

    @contextlib.contextmanager
    def enter(self, context: grpc.ServicerContext, what: str) -> Iterator[None]:
        peer = str(context.peer())
        with self._lock:
            full = self._open[peer] >= self._limit
            if not full:
                self._open[peer] += 1
        if full:
            _abort(
                context,
                "RESOURCE_EXHAUSTED",
                f"{what}: this client already holds {self._limit} open calls (the limit per client "
                f"connection); retry once some have ended",
            )
        try:
            yield
        finally:
            with self._lock:
                self._open[peer] -= 1
                if not self._open[peer]:
                    del self._open[peer]


def _server(
    host: str, port: int, handlers: dict[str, Any], serving: Serving, max_calls: int
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A started gRPC server of ``handlers`` with health, the token check and TLS of ``serving``."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_calls + 4, thread_name_prefix="zephon-owners"),
        handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers)],
        interceptors=[auth.TokenInterceptor(serving.token)] if serving.token else [],
        maximum_concurrent_rpcs=max_calls,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"{host}:{port}"
    try:
        if serving.tls_cert is not None and serving.tls_key is not None:
            creds = grpc.ssl_server_credentials([(serving.tls_key, serving.tls_cert)])
            bound = server.add_secure_port(address, creds)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ZephonError(f"lane owners: cannot listen on {address}: {exc}") from exc
    if not bound:
        raise ZephonError(f"lane owners: cannot listen on {address} (in use?)")
    server.start()
    for name in ("", SERVICE):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, servicer


def _check_run(
    context: grpc.ServicerContext, fingerprint: str, sent: str, world_size: int, sent_world_size: int
) -> None:
    """Refuses a call for another pipeline or another world size than the run's, by name."""
    if sent and sent != fingerprint:
        _abort(
            context,
            "FAILED_PRECONDITION",
            f"the client was built for pipeline fingerprint {sent}, but these lane owners run "
            f"fingerprint {fingerprint}: connect to the server of that pipeline",
        )
    if sent_world_size != world_size:
        _abort(
            context,
            "FAILED_PRECONDITION",
            f"these lane owners serve world_size={world_size}, not {sent_world_size}: restart zephon "
            f"serve --ray with --world-size {sent_world_size} (and --resume from a checkpoint)",
        )


class OwnerServer:
    """Serves one ``LaneOwner``'s rows over gRPC as ``serving`` says (port 0: any free one)."""

    def __init__(self, owner: LaneOwner, serving: Serving | None = None, *, port: int = 0) -> None:
        self._owner = owner
        self._serving = serving = Serving() if serving is None else serving
        self._fingerprint = serving.fingerprint or owner.spec.fingerprint["total"]
        self._limit = _CallLimit(serving.max_client_calls)
        self._server, bound, self._health = _server(
            serving.host,
            port,
            {
                "StreamRows": grpc.stream_stream_rpc_method_handler(
                    self._stream, request_deserializer=lo.RowsRequest.FromString
                ),
                "Live": unary_handler(self._live, lo.LiveRequest, lo.LiveReply),
            },
            serving,
            serving.max_calls,
        )
        self.address = f"{serving.host}:{bound}"

    def _fail(self, context: grpc.ServicerContext, exc: OwnerError) -> NoReturn:
        """The owner's pipeline failed (or lost a step): health says so, the call gets it."""
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        _abort(context, "INTERNAL", str(exc))

    def _rank_slice(self, request: lo.RowsRequest, context: grpc.ServicerContext) -> RankSlice:
        """The caller's rank slice, refused (before any work) unless it is a rank of the run
        with rows on this owner's lanes."""
        owner, serving = self._owner, self._serving
        _check_run(
            context, self._fingerprint, request.fingerprint, serving.world_size, int(request.world_size)
        )
        spec = owner.spec
        try:
            rs = RankSlice(
                rank=int(request.rank),
                world_size=int(request.world_size),
                lanes=spec.lanes,
                global_batch_size=spec.global_batch_size,
            )
        except SpecError as exc:
            _abort(context, "INVALID_ARGUMENT", str(exc))
        if not share_of(rs, owner.lanes)[0]:
            _abort(
                context,
                "INVALID_ARGUMENT",
                f"rank {rs.rank} of {rs.world_size} has no rows on this owner's lanes {owner.lanes} "
                f"(its rows are on lanes {list(rs.lane_ids)}): ask the coordinator's Table",
            )
        return rs

    def _check_step(self, rank: int, step: int, context: grpc.ServicerContext) -> None:
        """Refuses a step the owner no longer holds, or one further past where ``rank`` is than
        a rank asks ahead (``ASK_SLACK`` beyond the owner's ``ahead``): it would move the
        rank's position there, releasing steps the rank still needs."""
        status = self._owner.status()
        low, produced = int(status["low"]), int(status["produced"])
        name = f"{self._owner.name} (lanes {self._owner.lanes})"
        if step < low:
            _abort(
                context,
                "OUT_OF_RANGE",
                f"step {step} is no longer held: {name} holds steps [{low}, {produced}); resume from "
                f"a checkpoint to go back further",
            )
        at = status["positions"].get(rank)
        reach = self._owner.options.ahead + ASK_SLACK + self._serving.replay
        if at is None:  # not asked yet: where the coordinator expects it is a lower bound
            at = status["expected"].get(rank, produced)  # (the slowest rank's step at best), and
            reach += FLOOR_REACH  # ranks run at most FLOOR_REACH past ``ahead`` beyond it
        if step > int(at) + reach:
            _abort(
                context,
                "OUT_OF_RANGE",
                f"step {step} is too far ahead: rank {rank} is at step {at} on {name}, and a rank may "
                f"ask at most {reach} steps past it; to start at step {step}, restart zephon serve "
                f"--ray with --resume from a checkpoint of that step",
            )

    def _stream(self, requests: Iterator[lo.RowsRequest], context: grpc.ServicerContext) -> Iterator[bytes]:
        request = next(requests, None)
        if request is None:
            _abort(context, "INVALID_ARGUMENT", "StreamRows: no RowsRequest was sent")
        rs = self._rank_slice(request, context)
        step, stop = int(request.start_step), int(request.stop_step) or None
        self._check_step(rs.rank, step, context)
        with self._limit.enter(context, f"rank {rs.rank}'s rows of step {step}"):
            paced = _Acks(requests, int(request.window), step, self._owner.clock) if request.window else None
            if paced is not None:
                context.send_initial_metadata(((ACKS_METADATA, "1"),))
            try:
                while context.is_active() and (stop is None or step < stop):
                    if paced is not None and not paced.wait_for(step, context, self._serving.stream_timeout):
                        _abort(
                            context,
                            "DEADLINE_EXCEEDED",
                            f"rank {rs.rank} asked for no step past {step - 1} on {self._owner.name} for "
                            f"{self._serving.stream_timeout:g} s (--stream-timeout): its stream is dropped",
                        )
                    part = self._part(rs, step, context)
                    if part is not None:
                        yield from encode_step(step, part, ahead=self._owner.options.ahead)
                        step += 1
            finally:
                if paced is not None:
                    paced.close()

    def _part(self, rs: RankSlice, step: int, context: grpc.ServicerContext) -> Any:
        """``rs``'s rows of ``step`` on this owner (which thereby counts ``step`` as asked for),
        waiting up to ``--stream-timeout`` on the owner's clock for it to be made (None: the
        call ended meanwhile)."""
        owner = self._owner
        try:
            part = owner.share(rs, step, timeout=self._serving.stream_timeout, active=context.is_active)
        except OwnerError as exc:
            if "no longer held" in str(exc):
                _abort(context, "OUT_OF_RANGE", str(exc))
            self._fail(context, exc)
        if part is None and context.is_active():
            _abort(
                context,
                "DEADLINE_EXCEEDED",
                f"{owner.name} (lanes {owner.lanes}) did not make step {step} within "
                f"{self._serving.stream_timeout:g} s (--stream-timeout): another rank reading "
                f"these lanes has stopped taking steps (the owner runs at most "
                f"{owner.options.ahead} steps past its slowest reader)",
            )
        return part

    def _live(self, request: lo.LiveRequest, context: grpc.ServicerContext) -> lo.LiveReply:
        step = int(request.step)
        status = self._owner.status()
        known = [*status["positions"].values(), *status["expected"].values(), int(status["produced"])]
        reach = self._owner.options.ahead + ASK_SLACK + self._serving.replay
        if step > max(known) + reach:
            _abort(
                context,
                "OUT_OF_RANGE",
                f"Live(step={step}) is too far ahead: the ranks reading {self._owner.name} are at most "
                f"at step {max(known)}, and a rank may ask at most {reach} steps past it",
            )
        with self._limit.enter(context, f"Live(step={step})"):
            try:
                live = self._owner.live(step, timeout=self._serving.stream_timeout, active=context.is_active)
            except OwnerError as exc:
                self._fail(context, exc)
            if live is not None:
                return lo.LiveReply(live=live)
        _abort(
            context,
            "DEADLINE_EXCEEDED" if context.is_active() else "CANCELLED",
            f"{self._owner.name} did not reach step {step} within {self._serving.stream_timeout:g} s "
            f"(--stream-timeout)",
        )

    def stop(self) -> None:
        self._health.enter_graceful_shutdown()
        self._server.stop(1.0).wait()


def table_reply(spec: LoaderSpec, table: OwnerTable, addresses: list[str]) -> lo.TableReply:
    return lo.TableReply(
        fingerprint=spec.fingerprint["total"],
        lanes=spec.lanes,
        global_batch_size=spec.global_batch_size,
        finite=spec.compile().finite,
        owners=[
            lo.OwnerEntry(lanes=list(lanes), address=address, generation=generation)
            for lanes, address, generation in zip(table.lanes, addresses, table.generations, strict=True)
        ],
    )


class CoordinatorServer:
    """The coordinator's gRPC endpoint: ``Table``, ``Replace``, ``Progress`` and ``Checkpoint``
    (written to ``checkpoint_dir`` as ``step-<step>.zfstate``; with ``checkpoint_every`` N, also
    each time the slowest rank has moved N steps on, keeping the newest ``keep_checkpoints``),
    answered by ``coordinator`` (a Ray actor handle of ``actors.CoordinatorActor``) for the
    ranks of ``serving.world_size``. ``failed`` is set (and health turns NOT_SERVING) once the
    run cannot go on: an owner lost past its replacements, or the coordinator gone."""

    def __init__(
        self,
        spec: LoaderSpec,
        coordinator: Any,
        *,
        owners: int,
        serving: Serving,
        port: int = 0,
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
    ) -> None:
        from zephon_flow.runners.ray_env import require_ray

        self._ray = require_ray("zephon serve --ray")
        self.spec, self._coordinator, self._checkpoint_dir = spec, coordinator, checkpoint_dir
        self.fingerprint = spec.fingerprint["total"]
        self.world_size, self.owners, self._serving = serving.world_size, owners, serving
        self._checkpoint_every, self._keep_checkpoints = checkpoint_every, keep_checkpoints
        self._last_checkpoint = int(self._ray.get(coordinator.describe.remote())["first_step"])
        #: Why the run cannot go on (None while it can).
        self.failed: str | None = None
        self._told: set[int] = set()  # the ranks answered with ``failed``
        self._stopping = False
        self._reported: Any = None  # the last progress report, counted before positions are read
        self._writer = self._checkpoint_writer()
        self._server, self.port, self._health = _server(
            serving.host,
            port,
            {
                "Table": unary_handler(self._table, lo.TableRequest, lo.TableReply),
                "Replace": unary_handler(self._replace, lo.ReplaceRequest, lo.TableReply),
                "Checkpoint": unary_handler(self._checkpoint, pb.CheckpointRequest, pb.CheckpointReply),
                "Progress": unary_handler(self._progress, pb.AckRequest, pb.AckReply),
                "ChangeMixture": unary_handler(
                    self._change_mixture, pb.ChangeMixtureRequest, pb.ChangeMixtureReply
                ),
            },
            serving,
            64,
        )
        self.host = serving.host

    def fail(self, why: str) -> None:
        """The run cannot go on: health turns NOT_SERVING (``zephon serve`` exits with 3)."""
        if self.failed is None:
            self.failed = why
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def told_every_rank(self) -> bool:
        """Whether every rank of the run has been answered with ``failed`` (``zephon serve``
        waits for that, within a bound, before it exits)."""
        return len(self._told) >= self.world_size

    def _refuse_if_failed(self, context: grpc.ServicerContext, rank: int) -> None:
        """Once the run cannot go on, every call is answered with why (and its rank counted)."""
        if self.failed is not None:
            self._told.add(rank)
            _abort(context, "FAILED_PRECONDITION", f"the run cannot go on: {self.failed}")

    def poll(self, timeout: float = 30.0) -> None:
        """Checks that the coordinator actor still answers and that no owner's pipeline has
        failed (else ``fail``)."""
        try:
            why = self._ray.get(self._coordinator.failure.remote(), timeout=timeout)
        except self._ray.exceptions.RayActorError as exc:
            self.fail(f"the lane owners' coordinator died: {exc}")
            return
        except self._ray.exceptions.GetTimeoutError:
            return  # busy: the next poll asks again
        if why is not None:
            self.fail(str(why))

    def _reply(self, ref: Any, context: grpc.ServicerContext, rank: int) -> lo.TableReply:
        from zephon_flow.cluster.coordinator import OwnerLostError

        try:
            table, addresses = self._ray.get(ref)
        except self._ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", exc)
            if isinstance(cause, OwnerLostError):
                self.fail(str(cause))
                self._refuse_if_failed(context, rank)
            if isinstance(cause, SpecError):
                _abort(context, "INVALID_ARGUMENT", str(cause))
            _abort(context, "UNAVAILABLE" if isinstance(cause, ZephonError) else "INTERNAL", str(cause))
        except self._ray.exceptions.RayActorError as exc:
            self.fail(f"the lane owners' coordinator died: {exc}")
            _abort(context, "UNAVAILABLE", f"the lane owners' coordinator died: {exc}")
        return table_reply(self.spec, table, addresses)

    def _check_fingerprint(self, sent: str, context: grpc.ServicerContext) -> None:
        _check_run(context, self.fingerprint, sent, self.world_size, self.world_size)

    def _table(self, request: lo.TableRequest, context: grpc.ServicerContext) -> lo.TableReply:
        self._check_fingerprint(request.fingerprint, context)
        self._refuse_if_failed(context, int(request.rank))
        return self._reply(self._coordinator.served_table.remote(), context, int(request.rank))

    def _replace(self, request: lo.ReplaceRequest, context: grpc.ServicerContext) -> lo.TableReply:
        index = int(request.owner)
        if not 0 <= index < self.owners:
            _abort(
                context,
                "INVALID_ARGUMENT",
                f"Replace(owner={index}): no such lane owner; this run's owners are 0..{self.owners - 1}",
            )
        self._refuse_if_failed(context, int(request.rank))
        ref = self._coordinator.replace_served.remote(index, int(request.generation))
        return self._reply(ref, context, int(request.rank))

    def _progress(self, request: pb.AckRequest, context: grpc.ServicerContext) -> pb.AckReply:
        self._check_fingerprint(request.fingerprint, context)
        rank, world_size = int(request.rank), int(request.world_size)
        _check_run(context, self.fingerprint, "", self.world_size, world_size)
        if not 0 <= rank < world_size:
            _abort(context, "INVALID_ARGUMENT", f"rank must be in [0, {world_size}), got {rank}")
        self._refuse_if_failed(context, rank)
        reported = self._coordinator.progress.remote(rank, int(request.step))
        if self._writer is not None:  # its thread looks whether one is due, beside this call
            self._reported = reported
            self._wanted.set()
        return pb.AckReply()

    def _change_mixture(
        self, request: pb.ChangeMixtureRequest, context: grpc.ServicerContext
    ) -> pb.ChangeMixtureReply:
        """``zephon mix``: new weights on every owner from a step on (the coordinator's two phases)."""
        from zephon_flow.service.mixing import MixChange

        self._check_fingerprint(request.fingerprint, context)
        wanted = MixChange.from_request(request)
        ref = self._coordinator.change_mixture.remote(wanted.at_step, wanted.schedule(), wanted.interpolation)
        try:
            history = self._ray.get(ref, timeout=120)
        except self._ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", exc)
            _abort(
                context,
                "INVALID_ARGUMENT" if isinstance(cause, SpecError) else "FAILED_PRECONDITION",
                str(cause),
            )
        except self._ray.exceptions.RayActorError as exc:
            self.fail(f"the lane owners' coordinator died: {exc}")
            _abort(context, "UNAVAILABLE", f"the lane owners' coordinator died: {exc}")
        return pb.ChangeMixtureReply(at_step=wanted.at_step, history_json=json.dumps(history))

    def _checkpoint_writer(self) -> threading.Thread | None:
        """With ``checkpoint_every``, the thread that writes the scheduled checkpoints: beside
        the ranks' progress reports, never in them (a checkpoint waits for the owners to reach
        its step, and the rank that reported may be the one they wait for); one at a time."""
        if self._checkpoint_every is None or self._checkpoint_dir is None:
            return None
        self._wanted = threading.Event()

        def write_when_asked() -> None:
            while self._wanted.wait() and not self._stopping:
                self._wanted.clear()
                self._maybe_checkpoint(self._reported)

        writer = threading.Thread(target=write_when_asked, name="zephon-checkpoint", daemon=True)
        writer.start()
        return writer

    def _maybe_checkpoint(self, reported: Any) -> None:
        """With ``checkpoint_every`` N: writes the state at the slowest rank's step once it has
        moved N steps past the last one written, then keeps the newest ``keep_checkpoints``
        (``reported``: the progress report that asked, counted first)."""
        if self._checkpoint_every is None or self._checkpoint_dir is None or self.failed is not None:
            return
        step = -1
        try:
            with contextlib.suppress(Exception):  # best effort, as the report itself
                self._ray.get(reported, timeout=60)
            positions = self._ray.get(self._coordinator.positions.remote(), timeout=60)
            step = min(positions.values())
            if step < self._last_checkpoint + self._checkpoint_every:
                return
            from zephon_flow.service.server import prune_checkpoints

            self._write(step)
            prune_checkpoints(self._checkpoint_dir, self._keep_checkpoints)
            self._last_checkpoint = step
        except BaseException as exc:  # best effort: the next report brings another chance
            if not self._stopping:  # (stopping: Ray may be gone under the write)
                _log.warning("zephon serve --ray: no checkpoint written (step %d): %s", step, exc)

    def _write(self, step: int) -> str:
        assert self._checkpoint_dir is not None
        os.makedirs(self._checkpoint_dir, exist_ok=True)
        path = os.path.abspath(os.path.join(self._checkpoint_dir, f"step-{step}.zfstate"))
        # Each owner writes its lanes' part; the coordinator, the manifest that names them.
        written: str = self._ray.get(self._coordinator.write_checkpoint.remote(step, path))
        return written

    def _checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointReply:
        self._check_fingerprint(request.fingerprint, context)
        if self._checkpoint_dir is None:
            _abort(
                context,
                "FAILED_PRECONDITION",
                "this server was started without --checkpoint-dir: it cannot write checkpoints",
            )
        step = int(request.step)
        try:
            path = self._write(step)
        except self._ray.exceptions.RayTaskError as exc:
            _abort(context, "INTERNAL", str(getattr(exc, "cause", exc)))
        except OSError as exc:
            _abort(context, "INTERNAL", f"cannot write the checkpoint of step {step}: {exc}")
        return pb.CheckpointReply(step=step, path=path)

    def stop(self) -> None:
        """Stops serving; a scheduled checkpoint being written gets ``STOP_WRITE_SECONDS`` to
        finish (else its parts are left without a manifest, pruned by a later checkpoint)."""
        self._stopping = True
        self._health.enter_graceful_shutdown()
        self._server.stop(1.0).wait()
        if self._writer is not None:
            self._wanted.set()  # an idle writer ends at once
            self._writer.join(STOP_WRITE_SECONDS)
