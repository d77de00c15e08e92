"""``zf.Client``: one trainer rank's batches from a ``zephon serve`` server, with reconnects."""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from types import TracebackType
from typing import Any

import grpc

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import ServiceError, SpecError
from zephon_flow.core.options import check_int, check_seconds
from zephon_flow.core.retry import Backoff
from zephon_flow.engine.options import TopologyOptions
from zephon_flow.service import auth
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service.fanin import OwnerFanIn
from zephon_flow.service.rpc import unary_call
from zephon_flow.service.wire import MAX_MESSAGE_BYTES, StepAssembler

_METHOD = "/zephon.v1.BatchService/"
# Worth another try after a pause: the server is restarting or unreachable (UNAVAILABLE), or
# has no room for the call right now (RESOURCE_EXHAUSTED: its concurrent-call limit).
_RETRY = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
# A stream ended by the server without a reason: it dropped the stream as idle (--stream-timeout)
# or a newer stream of the rank replaced it; reading again reconnects.
_STREAM_RETRY = _RETRY | {grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}
# An acknowledgement lost to these is made good by the stream's reconnect (which restarts the
# rank's position at next_step) or by the next acknowledgement.
_ACK_LOST = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def _fingerprint(value: str | Mapping[str, str] | None) -> str:
    if value is None:
        return ""
    if isinstance(value, Mapping):
        if "total" not in value:
            raise SpecError("Client: fingerprint= must be spec.fingerprint or its 'total' string")
        return str(value["total"])
    if not isinstance(value, str):
        raise SpecError(f"Client: fingerprint= must be a str or spec.fingerprint, got {type(value).__name__}")
    return value


