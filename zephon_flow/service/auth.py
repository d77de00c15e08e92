"""Access to the batch service: the shared-token check on every call, and TLS credentials."""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from typing import Any

import grpc

from zephon_flow.core.errors import SpecError

TOKEN_ENV = "ZEPHON_TOKEN"
METADATA_KEY = "authorization"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
"""The health service stays open without a token, so that probes that cannot send metadata
(load balancers, orchestrators) can use it; it tells only whether the server is serving."""


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token``."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def clean_token(token: str, where: str) -> str:
    """``token`` without surrounding whitespace (a file's or a variable's trailing newline);
    refuses one that cannot travel as gRPC metadata, saying why and where it came from."""
    if not isinstance(token, str):
        raise SpecError(f"{where}: the token must be a str, got {type(token).__name__}")
    cleaned = token.strip()
    if not cleaned:
        raise SpecError(f"{where}: the token is empty")
    bad = sorted({c for c in cleaned if not (c.isascii() and c.isprintable())})
    if bad:
        raise SpecError(
            f"{where}: the token holds characters gRPC metadata cannot carry ({', '.join(map(repr, bad))}); "
            f"use printable ASCII only"
        )
    return cleaned


def read_token(path: str | None) -> str | None:
    """The token from ``path`` (surrounding whitespace stripped), else from ``$ZEPHON_TOKEN``."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise SpecError(f"zephon serve: cannot read --token-file {path}: {exc.strerror}") from exc
        if not token:
            raise SpecError(f"zephon serve: --token-file {path} is empty")
        return clean_token(token, f"zephon serve: --token-file {path}")
    return env_token("zephon serve")


def env_token(who: str) -> str | None:
    """``$ZEPHON_TOKEN``, cleaned (None when unset or blank)."""
    raw = os.environ.get(TOKEN_ENV)
    if raw is None or not raw.strip():
        return None
    return clean_token(raw, f"{who}: ${TOKEN_ENV}")


def _refuse(message: str) -> grpc.RpcMethodHandler:
    def abort(request: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call (except health checks) whose metadata lacks ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._missing = _refuse(
            "this server requires a token: pass Client(token=...) or set $ZEPHON_TOKEN "
            "(sent as metadata 'authorization: Bearer <token>')"
        )
        self._wrong = _refuse("the token sent does not match the server's token")

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if str(handler_call_details.method).startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        sent = [v for k, v in handler_call_details.invocation_metadata or () if k == METADATA_KEY]
        if not sent:
            return self._missing
        value = sent[0].encode() if isinstance(sent[0], str) else bytes(sent[0])
        if not hmac.compare_digest(value, self._expected):
            return self._wrong
        return continuation(handler_call_details)


def read_tls(cert_path: str, key_path: str) -> tuple[bytes, bytes]:
    """The PEM bytes of ``cert_path`` (certificate chain) and ``key_path`` (private key)."""
    blobs: dict[str, bytes] = {}
    for option, path in (("--tls-key", key_path), ("--tls-cert", cert_path)):
        try:
            with open(path, "rb") as f:
                blobs[option] = f.read()
        except OSError as exc:
            raise SpecError(f"zephon serve: cannot read {option} {path}: {exc.strerror}") from exc
    return blobs["--tls-cert"], blobs["--tls-key"]


def server_credentials(cert_path: str, key_path: str) -> grpc.ServerCredentials:
    """TLS credentials from PEM files (certificate chain and private key)."""
    cert, key = read_tls(cert_path, key_path)
    return grpc.ssl_server_credentials([(key, cert)])
