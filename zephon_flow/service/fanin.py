"""Fan-in from lane owners: one rank's rows streamed from the owners of its lanes, merged in lane order.

Used by ``zf.Client(address, ..., lane_owners=True)`` against ``zephon serve --ray
--lane-owners N``: ``address`` is the coordinator's, which answers the owner table; each owner
streams this rank its share of every step over one long ``StreamRows`` call, a few steps past
the step the rank acknowledges on the same call, and the shares, concatenated in lane order,
are exactly the rank's slice. An owner whose stream breaks is reported to the
coordinator (``Replace``), which starts a replacement from its lanes' last snapshot; the stream
is reopened there at the step this rank is at, so nothing is lost or repeated.

Every call has a deadline (``Client(timeout=)``): an owner that does not send a step in time
(a peer rank reading the same lanes has stopped, so the owner runs no further) ends the
iteration with a ``ServiceError`` naming the step and the owner. A full owner
(``RESOURCE_EXHAUSTED``) is retried with the client's backoff. ``close()`` from another thread
ends a blocked iteration cleanly.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock, wait_for_arrival
from zephon_flow.core.errors import ServiceError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.core.retry import Backoff
from zephon_flow.engine.owned import PROGRESS_EVERY, owned_batches
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service._proto import lane_owners_pb2 as lo
from zephon_flow.service.rpc import unary_call
from zephon_flow.service.wire import StepAssembler, to_torch

_METHOD = "/zephon.v1.LaneOwners/"
#: A broken owner stream: the owner (or its node) is gone; the coordinator replaces it.
_OWNER_LOST = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN}
)
#: Worth another try after a pause, without reporting the owner: it has no room for the call now.
_BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED
#: The initial metadata by which an owner says it takes acknowledgements on its ``StreamRows``.
ACKS_METADATA = "zephon-rows-acks"


class _Closed(Exception):
    """The fan-in was closed (from another thread) while a call was under way."""


def open_channel(
    address: str, root_certificates: bytes | None, options: list[tuple[str, Any]]
) -> grpc.Channel:
    """A channel to ``address``: TLS with ``root_certificates`` (PEM bytes), else plaintext."""
    if root_certificates is None:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return grpc.secure_channel(address, creds, options=options)


@dataclass(frozen=True)
class _Owner:
    index: int
    lanes: tuple[int, ...]
    address: str
    generation: int


class _DeadlineExceeded(grpc.RpcError):  # type: ignore[misc]
    """No step came from an owner's stream within the client's timeout."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "no step within the client's timeout"