def _plain(message: Any) -> Any:
    """A message as plain data: every field, numbers as numbers, lists for repeated fields."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            value = [_plain(v) for v in value] if _is_repeated(field) else _plain(value)
        elif _is_repeated(field):
            value = list(value)
        out[field.name] = value
    return out


def _is_repeated(field: Any) -> bool:
    return bool(field.is_repeated)


class _Acker:
    """Tells the server, from a background thread, the step up to which the rank has taken its
    batches; acknowledgements made while one is in flight are coalesced into the latest.
    ``done`` is the highest step the server has confirmed."""

    def __init__(self, send: Callable[[int], None]) -> None:
        self._send = send
        self._cond = threading.Condition()
        self._wanted = self._sent = self.done = -1
        self._closed = False
        self.error: ServiceError | None = None
        self._thread = threading.Thread(target=self._run, name="zephon-client-ack", daemon=True)
        self._thread.start()

    def ack(self, step: int) -> None:
        with self._cond:
            self._wanted = max(self._wanted, step)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._wanted <= self._sent and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                step = self._sent = self._wanted
            try:
                self._send(step)
                self.confirmed(step)
            except grpc.RpcError as exc:
                if exc.code() not in _ACK_LOST:
                    self.error = ServiceError(
                        f"acknowledging step {step} failed: {exc.code().name}: {exc.details()}",
                        code=exc.code().name,
                    )
            except ValueError:  # the channel was closed under us
                return

    def confirmed(self, step: int) -> None:
        with self._cond:
            self.done = max(self.done, step)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


#: Clients not yet closed: closed at exit, while grpc is still whole, so that an iterator left
#: suspended (``next(iter(client))`` at module level) does not print errors as Python tears down.
_OPEN: weakref.WeakSet[Client] = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    for client in list(_OPEN):
        with contextlib.suppress(Exception):
            client.close()


_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", 1 << 20),
    # Reconnect attempts follow our own backoff, not grpc's (which grows to 2 minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def _open_channel(address: str, root_certificates: bytes | None) -> grpc.Channel:
    """A channel to ``address`` (TLS with ``root_certificates``) taking messages as large as
    the server sends, reconnecting on a short backoff of its own (our retries pace the rest)."""
    if root_certificates is None:
        return grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
    creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return grpc.secure_channel(address, creds, options=_CHANNEL_OPTIONS)


class Client:
    """Iterates ``(step, batch)`` for rank ``rank`` of ``world_size``, from ``start_step`` on.

    ``batch`` maps field names to numpy arrays (torch tensors with ``as_torch=True``) viewing
    the received bytes without a copy; treat them as read-only. Iteration ends when the
    server's data ends. The steps handed out are acknowledged to the server (``Ack``, from a
    background thread, coalesced) every ``max(1, ahead // 2)`` steps, ``ahead`` being what
    the server says in its messages (every step if it does not say), and always before
    ``checkpoint()`` and at ``close()``: the server holds steps and sends ahead counting from
    acknowledged steps, so ``checkpoint()`` at the step a trainer is at finds it held. A
    dropped connection (``UNAVAILABLE``) or a full server (``RESOURCE_EXHAUSTED``) is retried
    from ``next_step`` with exponential backoff (``retries`` tries from ``backoff`` seconds,
    doubling, at most ``max_backoff``), and so is a stream the server dropped as idle or
    replaced (``CANCELLED``, ``ABORTED``); any other refusal raises ``zf.ServiceError`` with the
    server's message (a failed pipeline: ``INTERNAL``, naming the error). A token is stripped
    of surrounding whitespace (a trailing newline). ``fingerprint``
    (``spec.fingerprint`` or its ``"total"``) makes the server check that it serves that
    pipeline; ``token`` defaults to ``$ZEPHON_TOKEN``; ``root_certificates``
    (PEM bytes) switches to TLS. ``lane_owners=True`` reads from ``zephon serve --ray
    --lane-owners N`` (``address`` is its coordinator): this rank's rows come straight from the
    owners of its lanes, merged in lane order (token and TLS as with ``zephon serve``; a lost
    owner is replaced; an owner that does not send a step within ``timeout`` raises).
    ``clock`` paces the retries (tests pass a ``ManualClock``).
    """

    def __init__(
        self,
        address: str,
        rank: int,
        world_size: int,
        start_step: int = 0,
        as_torch: bool = False,
        *,
        fingerprint: str | Mapping[str, str] | None = None,
        token: str | None = None,
        root_certificates: bytes | None = None,
        retries: int = 8,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
        timeout: float = 300.0,
        lane_owners: bool = False,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        TopologyOptions(rank=rank, world_size=world_size, owner="Client")
        check_int(start_step, "start_step", low=0, owner="Client")
        check_seconds(timeout, "timeout", owner="Client")
        self._retry = Backoff(retries=retries, initial=backoff, maximum=max_backoff)
        self.address, self.rank, self.world_size = address, rank, world_size
        self.as_torch = as_torch
        self._fingerprint = _fingerprint(fingerprint)
        token = auth.clean_token(token, "Client") if token is not None else auth.env_token("Client")
        self._metadata = auth.bearer(token) if token else ()
        self._tls = root_certificates is not None
        self._root_certificates = root_certificates
        self._timeout = timeout
        self._clock = clock
        self._next_step = start_step
        self._acked = start_step  # the server knows the rank has taken every step before this
        self._channel = _open_channel(address, root_certificates)
        self._stream = self._channel.unary_stream(
            _METHOD + "StreamBatches", request_serializer=pb.StreamBatchesRequest.SerializeToString
        )
        self._ack = self._method("Ack", pb.AckRequest, pb.AckReply)
        self._checkpoint = self._method("Checkpoint", pb.CheckpointRequest, pb.CheckpointReply)
        self._status = self._method("Status", pb.StatusRequest, pb.StatusReply)
        self._acker: _Acker | None = None
        self._closed = False
        # The iterators handed out, finished by close(): one left suspended until the
        # interpreter exits would run its cleanup against half torn-down modules.
        self._iterators: weakref.WeakSet[Generator[tuple[int, Any], None, None]] = weakref.WeakSet()
        _OPEN.add(self)
        self._fan_in = self._owners_fan_in() if lane_owners else None

    def _owners_fan_in(self) -> OwnerFanIn:
        """For ``lane_owners=True``: ``address`` is the coordinator of ``zephon serve --ray
        --lane-owners N``; the rows come from the owners of this rank's lanes (fanin.py)."""
        return OwnerFanIn(
            self.address,
            rank=self.rank,
            world_size=self.world_size,
            fingerprint=self._fingerprint,
            metadata=self._metadata,
            channel_options=_CHANNEL_OPTIONS,
            timeout=self._timeout,
            retry=self._retry,
            root_certificates=self._root_certificates,
            clock=self._clock,
        )

    def _method(self, method: str, request: Any, reply: Any) -> grpc.UnaryUnaryMultiCallable:
        """The callable for the service's unary ``method``."""
        return unary_call(self._channel, _METHOD + method, request, reply)

    @property
    def next_step(self) -> int:
        """The step the next batch will have (where a reconnect or a checkpoint starts)."""
        return self._next_step

    def _sleep_or_raise(
        self, attempt: int, exc: grpc.RpcError, what: str, retry: frozenset[grpc.StatusCode] = _RETRY
    ) -> None:
        code = exc.code()
        if code not in retry or self._retry.last(attempt):
            tries = f" {self._retry.gave_up(attempt)}" if code in retry else ""
            raise ServiceError(
                f"{what} from {self.address} failed{tries}: {code.name}: {exc.details()}{self._hint(exc)}",
                code=code.name,
            ) from None
        self._retry.pause(attempt, self._clock)

    def _hint(self, exc: grpc.RpcError) -> str:
        """What a bare transport error most likely means, for the message."""
        details = str(exc.details() or "").lower()
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            return ""
        if not self._tls and ("socket closed" in details or "connection reset" in details):
            return (
                " (if the server uses TLS (zephon serve --tls-cert), this plaintext client cannot "
                "talk to it: pass Client(root_certificates=<the server's CA certificate, PEM bytes>))"
            )
        if self._tls and ("ssl" in details or "handshake" in details or "tls" in details):
            return (
                " (the TLS handshake failed: the server may serve plaintext (no --tls-cert), or its "
                "certificate is not signed by root_certificates or does not name this address)"
            )
        return ""

    def _send_ack(self, step: int, timeout: float | None = None) -> None:
        request = pb.AckRequest(
            fingerprint=self._fingerprint, rank=self.rank, world_size=self.world_size, step=step
        )
        self._ack(request, metadata=self._metadata, timeout=self._timeout if timeout is None else timeout)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if self._closed:
            raise ServiceError("this Client is closed")
        batches = self._batches()
        self._iterators.add(batches)
        return batches

    def _batches(self) -> Generator[tuple[int, Any], None, None]:
        if self._fan_in is not None:
            for step, batch in self._fan_in.batches(self._next_step, self.as_torch):
                self._next_step = step + 1
                yield step, batch
            return
        if self._acker is None:
            self._acker = _Acker(self._send_ack)
        acker = self._acker
        attempt = 0
        while True:
            request = pb.StreamBatchesRequest(
                fingerprint=self._fingerprint,
                rank=self.rank,
                world_size=self.world_size,
                start_step=self._next_step,
            )
            call = self._stream(request, metadata=self._metadata)
            assembler = StepAssembler(as_torch=self.as_torch)
            self._acked = self._next_step  # the stream starts the rank's position there
            try:
                for raw in call:
                    got = assembler.feed(raw)
                    if got is None:
                        continue
                    step, batch = got
                    if step != self._next_step:
                        raise ServiceError(
                            f"expected step {self._next_step} from {self.address}, got step {step}"
                        )
                    if acker.error is not None:
                        raise acker.error
                    self._next_step = step + 1
                    attempt = 0
                    # Within ``ahead``: the stream never waits for an acknowledgement not sent.
                    if self._next_step - self._acked >= max(1, assembler.ahead // 2):
                        self._acked = self._next_step
                        acker.ack(self._next_step)
                    yield step, batch
                return
            except GeneratorExit:  # closed: nothing to retry (and grpc may be torn down at exit)
                raise
            except grpc.RpcError as exc:
                if self._closed:  # closed from another thread: the call was cancelled by us
                    return
                self._sleep_or_raise(
                    attempt, exc, f"rank {self.rank}'s stream at step {self._next_step}", _STREAM_RETRY
                )
                attempt += 1
            finally:
                call.cancel()

    def _unary(self, method: Any, request: Any, what: str) -> Any:
        """Calls ``method`` with retries as the class says; ``what`` names it in errors."""
        attempt = 0
        while True:
            try:
                return method(request, metadata=self._metadata, timeout=self._timeout)
            except grpc.RpcError as exc:
                self._sleep_or_raise(attempt, exc, what)
                attempt += 1

    def checkpoint(self, step: int | None = None) -> str:
        """Has the server write the state from which ``step`` (default ``next_step``) is the
        next batch; returns the checkpoint's path on the server (``zephon serve --resume``)."""
        step = self._next_step if step is None else step
        if not isinstance(step, int) or step < 0:
            raise SpecError(f"Client.checkpoint: step must be an integer >= 0, got {step!r}")
        if self._fan_in is not None:
            return self._fan_in.checkpoint(step)
        self._flush_acks(self._timeout)
        request = pb.CheckpointRequest(step=step, fingerprint=self._fingerprint)
        reply = self._unary(self._checkpoint, request, f"checkpoint at step {step}")
        return str(reply.path)

    def status(self) -> dict[str, Any]:
        """The server's status: produced step, held steps, lanes' progress, ranks, throughput."""
        reply = self._unary(self._status, pb.StatusRequest(), "status")
        return dict(_plain(reply))

    def _flush_acks(self, timeout: float) -> None:
        """Acknowledges, now and synchronously, every step handed out unless the server has
        confirmed it. Best effort: a lost or refused acknowledgement only keeps more held."""
        acker, step = self._acker, self._next_step
        if acker is None or acker.done >= step:
            return
        try:
            self._send_ack(step, timeout)
        except (grpc.RpcError, ValueError):
            return
        acker.confirmed(step)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _OPEN.discard(self)
            for batches in list(self._iterators):
                with contextlib.suppress(ValueError):  # running in another thread: it sees _closed
                    batches.close()
            if self._fan_in is not None:
                self._fan_in.close()
            if self._acker is not None:
                self._acker.close()
                self._flush_acks(timeout=5.0)
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
