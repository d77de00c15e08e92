"""The one checkpoint test every operator's tests call: resume at every step, compare bit for bit.

``assert_equal_output_after_checkpoint`` runs a spec once without interruption, keeping every
global batch's digest and the merged state after every batch; then, for every step ``s``, it
resumes a fresh set of loaders from the state after ``s`` batches (round-tripped through the
checkpoint bytes) and checks that the rest of the run is identical. (grain:
``testing/experimental.py::assert_equal_output_after_checkpoint``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np

import zephon_flow as zf
from zephon_flow.core.batches import concat


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run: its global batches, their digests, and the states between them."""

    batches: list[dict[str, np.ndarray]]
    digests: list[tuple[int, str]]
    states: list[bytes]  # states[s]: checkpoint bytes after s batches (states[0]: fresh start)

    @property
    def final_state(self) -> dict[str, Any]:
        return zf.decode_state(self.states[-1]).to_plain()


def _global_run(
    spec: zf.LoaderSpec, steps: int, state: bytes | None, *, world_size: int, **loader_kwargs: Any
) -> Iterator[tuple[int, dict[str, np.ndarray], list[zf.Loader]]]:
    """Yields ``(step, global batch, the ranks' loaders)``, for all ranks in one process."""
    sync = zf.ThreadEndSync(world_size)  # the ranks agree on the end of a finite pass
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(
                zf.Loader(spec, rank=r, world_size=world_size, state=state, end_sync=sync, **loader_kwargs)
            )
            for r in range(world_size)
        ]
        iters = [iter(ld) for ld in loaders]
        for _ in range(steps):
            parts = [next(it, None) for it in iters]
            assert all(p is not None for p in parts), "the data ended before the requested steps"
            got = {p[0] for p in parts if p is not None}
            assert len(got) == 1, f"ranks disagree about the step: {sorted(got)}"
            yield got.pop(), concat([p[1] for p in parts if p is not None]), loaders


def reference_run(spec: zf.LoaderSpec, steps: int, *, world_size: int = 1, **loader_kwargs: Any) -> Reference:
    sync = zf.ThreadEndSync(world_size)
    with ExitStack() as stack:
        loaders = [
            stack.enter_context(
                zf.Loader(spec, rank=r, world_size=world_size, end_sync=sync, **loader_kwargs)
            )
            for r in range(world_size)
        ]
        fresh = zf.encode_state(zf.merge_states([ld.state_dict() for ld in loaders]))
    batches, digests, states = [], [], [fresh]
    for step, batch, loaders in _global_run(spec, steps, None, world_size=world_size, **loader_kwargs):
        batches.append(batch)
        digests.append((step, zf.batch_digest(batch)))
        states.append(zf.encode_state(zf.merge_states([ld.state_dict() for ld in loaders])))
    assert [s for s, _ in digests] == list(range(steps))
    return Reference(batches=batches, digests=digests, states=states)


def assert_equal_output_after_checkpoint(
    spec: zf.LoaderSpec, steps: int, *, world_size: int = 1, **loader_kwargs: Any
) -> Reference:
    """Resuming after any number ``s`` of batches (0 <= s < steps) continues the run exactly.

    The state after ``s`` batches is taken with ``Loader.state_dict`` (merged over the ranks),
    encoded to checkpoint bytes and decoded again before it is handed to fresh loaders. Returns
    the uninterrupted run, so callers can check what it covered (e.g. an epoch boundary).
    """
    ref = reference_run(spec, steps, world_size=world_size, **loader_kwargs)
    for s in range(steps):
        restored = zf.encode_state(zf.decode_state(ref.states[s]))
        assert restored == ref.states[s], f"checkpoint bytes after {s} batches do not round-trip"
        resumed = [
            (step, zf.batch_digest(batch))
            for step, batch, _ in _global_run(
                spec, steps - s, restored, world_size=world_size, **loader_kwargs
            )
        ]
        assert resumed == ref.digests[s:], (
            f"resuming after {s} batches diverges at step "
            f"{next(a[0] for a, b in zip(resumed, ref.digests[s:], strict=True) if a != b)}"
        )
    return ref
