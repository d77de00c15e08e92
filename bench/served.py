"""The benchmark's text workload as a ``zephon serve`` target: ``zephon serve bench.served:spec``.

The workload JSON's path is in ``$ZEPHON_BENCH_WORKLOAD`` and ``Tokenize``'s engine in
``$ZEPHON_BENCH_ENGINE`` (default ``hf``); the spec is the one ``zephon_embedded`` builds, so the
served and the embedded contenders run the same pipeline.
"""

from __future__ import annotations

import os
from typing import Any

from bench.contenders.zephon_embedded import make_spec
from bench.workload import load_workload

WORKLOAD_ENV = "ZEPHON_BENCH_WORKLOAD"
ENGINE_ENV = "ZEPHON_BENCH_ENGINE"


def spec() -> Any:
    """The ``zf.LoaderSpec`` of the workload named by the environment."""
    path = os.environ.get(WORKLOAD_ENV)
    if not path:
        raise RuntimeError(f"bench.served: set ${WORKLOAD_ENV} to a workload JSON file")
    return make_spec(load_workload(path), os.environ.get(ENGINE_ENV, "hf"))
