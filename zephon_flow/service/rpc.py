"""gRPC plumbing shared by the batch service and the lane owners: unary calls and handlers from message types."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


def unary_call(channel: grpc.Channel, path: str, request: Any, reply: Any) -> grpc.UnaryUnaryMultiCallable:
    """The client's callable for the unary method at ``path`` (``/package.Service/Method``),
    sending ``request`` messages and reading ``reply`` ones (protobuf message classes)."""
    return channel.unary_unary(
        path, request_serializer=request.SerializeToString, response_deserializer=reply.FromString
    )


def unary_handler(method: Callable[[Any, grpc.ServicerContext], Any], request: Any, reply: Any) -> Any:
    """The server's handler running ``method`` for a unary RPC of ``request`` and ``reply`` messages."""
    return grpc.unary_unary_rpc_method_handler(
        method, request_deserializer=request.FromString, response_serializer=reply.SerializeToString
    )
