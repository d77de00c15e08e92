"""Backends that run the stateless part of a pipeline (inline, threads, processes, ray), and the
factory that picks one by name."""

from __future__ import annotations

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import SpecError
from zephon_flow.core.options import check_int, check_seconds
from zephon_flow.runners.backends.base import BACKENDS, DEFAULT_CHUNK_TIMEOUT, Backend
from zephon_flow.runners.backends.inline import InlineBackend
from zephon_flow.runners.backends.processes import ProcessBackend
from zephon_flow.runners.backends.ray import RayBackend
from zephon_flow.runners.backends.threads import ThreadBackend
from zephon_flow.runners.segment import FrontSegment

__all__ = [
    "BACKENDS",
    "DEFAULT_CHUNK_TIMEOUT",
    "Backend",
    "InlineBackend",
    "ProcessBackend",
    "RayBackend",
    "ThreadBackend",
    "make_backend",
]


def make_backend(
    name: str,
    *,
    workers: int,
    segment: FrontSegment,
    chunk_timeout: float = DEFAULT_CHUNK_TIMEOUT,
    ray_address: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> Backend:
    """The backend ``name`` running ``segment``; ``ray_address`` is the Ray cluster of ``"ray"``
    (``None``: the Ray this process is connected to, or a local one it starts); ``clock`` is
    what ``chunk_timeout`` is measured on (tests pass a ``ManualClock``)."""
    check_int(workers, "workers")
    check_seconds(chunk_timeout, "chunk_timeout", default=DEFAULT_CHUNK_TIMEOUT)
    if ray_address is not None and (name != "ray" or not isinstance(ray_address, str) or not ray_address):
        raise SpecError(
            f"ray_address={ray_address!r} goes with backend='ray' and must be a non-empty address "
            f"such as 'ray://HOST:10001' or 'HOST:6379' (got backend={name!r})"
        )
    timeout = float(chunk_timeout)
    if name == "inline":
        return InlineBackend(segment, chunk_timeout=timeout, clock=clock)
    if name == "threads":
        return ThreadBackend(segment, workers, chunk_timeout=timeout, clock=clock)
    if name == "processes":
        return ProcessBackend(segment, workers, chunk_timeout=timeout, clock=clock)
    if name == "ray":  # Ray itself is imported only now: it is an extra
        return RayBackend(segment, workers, chunk_timeout=timeout, ray_address=ray_address, clock=clock)
    raise SpecError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
