"""One place that imports Ray and starts or joins a Ray cluster, with errors that say what to do."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

from zephon_flow.core.errors import RayUnavailableError as RayUnavailableError  # also imported from here

#: What a user runs when Ray is missing.
RAY_INSTALL_HINT = "pip install 'zephon-flow[ray]'"


def require_ray(feature: str) -> ModuleType:
    """Returns the ``ray`` module, or refuses ``feature`` naming the install command."""
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise RayUnavailableError(
            f"{feature} needs Ray, which is not installed here ({exc}); install it with {RAY_INSTALL_HINT}"
        ) from None


def connect(feature: str, address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Makes sure this process is connected to Ray; returns True when this call started it.

    ``address=None`` joins the cluster this process is already connected to, or the one
    ``$RAY_ADDRESS`` names, or else starts a local Ray of its own on loopback (``num_cpus``
    caps it; the default is every core), never joining another local instance. An address
    (``"ray://host:10001"``, ``"host:6379"`` or ``"auto"``) joins that cluster; if it cannot be
    reached the error names it.
    """
    ray = require_ray(feature)
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {
        "ignore_reinit_error": True,
        "include_dashboard": False,
        "log_to_driver": False,
        "configure_logging": False,
    }
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    if address is None:
        # "local": a new instance of its own, even when another Ray runs on this machine (a
        # bare ray.init() would join that one, and refuse num_cpus).
        options["address"] = "local"
        options["num_cpus"] = num_cpus if num_cpus is not None else (os.cpu_count() or 1)
        options["_node_ip_address"] = "127.0.0.1"
    else:
        options["address"] = address
    try:
        _init(ray, options, local=address is None)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError, _StartupTimeout) as exc:
        where = f"the Ray cluster at {address!r}" if address is not None else "a local Ray instance"
        raise RayUnavailableError(
            f"{feature} could not reach {where}: {type(exc).__name__}: {exc}. "
            + (
                "Check the address (ray://HOST:10001 for a client, HOST:6379 for a node of the "
                "cluster, or 'auto' on a cluster node) and that the cluster is running."
                if address is not None
                else "Check that this machine can start Ray processes (shared memory, /tmp space)."
            )
        ) from exc
    return True


#: Part of the message of the bare ``Exception`` Ray raises when its raylet does not register
#: within 30 s (fixed in Ray's ``node.py``): on a loaded machine, a local start may just be slow.
_STARTUP_TIMEOUT = "timed out during startup"


class _StartupTimeout(Exception):
    """Ray's raylet did not register in time, twice."""


def _init(ray: ModuleType, options: dict[str, Any], *, local: bool) -> None:
    """``ray.init``; a local start that hits Ray's startup timeout is shut down and tried once
    more before it fails."""
    for attempt in (1, 2):
        try:
            ray.init(**options)
            return
        except Exception as exc:
            if not local or _STARTUP_TIMEOUT not in str(exc) or type(exc) is not Exception:
                raise
            ray.shutdown()
            if attempt == 2:
                raise _StartupTimeout(f"{exc} (tried twice)") from exc


def disconnect_if_started(started: bool) -> None:
    """Shuts Ray down if ``connect`` started it; leaves a cluster the user joined alone."""
    if not started:
        return
    ray = require_ray("disconnecting from Ray")
    if ray.is_initialized():
        ray.shutdown()
