"""Backends that run the stateless part of a pipeline (inline, threads, processes), and the
factory that picks one by name."""

from __future__ import annotations

from zephon_flow.core.errors import SpecError
from zephon_flow.runners.backends.base import BACKENDS, DEFAULT_CHUNK_TIMEOUT, Backend
from zephon_flow.runners.backends.inline import InlineBackend
from zephon_flow.runners.backends.processes import ProcessBackend
from zephon_flow.runners.backends.threads import ThreadBackend
from zephon_flow.runners.segment import FrontSegment

__all__ = [
    "BACKENDS",
    "DEFAULT_CHUNK_TIMEOUT",
    "Backend",
    "InlineBackend",
    "ProcessBackend",
    "ThreadBackend",
    "make_backend",
]


def make_backend(
    name: str, *, workers: int, segment: FrontSegment, chunk_timeout: float = DEFAULT_CHUNK_TIMEOUT
) -> Backend:
    if not isinstance(workers, int) or workers < 1:
        raise SpecError(f"workers must be a positive integer, got {workers!r}")
    if isinstance(chunk_timeout, bool) or not isinstance(chunk_timeout, int | float) or not chunk_timeout > 0:
        raise SpecError(
            f"chunk_timeout must be a positive number of seconds, got {chunk_timeout!r} "
            f"(the default is {DEFAULT_CHUNK_TIMEOUT:g})"
        )
    timeout = float(chunk_timeout)
    if name == "inline":
        return InlineBackend(segment, chunk_timeout=timeout)
    if name == "threads":
        return ThreadBackend(segment, workers, chunk_timeout=timeout)
    if name == "processes":
        return ProcessBackend(segment, workers, chunk_timeout=timeout)
    raise SpecError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