class _OwnerStream:
    """One owner's shares for this rank over one long ``StreamRows`` call: the owner sends up
    to ``prefetch`` steps past the step the rank needs next, which the rank acknowledges on the
    call's request stream as it goes (so the owner knows which steps the rank has taken and
    runs a bounded distance past them). A thread reads the call; each step is waited for at
    most the client's timeout. An owner that does not take acknowledgements (its initial
    metadata lacks ``ACKS_METADATA``) is read one call per step from its second step on. The
    wait for a step's message has its deadline on the fan-in's clock (``wait_for_arrival``)."""

    def __init__(self, fan: OwnerFanIn, owner: _Owner, step: int, prefetch: int) -> None:
        self.owner, self._fan, self._prefetch = owner, fan, prefetch
        self._channel = open_channel(owner.address, fan.root_certificates, fan.channel_options)
        method = self._channel.stream_stream(
            _METHOD + "StreamRows", request_serializer=lo.RowsRequest.SerializeToString
        )
        first = lo.RowsRequest(
            fingerprint=fan.fingerprint,
            rank=fan.rank,
            world_size=fan.world_size,
            start_step=step,
            window=prefetch,
        )
        self._acks: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        # What the reading thread got, in order: steps, then the call's end (None) or error.
        self._got: deque[tuple[int, dict[str, Any]] | BaseException | None] = deque()
        self._arrived = threading.Condition()
        self._call = method(self._requests(first), metadata=fan.metadata)
        self._next, self._first = step, step
        self._steps_by_call: _StepCalls | None = None
        self._reader = threading.Thread(target=self._read, name="zephon-owner-rows", daemon=True)
        self._reader.start()

    def _requests(self, first: lo.RowsRequest) -> Iterator[lo.RowsRequest]:
        yield first
        while (taken := self._acks.get()) is not None:
            yield lo.RowsRequest(taken=taken)

    def _put(self, got: tuple[int, dict[str, Any]] | BaseException | None) -> None:
        with self._arrived:
            self._got.append(got)
            self._arrived.notify_all()

    def _read(self) -> None:
        assembler = StepAssembler()
        try:
            for raw in self._call:
                got = assembler.feed(raw)
                if got is not None:
                    self._put(got)
            self._put(None)
        except BaseException as exc:  # handed to the reader of the steps, in order
            self._put(exc)

    def _take(self) -> tuple[int, dict[str, Any]] | BaseException | None:
        """What the call brought next, waited for up to the client's timeout on its clock."""
        fan = self._fan
        with self._arrived:
            if not wait_for_arrival(fan.clock, self._arrived, lambda: bool(self._got), fan.timeout):
                raise _DeadlineExceeded
            return self._got.popleft()

    def next(self, step: int) -> dict[str, Any]:
        if self._steps_by_call is not None:
            return self._steps_by_call.next(step)
        if step != self._next:
            raise ServiceError(
                f"rank {self._fan.rank} asked lane owner {self.owner.index} for step {step}, expected {self._next}"
            )
        if step != self._first:
            self._acks.put(step)
        got = self._take()
        if isinstance(got, BaseException):
            raise got
        if got is None:
            raise ServiceError(
                f"lane owner {self.owner.index} at {self.owner.address} sent nothing for step {step}"
            )
        if got[0] != step:
            raise ServiceError(
                f"lane owner {self.owner.index} at {self.owner.address} sent step {got[0]}, expected {step}"
            )
        self._next += 1
        if step == self._first and ACKS_METADATA not in dict(self._call.initial_metadata() or ()):
            self._end_call()  # an owner of the former protocol: a call per step from here
            self._steps_by_call = _StepCalls(self._fan, self.owner, step + 1, self._prefetch, self._channel)
        return got[1]

    def _end_call(self) -> None:
        self._acks.put(None)
        self._call.cancel()

    def close(self) -> None:
        self._end_call()
        self._put(_Closed())
        if self._steps_by_call is not None:
            self._steps_by_call.close()
        self._channel.close()


class _StepCalls:
    """One owner's shares for this rank, asked ``prefetch`` steps ahead, one call per step (so
    the owner knows which steps the rank has taken and runs a bounded distance past them): how
    an owner that takes no acknowledgements on its stream is read."""

    def __init__(
        self, fan: OwnerFanIn, owner: _Owner, step: int, prefetch: int, channel: grpc.Channel
    ) -> None:
        self.owner, self._fan, self._prefetch = owner, fan, prefetch
        self._channel = channel
        self._method = self._channel.unary_stream(
            _METHOD + "StreamRows", request_serializer=lo.RowsRequest.SerializeToString
        )
        self._calls: deque[tuple[int, float, Any]] = deque()
        self._asked = step

    def _call(self, step: int) -> Any:
        fan = self._fan
        request = lo.RowsRequest(
            fingerprint=fan.fingerprint,
            rank=fan.rank,
            world_size=fan.world_size,
            start_step=step,
            stop_step=step + 1,
        )
        return self._method(request, metadata=fan.metadata, timeout=fan.timeout)

    def _ask(self) -> None:
        self._calls.append((self._asked, self._fan.clock.now(), self._call(self._asked)))
        self._asked += 1

    def next(self, step: int) -> dict[str, Any]:
        while len(self._calls) < self._prefetch:
            self._ask()
        asked, since, call = self._calls.popleft()
        if asked != step:
            raise ServiceError(
                f"rank {self._fan.rank} asked lane owner {self.owner.index} for step {asked}, expected {step}"
            )
        waiting = self._fan.clock.now()
        try:
            return self._read(call, step)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or waiting - since < 0.5:
                raise
        # Asked ahead, its deadline ran partly while this rank was busy: one full wait more.
        return self._read(self._call(step), step)

    def _read(self, call: Any, step: int) -> dict[str, Any]:
        assembler = StepAssembler()
        for raw in call:
            got = assembler.feed(raw)
            if got is None:
                continue
            if got[0] != step:
                raise ServiceError(
                    f"lane owner {self.owner.index} at {self.owner.address} sent step {got[0]}, expected {step}"
                )
            return got[1]
        raise ServiceError(
            f"lane owner {self.owner.index} at {self.owner.address} sent nothing for step {step}"
        )

    def close(self) -> None:
        for _, _, call in self._calls:
            call.cancel()
        self._calls.clear()


