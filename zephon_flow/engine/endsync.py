"""How the ranks of a finite pass agree on its last step, so that every rank yields as many.

A rank runs only the lanes under its rows, so it cannot tell alone whether some other lane still
has samples at step ``b``. The global sequence ends at the first step at which no lane has a
real sample; before every step of a finite pipeline, each rank's loader says whether its own
lanes have one and learns whether any rank's lanes do (an all-reduce of one boolean).

- ``TorchEndSync``: the ranks' ``torch.distributed`` group (a gloo group of its own, so it works
  next to NCCL). The default when ``torch.distributed`` is initialised.
- ``ThreadEndSync``: ranks that are loaders in one process (tests, simulations).
- No agreement is needed when every rank runs every lane (one lane, or one rank).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from zephon_flow.core.errors import SpecError


class EndSync(Protocol):
    """Agreement on whether the global sequence goes on at a step.

    An implementation whose agreement is a collective that every rank must enter (as
    ``torch.distributed``'s) sets ``lockstep = True``: the loader then enters it for a step only
    once its trainer has asked for that step.
    """

    def any_rank(self, step: int, local: bool, stop: threading.Event) -> bool:
        """Whether any rank's lanes have a real sample at ``step`` (``local``: this rank's).

        Called once per step by every rank, in step order. ``stop`` is set when the calling
        loader closes; a waiting implementation returns (False) then.
        """
        ...


class ThreadEndSync:
    """An ``EndSync`` for ``world_size`` loaders in one process (one producer thread each)."""

    def __init__(self, world_size: int) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise SpecError(f"ThreadEndSync: world_size must be a positive integer, got {world_size!r}")
        self.world_size = world_size
        self._cond = threading.Condition()
        self._votes: dict[int, list[bool]] = {}
        self._done: dict[int, bool] = {}
        self._readers: dict[int, int] = {}

    def any_rank(self, step: int, local: bool, stop: threading.Event) -> bool:
        with self._cond:
            votes = self._votes.setdefault(step, [])
            votes.append(local)
            if len(votes) == self.world_size:
                self._done[step] = any(votes)
                del self._votes[step]
                self._cond.notify_all()
            while step not in self._done:
                if stop.is_set():
                    return False
                self._cond.wait(timeout=0.1)
            result = self._done[step]
            self._readers[step] = self._readers.get(step, 0) + 1
            if self._readers[step] == self.world_size:
                del self._done[step], self._readers[step]
            return result


class TorchEndSync:
    """An ``EndSync`` over ``torch.distributed``: a MAX all-reduce of one integer per step on a
    gloo group made for it. Every rank must construct its loader (and so this) in the same
    order, as with any ``torch.distributed`` group."""

    lockstep = True

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise SpecError("TorchEndSync needs torch.distributed initialised (init_process_group)")
        self._torch, self._dist = torch, dist
        self._group = group if group is not None else dist.new_group(backend="gloo")

    def any_rank(self, step: int, local: bool, stop: threading.Event) -> bool:
        flag = self._torch.tensor([1 if local else 0], dtype=self._torch.int32)
        work = self._dist.all_reduce(flag, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True)
        # Polled, so that a loader closing while other ranks have stopped does not hang here.
        while not work.is_completed():
            if stop.wait(0.001):
                return False
        work.wait()
        return bool(flag.item())


def default_end_sync(world_size: int, *, finite: bool, all_lanes_local: bool) -> EndSync | None:
    """The agreement a loader uses when none is given: none when it is not needed, the ranks'
    ``torch.distributed`` group when there is one; otherwise a clear error."""
    if not finite or all_lanes_local:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None  # type: ignore[assignment]
    if dist is not None and dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise SpecError(
                f"the Loader's world_size={world_size} differs from torch.distributed's "
                f"{dist.get_world_size()}; pass end_sync= for the ranks that read this pipeline"
            )
        return TorchEndSync()
    raise SpecError(
        f"this pipeline is finite (a source has epochs=N) and runs on {world_size} ranks: the "
        f"ranks must agree on its last step so that each yields as many. Initialise "
        f"torch.distributed before making the Loader, or pass end_sync= (zf.ThreadEndSync for "
        f"loaders in one process), or serve it with `zephon serve`"
    )
