"""Mixture changes over the wire: ``zephon mix``'s call to a running server, and its request."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from zephon_flow.core.errors import FingerprintMismatchError, ServiceError, SpecError
from zephon_flow.service import auth
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service.rpc import unary_call

#: The call on ``zephon serve``, and on ``zephon serve --ray``'s coordinator.
METHODS = ("/zephon.v1.BatchService/ChangeMixture", "/zephon.v1.LaneOwners/ChangeMixture")
#: How long ``change_mixture`` waits for the server's answer (seconds).
TIMEOUT = 60.0


@dataclass(frozen=True, kw_only=True)
class MixChange:
    """New mixture weights from global step ``at_step`` on: ``points`` are ``(step, weights)``
    at absolute steps, the first at ``at_step`` (see ``Mix.starting_at``)."""

    at_step: int
    points: tuple[tuple[int, tuple[float, ...]], ...]
    interpolation: str = "constant"

    @classmethod
    def of(
        cls,
        at_step: int,
        *,
        weights: Sequence[float] | None = None,
        schedule: Sequence[tuple[int, Sequence[float]]] | None = None,
        interpolation: str = "constant",
    ) -> MixChange:
        if (weights is None) == (schedule is None):
            raise SpecError("a mixture change takes either weights or a schedule, not both")
        given = [(at_step, weights)] if weights is not None else list(schedule or ())
        points = tuple((int(step), tuple(float(w) for w in ws)) for step, ws in given)
        return cls(at_step=at_step, points=points, interpolation=interpolation)

    def request(self, fingerprint: str = "") -> pb.ChangeMixtureRequest:
        return pb.ChangeMixtureRequest(
            fingerprint=fingerprint,
            at_step=self.at_step,
            points=[pb.MixPoint(step=step, weights=list(ws)) for step, ws in self.points],
            interpolation=self.interpolation,
        )

    @classmethod
    def from_request(cls, request: pb.ChangeMixtureRequest) -> MixChange:
        return cls(
            at_step=int(request.at_step),
            points=tuple((int(p.step), tuple(float(w) for w in p.weights)) for p in request.points),
            interpolation=request.interpolation or "constant",
        )

    def schedule(self) -> list[tuple[int, list[float]]]:
        """The points as ``Loader.change_mixture(step, schedule=...)`` takes them."""
        return [(step, list(ws)) for step, ws in self.points]


def naming_the_flag(exc: FingerprintMismatchError, command: str) -> FingerprintMismatchError:
    """``exc`` (a refused mixture change on resume, which names ``zf.Loader``'s option) with
    the option of ``command`` (e.g. ``zephon serve``) that accepts it; other refusals as they are."""
    if "allow_mix_change=True" not in str(exc):
        return exc
    return FingerprintMismatchError(f"{exc}; {command}: pass --allow-mix-change")


def parse_weights(text: str) -> list[float]:
    """``"0.5,0.5"`` -> ``[0.5, 0.5]``; anything else is a ``SpecError`` naming the text."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise SpecError(f"weights must be numbers separated by commas (e.g. 0.7,0.3), got {text!r}") from None


def parse_schedule(text: str) -> list[tuple[int, list[float]]]:
    """``"100:0.5,0.5;200:0.2,0.8"`` -> ``[(100, [0.5, 0.5]), (200, [0.2, 0.8])]``."""
    points: list[tuple[int, list[float]]] = []
    for part in text.split(";"):
        step, sep, weights = part.strip().partition(":")
        try:
            at = int(step)
        except ValueError:
            at = -1
        if not sep or at < 0:
            raise SpecError(f"a schedule is STEP:W,W;STEP:W,W (e.g. 100:0.5,0.5;200:0.2,0.8), got {text!r}")
        points.append((at, parse_weights(weights)))
    return points


def change_mixture(
    address: str,
    change: MixChange,
    *,
    token: str | None = None,
    root_certificates: bytes | None = None,
    timeout: float = TIMEOUT,
) -> list[tuple[int, dict[str, Any]]]:
    """Asks the server at ``address`` (``zephon serve``) to put ``change`` in force; returns the
    mixture history it now records. Token and TLS as ``zf.Client``'s (``token`` defaults to
    ``$ZEPHON_TOKEN``). A refusal raises ``ServiceError`` with the server's reason and its
    status code name (``code``)."""
    token = auth.clean_token(token, "zephon mix") if token is not None else auth.env_token("zephon mix")
    if root_certificates is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(
            address, grpc.ssl_channel_credentials(root_certificates=root_certificates)
        )
    try:
        for method in METHODS:
            call = unary_call(channel, method, pb.ChangeMixtureRequest, pb.ChangeMixtureReply)
            try:
                reply = call(change.request(), metadata=auth.bearer(token) if token else (), timeout=timeout)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED or method == METHODS[-1]:
                    raise ServiceError(_refusal(address, change, exc), code=exc.code().name) from None
    finally:
        channel.close()
    return [(int(step), dict(params)) for step, params in json.loads(reply.history_json)]


def _refusal(address: str, change: MixChange, exc: grpc.RpcError) -> str:
    code, details = exc.code(), exc.details() or ""
    where = f"zephon mix --server {address} --at-step {change.at_step}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"{where}: the server does not take mixture changes while it runs (an older "
            f"zephon-flow): checkpoint it, then restart it with --resume CHECKPOINT "
            f"--allow-mix-change and a pipeline whose Mix has the new weights"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"{where}: cannot reach the server ({details})"
    return f"{where}: refused ({code.name}): {details}"