class OwnerFanIn:
    """Rank ``rank`` of ``world_size``'s batches from the lane owners behind the coordinator at
    ``address``; ``Client`` passes its fingerprint, metadata, channel options, retry policy and
    clock (what every pause and the streams' waits read)."""

    def __init__(
        self,
        address: str,
        *,
        rank: int,
        world_size: int,
        fingerprint: str,
        metadata: Sequence[tuple[str, str]],
        channel_options: list[tuple[str, Any]],
        timeout: float,
        retry: Backoff,
        root_certificates: bytes | None = None,
        clock: Clock = SYSTEM_CLOCK,
        progress_every: int = PROGRESS_EVERY,
        prefetch: int = 4,
    ) -> None:
        self.address, self.rank, self.world_size = address, rank, world_size
        self.fingerprint, self.metadata, self.channel_options = fingerprint, tuple(metadata), channel_options
        self.root_certificates, self.timeout = root_certificates, timeout
        self._timeout, self._retry = timeout, retry
        self.clock = clock
        self._progress_every, self._prefetch = progress_every, prefetch
        self._closed = False
        self._lock = threading.Lock()
        self._channel = open_channel(address, root_certificates, channel_options)
        self._table_call = unary_call(self._channel, _METHOD + "Table", lo.TableRequest, lo.TableReply)
        self._replace_call = unary_call(self._channel, _METHOD + "Replace", lo.ReplaceRequest, lo.TableReply)
        self._progress_call = unary_call(self._channel, _METHOD + "Progress", pb.AckRequest, pb.AckReply)
        self._checkpoint_call = unary_call(
            self._channel, _METHOD + "Checkpoint", pb.CheckpointRequest, pb.CheckpointReply
        )
        self._streams: dict[int, _OwnerStream] = {}
        self._current: dict[int, _Owner] = {}  # each owner of the rank's lanes, as last replaced
        self._reply: lo.TableReply | None = None

    # -- the table -----------------------------------------------------------------------------
    def _unary(self, call: Any, request: Any, what: str, where: str | None = None) -> Any:
        for attempt in range(self._retry.retries + 1):
            try:
                return call(request, metadata=self.metadata, timeout=self._timeout)
            except grpc.RpcError as exc:
                if self._closed:
                    raise _Closed from None
                retried = exc.code() in (grpc.StatusCode.UNAVAILABLE, _BUSY)
                if not retried or self._retry.last(attempt):
                    tries = f" {self._retry.gave_up(attempt)}" if retried else ""
                    raise ServiceError(
                        f"{what} from {where or f'the lane owners coordinator at {self.address}'} failed"
                        f"{tries}: {exc.code().name}: {exc.details()}",
                        code=exc.code().name,
                    ) from None
                self._retry.pause(attempt, self.clock)
        raise AssertionError("unreachable")

    def _owners(self, reply: lo.TableReply) -> list[_Owner]:
        """The owners of this rank's lanes, in lane order."""
        rs = RankSlice(
            rank=self.rank,
            world_size=self.world_size,
            lanes=int(reply.lanes),
            global_batch_size=int(reply.global_batch_size),
        )
        wanted = set(rs.lane_ids)
        return [
            _Owner(i, tuple(int(x) for x in entry.lanes), entry.address, int(entry.generation))
            for i, entry in enumerate(reply.owners)
            if wanted.intersection(entry.lanes)
        ]

    def table(self) -> lo.TableReply:
        if self._reply is None:
            self._reply = self._unary(
                self._table_call, lo.TableRequest(fingerprint=self.fingerprint, rank=self.rank), "the table"
            )
        return self._reply

    def _replace(self, owner: _Owner, step: int, exc: grpc.RpcError) -> _Owner:
        """Reports ``owner`` dead; returns its replacement (the coordinator makes one once; an
        owner that still answers is kept, and the same owner is returned)."""
        request = lo.ReplaceRequest(owner=owner.index, generation=owner.generation, rank=self.rank)
        try:  # retried while the coordinator is unavailable (restarting), as every unary call
            self._reply = self._unary(self._replace_call, request, f"Replace(owner={owner.index})")
        except ServiceError as err:
            raise ServiceError(
                f"rank {self.rank} lost lane owner {owner.index} (lanes {list(owner.lanes)}) at step "
                f"{step} ({exc.code().name}: {exc.details()}), and the coordinator could not replace it: "
                f"{err}",
                code=err.code,
            ) from None
        return next(o for o in self._owners(self._reply) if o.index == owner.index)

    # -- batches -------------------------------------------------------------------------------
    def _share(self, owner: _Owner, step: int) -> tuple[_Owner, dict[str, Any]]:
        """``owner``'s share of step ``step``, replacing the owner (and retrying) if it is lost."""
        for attempt in range(self._retry.retries + 1):
            with self._lock:
                if self._closed:
                    raise _Closed
                stream = self._streams.get(owner.index)
                if stream is None or stream.owner != owner:
                    stream = self._streams[owner.index] = _OwnerStream(self, owner, step, self._prefetch)
            try:
                return owner, stream.next(step)
            except ValueError:  # grpc: the channel was closed under the call
                if self._closed:
                    raise _Closed from None
                raise
            except grpc.RpcError as exc:
                stream.close()
                with self._lock:
                    if self._closed:
                        raise _Closed from None
                    if self._streams.get(owner.index) is stream:
                        del self._streams[owner.index]
                code = exc.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise ServiceError(
                        f"rank {self.rank} waited more than {self._timeout:g} s (Client(timeout=)) for "
                        f"step {step} from lane owner {owner.index} (lanes {list(owner.lanes)}) at "
                        f"{owner.address}: another rank reading those lanes has stopped taking steps (an "
                        f"owner runs only a few steps past its slowest reader), or the owner is stuck",
                        code=code.name,
                    ) from None
                if (code not in _OWNER_LOST and code != _BUSY) or self._retry.last(attempt):
                    raise ServiceError(
                        f"rank {self.rank}'s rows of step {step} from lane owner {owner.index} (lanes "
                        f"{list(owner.lanes)}) at {owner.address} failed: {code.name}: {exc.details()}",
                        code=code.name,
                    ) from None
                self._retry.pause(attempt, self.clock)
                if code != _BUSY:
                    owner = self._replace(owner, step, exc)
        raise AssertionError("unreachable")

    def _lives(self, step: int) -> Iterator[bool]:
        """Each owner's answer to whether its lanes have a real sample at ``step``."""
        reply = self.table()
        for entry in reply.owners:
            with open_channel(entry.address, self.root_certificates, self.channel_options) as channel:
                call = unary_call(channel, _METHOD + "Live", lo.LiveRequest, lo.LiveReply)
                where = f"lane owner at {entry.address}"
                yield bool(self._unary(call, lo.LiveRequest(step=step), f"Live(step={step})", where).live)

    def batches(self, start_step: int, as_torch: bool) -> Iterator[tuple[int, Any]]:
        """This rank's batches from ``start_step``; ends when the data ends or at ``close()``."""
        try:
            yield from self._batches(start_step, as_torch)
        except _Closed:
            return

    def _batches(self, start_step: int, as_torch: bool) -> Iterator[tuple[int, Any]]:
        """The engine's reader of lane owners (``engine/owned.py``), this object its carrier:
        the shares come over one gRPC stream per owner."""
        owners = self._owners(self.table())
        self._current = {owner.index: owner for owner in owners}
        finite = bool(self.table().finite)
        for step, batch in owned_batches(self, list(self._current), start_step, finite=finite):
            yield step, to_torch(batch) if as_torch else batch

    # -- the engine's carrier (engine/owned.py) ----------------------------------------------
    def share(self, owner: int, step: int) -> dict[str, Any]:
        """This rank's rows of ``step`` from owner ``owner`` (replaced if it is lost)."""
        got, part = self._share(self._current[owner], step)
        self._current[owner] = got
        return part

    def lives(self, step: int) -> Iterator[bool]:
        return self._lives(step)

    def taken(self, step: int) -> None:
        if step % self._progress_every == 0:
            self._report(step)

    def _report(self, step: int) -> None:
        """Best effort: tells the coordinator this rank has taken every step before ``step``."""
        request = pb.AckRequest(
            fingerprint=self.fingerprint, rank=self.rank, world_size=self.world_size, step=step
        )
        try:
            self._progress_call(request, metadata=self.metadata, timeout=self._timeout)
        except grpc.RpcError:
            return

    def checkpoint(self, step: int) -> str:
        reply = self._unary(
            self._checkpoint_call,
            pb.CheckpointRequest(step=step, fingerprint=self.fingerprint),
            f"checkpoint at step {step}",
        )
        return str(reply.path)

    def close(self) -> None:
        """Ends every call; an iteration blocked in another thread ends cleanly."""
        with self._lock:
            self._closed = True
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()
        self._channel.close()
