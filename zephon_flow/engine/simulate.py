"""Running every rank of a topology in one process, to observe whole global batches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

from zephon_flow.core.batches import Batch, batch_digest, concat
from zephon_flow.core.checkpoint.merge import merge_states
from zephon_flow.core.options import check_int
from zephon_flow.engine.endsync import ThreadEndSync
from zephon_flow.engine.loader import Loader
from zephon_flow.engine.spec import LoaderSpec


def global_batches(
    spec: LoaderSpec,
    *,
    steps: int,
    world_size: int = 1,
    backend: str = "inline",
    workers: int = 1,
    state: Any = None,
    final_state: list[dict[str, Any]] | None = None,
    **loader_options: Any,
) -> Iterator[tuple[int, Batch]]:
    """Yields ``steps`` global batches, each assembled from ``world_size`` simulated ranks.

    With ``final_state`` (a list), the merged state after the last batch is appended to it.
    """
    check_int(steps, "steps", low=0)
    if "end_sync" not in loader_options:
        loader_options["end_sync"] = ThreadEndSync(world_size)
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(
                Loader(
                    spec,
                    rank=r,
                    world_size=world_size,
                    backend=backend,
                    workers=workers,
                    state=state,
                    **loader_options,
                )
            )
            for r in range(world_size)
        ]
        iters = [iter(ld) for ld in loaders]
        for _ in range(steps):
            parts = [next(it, None) for it in iters]
            if any(p is None for p in parts):
                break
            got_steps = {p[0] for p in parts if p is not None}
            assert len(got_steps) == 1, f"ranks disagree about the step: {sorted(got_steps)}"
            yield got_steps.pop(), concat([p[1] for p in parts if p is not None])
        if final_state is not None:
            final_state.append(merge_states([ld.state_dict() for ld in loaders]).to_plain())


def global_digests(spec: LoaderSpec, **kwargs: Any) -> list[tuple[int, str]]:
    """``(step, sha256)`` of each global batch; see ``global_batches`` for the options."""
    return [(step, batch_digest(batch)) for step, batch in global_batches(spec, **kwargs)]
