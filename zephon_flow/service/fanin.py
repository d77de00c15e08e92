"""Fan-in from lane owners: one rank's rows streamed from the owners of its lanes, merged in lane order.

Used by ``zf.Client(address, ..., lane_owners=True)`` against ``zephon serve --ray
--lane-owners N``: ``address`` is the coordinator's, which answers the owner table; each owner
streams this rank its share of every step (``StreamRows``), and the shares, concatenated in
lane order, are exactly the rank's slice. An owner whose stream breaks is reported to the
coordinator (``Replace``), which starts a replacement from its lanes' last snapshot; the stream
is reopened there at the step this rank is at, so nothing is lost or repeated.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from zephon_flow.core.batches import VALID_FIELD
from zephon_flow.core.errors import ServiceError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service._proto import lane_owners_pb2 as lo
from zephon_flow.service.rpc import unary_call
from zephon_flow.service.wire import StepAssembler, to_torch

_METHOD = "/zephon.v1.LaneOwners/"
#: A broken owner stream: the owner (or its node) is gone; the coordinator replaces it.
_OWNER_LOST = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN}
)


@dataclass(frozen=True)
class _Owner:
    index: int
    lanes: tuple[int, ...]
    address: str
    generation: int


class _OwnerStream:
    """One owner's shares for this rank, asked ``prefetch`` steps ahead, one call per step (so
    the owner knows which steps the rank has taken and runs a bounded distance past them)."""

    def __init__(self, fan: OwnerFanIn, owner: _Owner, step: int, prefetch: int) -> None:
        self.owner, self._fan, self._prefetch = owner, fan, prefetch
        self._channel = grpc.insecure_channel(owner.address, options=fan.channel_options)
        self._method = self._channel.unary_stream(
            _METHOD + "StreamRows", request_serializer=lo.RowsRequest.SerializeToString
        )
        self._calls: deque[tuple[int, Any]] = deque()
        self._asked = step

    def _ask(self) -> None:
        fan = self._fan
        request = lo.RowsRequest(
            fingerprint=fan.fingerprint,
            rank=fan.rank,
            world_size=fan.world_size,
            start_step=self._asked,
            stop_step=self._asked + 1,
        )
        self._calls.append((self._asked, self._method(request, metadata=fan.metadata)))
        self._asked += 1

    def next(self, step: int) -> dict[str, Any]:
        while len(self._calls) < self._prefetch:
            self._ask()
        asked, call = self._calls.popleft()
        if asked != step:
            raise ServiceError(
                f"rank {self._fan.rank} asked lane owner {self.owner.index} for step {asked}, expected {step}"
            )
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
        for _, call in self._calls:
            call.cancel()
        self._calls.clear()
        self._channel.close()


class OwnerFanIn:
    """Rank ``rank`` of ``world_size``'s batches from the lane owners behind the coordinator at
    ``address``; ``Client`` passes its fingerprint, metadata, channel options and retry policy."""

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
        retries: int,
        backoff: float,
        progress_every: int = 8,
        prefetch: int = 4,
    ) -> None:
        self.address, self.rank, self.world_size = address, rank, world_size
        self.fingerprint, self.metadata, self.channel_options = fingerprint, tuple(metadata), channel_options
        self._timeout, self._retries, self._backoff = timeout, retries, backoff
        self._progress_every, self._prefetch = progress_every, prefetch
        self._channel = grpc.insecure_channel(address, options=channel_options)
        self._table_call = unary_call(self._channel, _METHOD + "Table", lo.TableRequest, lo.TableReply)
        self._replace_call = unary_call(self._channel, _METHOD + "Replace", lo.ReplaceRequest, lo.TableReply)
        self._progress_call = unary_call(self._channel, _METHOD + "Progress", pb.AckRequest, pb.AckReply)
        self._checkpoint_call = unary_call(
            self._channel, _METHOD + "Checkpoint", pb.CheckpointRequest, pb.CheckpointReply
        )
        self._streams: dict[int, _OwnerStream] = {}
        self._reply: lo.TableReply | None = None

    # -- the table -----------------------------------------------------------------------------
    def _unary(self, call: Any, request: Any, what: str) -> Any:
        for attempt in range(self._retries + 1):
            try:
                return call(request, metadata=self.metadata, timeout=self._timeout)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == self._retries:
                    raise ServiceError(
                        f"{what} from the lane owners' coordinator at {self.address} failed: "
                        f"{exc.code().name}: {exc.details()}",
                        code=exc.code().name,
                    ) from None
                time.sleep(min(5.0, self._backoff * 2**attempt))
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
                self._table_call, lo.TableRequest(fingerprint=self.fingerprint), "the table"
            )
        return self._reply

    def _replace(self, owner: _Owner, step: int, exc: grpc.RpcError) -> _Owner:
        """Reports ``owner`` dead; returns its replacement (the coordinator makes one once)."""
        try:
            self._reply = self._replace_call(
                lo.ReplaceRequest(owner=owner.index, generation=owner.generation),
                metadata=self.metadata,
                timeout=self._timeout,
            )
        except grpc.RpcError as err:
            raise ServiceError(
                f"rank {self.rank} lost lane owner {owner.index} (lanes {list(owner.lanes)}) at step "
                f"{step} ({exc.code().name}: {exc.details()}), and the coordinator could not replace it: "
                f"{err.details()}",
                code=err.code().name,
            ) from None
        return next(o for o in self._owners(self._reply) if o.index == owner.index)

    # -- batches -------------------------------------------------------------------------------
    def _share(self, owner: _Owner, step: int) -> tuple[_Owner, dict[str, Any]]:
        """``owner``'s share of step ``step``, replacing the owner (and retrying) if it is lost."""
        for attempt in range(self._retries + 1):
            stream = self._streams.get(owner.index)
            if stream is None or stream.owner != owner:
                stream = self._streams[owner.index] = _OwnerStream(self, owner, step, self._prefetch)
            try:
                return owner, stream.next(step)
            except grpc.RpcError as exc:
                stream.close()
                del self._streams[owner.index]
                if exc.code() not in _OWNER_LOST or attempt == self._retries:
                    raise ServiceError(
                        f"rank {self.rank}'s rows of step {step} from lane owner {owner.index} (lanes "
                        f"{list(owner.lanes)}) at {owner.address} failed: {exc.code().name}: {exc.details()}",
                        code=exc.code().name,
                    ) from None
                time.sleep(min(5.0, self._backoff * 2**attempt))
                owner = self._replace(owner, step, exc)
        raise AssertionError("unreachable")

    def _live(self, step: int) -> bool:
        """Whether any owner's lanes have a real sample at ``step`` (a finite pass goes on)."""
        reply = self.table()
        for entry in reply.owners:
            with grpc.insecure_channel(entry.address, options=self.channel_options) as channel:
                call = unary_call(channel, _METHOD + "Live", lo.LiveRequest, lo.LiveReply)
                if call(lo.LiveRequest(step=step), metadata=self.metadata, timeout=self._timeout).live:
                    return True
        return False

    def batches(self, start_step: int, as_torch: bool) -> Iterator[tuple[int, Any]]:
        owners = self._owners(self.table())
        finite = bool(self.table().finite)
        step = start_step
        while True:
            shares = [self._share(o, step) for o in owners]
            owners = [o for o, _ in shares]
            parts = [part for _, part in shares]
            if finite and not any(bool(np.any(p[VALID_FIELD])) for p in parts) and not self._live(step):
                return
            batch = (
                parts[0] if len(parts) == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
            )
            step += 1
            if step % self._progress_every == 0:
                self._report(step)
            yield step - 1, to_torch(batch) if as_torch else batch

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
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._channel.close()
