"""The LaneOwners gRPC service: each owner streams ranks their rows; the coordinator, its table.

An owner's ``StreamRows`` sends rank ``r`` of ``W``, step by step, the rows of ``r``'s slice
that lie on the owner's lanes, as the batch service's ``BatchChunk`` messages (``wire``); the
client concatenates the owners' shares in lane order (``zephon_flow.service.fanin``). The
coordinator's endpoint (in the ``zephon serve --ray`` process) answers ``Table``, ``Replace``
and ``Checkpoint`` by asking the coordinator actor. Nothing here holds a batch for long.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent import futures
from typing import Any, NoReturn

import grpc

from zephon_flow.cluster.coordinator import OwnerTable
from zephon_flow.cluster.owner import LaneOwner, OwnerError, share_of
from zephon_flow.core.errors import SpecError, ZephonError
from zephon_flow.core.lanes import RankSlice
from zephon_flow.core.state import save_state
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service._proto import lane_owners_pb2 as lo
from zephon_flow.service.rpc import unary_handler
from zephon_flow.service.wire import MAX_MESSAGE_BYTES, encode_step

SERVICE = "zephon.v1.LaneOwners"
#: How long one wait for a step lasts before the stream checks that its client is still there.
POLL = 1.0


def _abort(context: grpc.ServicerContext, code: str, message: str) -> NoReturn:
    context.abort(getattr(grpc.StatusCode, code), message)
    raise AssertionError("grpc's abort returned")


def _server(host: str, port: int, handlers: dict[str, Any], max_streams: int) -> tuple[grpc.Server, int]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_streams + 4, thread_name_prefix="zephon-owners"),
        handlers=[grpc.method_handlers_generic_handler(SERVICE, handlers)],
        maximum_concurrent_rpcs=max_streams,
        options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)],
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise ZephonError(f"lane owners: cannot listen on {host}:{port} (in use?)")
    server.start()
    return server, bound


class OwnerServer:
    """Serves one ``LaneOwner``'s rows over gRPC on ``host`` (port 0: any free one)."""

    def __init__(
        self, owner: LaneOwner, *, host: str = "127.0.0.1", port: int = 0, max_streams: int = 256
    ) -> None:
        self._owner = owner
        self._fingerprint = owner.spec.fingerprint["total"]
        self._server, bound = _server(
            host,
            port,
            {
                "StreamRows": grpc.unary_stream_rpc_method_handler(
                    self._stream, request_deserializer=lo.RowsRequest.FromString
                ),
                "Live": unary_handler(self._live, lo.LiveRequest, lo.LiveReply),
            },
            max_streams,
        )
        self.address = f"{host}:{bound}"

    def _stream(self, request: lo.RowsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        owner = self._owner
        if request.fingerprint and request.fingerprint != self._fingerprint:
            _abort(
                context,
                "FAILED_PRECONDITION",
                f"the client was built for pipeline fingerprint {request.fingerprint}, but this lane "
                f"owner runs fingerprint {self._fingerprint}",
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
        step, stop = int(request.start_step), int(request.stop_step) or None
        while context.is_active() and (stop is None or step < stop):
            try:
                part = owner.share(rs, step, timeout=POLL)
            except OwnerError as exc:
                _abort(context, "INTERNAL", str(exc))
            if part is None:
                continue
            yield from encode_step(step, part, ahead=owner.options.ahead)
            step += 1

    def _live(self, request: lo.LiveRequest, context: grpc.ServicerContext) -> lo.LiveReply:
        while context.is_active():
            try:
                live = self._owner.live(int(request.step), timeout=POLL)
            except OwnerError as exc:
                _abort(context, "INTERNAL", str(exc))
            if live is not None:
                return lo.LiveReply(live=live)
        _abort(context, "CANCELLED", "the client went away")

    def stop(self) -> None:
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
    (written to ``checkpoint_dir`` as ``step-<step>.zfstate``), answered by ``coordinator`` (a
    Ray actor handle of ``actors.CoordinatorActor``) for ranks of ``world_size``."""

    def __init__(
        self,
        spec: LoaderSpec,
        coordinator: Any,
        *,
        world_size: int,
        host: str = "127.0.0.1",
        port: int = 0,
        checkpoint_dir: str | None = None,
    ) -> None:
        from zephon_flow.runners.ray_env import require_ray

        self._ray = require_ray("zephon serve --ray")
        self.spec, self._coordinator, self._checkpoint_dir = spec, coordinator, checkpoint_dir
        self.fingerprint = spec.fingerprint["total"]
        self.world_size = world_size
        self._server, self.port = _server(
            host,
            port,
            {
                "Table": unary_handler(self._table, lo.TableRequest, lo.TableReply),
                "Replace": unary_handler(self._replace, lo.ReplaceRequest, lo.TableReply),
                "Checkpoint": unary_handler(self._checkpoint, pb.CheckpointRequest, pb.CheckpointReply),
                "Progress": unary_handler(self._progress, pb.AckRequest, pb.AckReply),
            },
            64,
        )
        self.host = host

    def _reply(self, ref: Any, context: grpc.ServicerContext) -> lo.TableReply:
        try:
            table, addresses = self._ray.get(ref)
        except self._ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", exc)
            _abort(context, "UNAVAILABLE" if isinstance(cause, ZephonError) else "INTERNAL", str(cause))
        return table_reply(self.spec, table, addresses)

    def _table(self, request: lo.TableRequest, context: grpc.ServicerContext) -> lo.TableReply:
        if request.fingerprint and request.fingerprint != self.fingerprint:
            _abort(
                context,
                "FAILED_PRECONDITION",
                f"the client was built for pipeline fingerprint {request.fingerprint}, but these lane "
                f"owners run fingerprint {self.fingerprint}",
            )
        return self._reply(self._coordinator.served_table.remote(), context)

    def _replace(self, request: lo.ReplaceRequest, context: grpc.ServicerContext) -> lo.TableReply:
        ref = self._coordinator.replace_served.remote(int(request.owner), int(request.generation))
        return self._reply(ref, context)

    def _progress(self, request: pb.AckRequest, context: grpc.ServicerContext) -> pb.AckReply:
        if int(request.world_size) != self.world_size:
            _abort(
                context,
                "FAILED_PRECONDITION",
                f"these lane owners serve world_size={self.world_size}, not {request.world_size}: "
                f"restart zephon serve with --world-size {request.world_size} (and --resume)",
            )
        self._coordinator.progress.remote(int(request.rank), int(request.step))
        return pb.AckReply()

    def _checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointReply:
        if self._checkpoint_dir is None:
            _abort(
                context,
                "FAILED_PRECONDITION",
                "this server was started without --checkpoint-dir: it cannot write checkpoints",
            )
        step = int(request.step)
        try:
            state = self._ray.get(self._coordinator.checkpoint.remote(step))
        except self._ray.exceptions.RayTaskError as exc:
            _abort(context, "INTERNAL", str(getattr(exc, "cause", exc)))
        path = os.path.join(self._checkpoint_dir, f"step-{step}.zfstate")
        save_state(state, path)
        return pb.CheckpointReply(step=step, path=os.path.abspath(path))

    def stop(self) -> None:
        self._server.stop(1.0).wait()
