"""How the ranks of a finite pass agree on its last step, so that every rank yields as many.

A rank runs only the lanes under its rows, so it cannot tell alone whether some other lane still
has samples at step ``b``. The global sequence ends at the first step at which no lane has a
real sample; before every step of a finite pipeline, each rank's loader says whether its own
lanes have one and learns whether any rank's lanes do (an all-reduce of one boolean).

- ``TorchEndSync``: the ranks' ``torch.distributed`` group (a gloo group of its own, so it works
  next to NCCL). The default when ``torch.distributed`` is initialised.
- ``ThreadEndSync``: ranks that are loaders in one process (tests, simulations).
- ``OwnersEndSync``: ranks that read lane owners (``OwnedLoader`` on Ray, ``Client`` of served
  owners) ask the owners, which run every lane.
- No agreement is needed when every rank runs every lane (one lane, or one rank).

An agreement fails fast: a rank that fails, closes or dies makes every peer waiting on it raise
``RankLostError`` naming that rank, at once where the agreement learns of it (``ThreadEndSync``:
the loader says when it leaves; ``TorchEndSync``: gloo sees a dead peer's connection close),
else after ``timeout`` seconds without an answer. Time is read through an injected ``Clock``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.core.errors import RankLostError, SpecError
from zephon_flow.core.options import check_int

#: Seconds a rank waits for its peers' votes on a step before it gives up on them.
DEFAULT_TIMEOUT = 600.0
_POLL = 0.1  # seconds between looks at the loader's stop event while waiting


class EndSync(Protocol):
    """Agreement on whether the global sequence goes on at a step.

    An implementation whose agreement is a collective that every rank must enter (as
    ``torch.distributed``'s) sets ``lockstep = True``: the loader then enters it for a step only
    once its trainer has asked for that step. One that can name the ranks it waits for also
    meets ``RankedEndSync`` (``vote`` and ``leave``), which the ``Loader`` then uses instead.
    """

    def any_rank(self, step: int, local: bool, stop: threading.Event) -> bool:
        """Whether any rank's lanes have a real sample at ``step`` (``local``: this rank's).

        Called once per step by every rank, in step order. ``stop`` is set when the calling
        loader closes; a waiting implementation returns (False) then. A peer that fails or
        stops answering should make it raise ``RankLostError`` within a bounded time.
        """
        ...


@runtime_checkable
class RankedEndSync(Protocol):
    """An ``EndSync`` that knows who votes: the ``Loader`` of rank ``r`` calls ``vote(r, ...)``
    for each step and ``leave(r, error)`` when it closes (``error`` None) or fails."""

    def vote(self, rank: int, step: int, local: bool, stop: threading.Event) -> bool: ...

    def leave(self, rank: int, error: BaseException | None) -> None: ...


class RankEndSync:
    """One rank's side of an agreement, as its ``Loader`` holds it: votes as that rank, and
    tells the peers when the rank leaves (a plain ``EndSync`` is only asked ``any_rank``)."""

    def __init__(self, sync: EndSync, rank: int) -> None:
        self.sync = sync
        self.rank = rank
        self.lockstep = bool(getattr(sync, "lockstep", False))

    def any_rank(self, step: int, local: bool, stop: threading.Event) -> bool:
        if isinstance(self.sync, RankedEndSync):
            return self.sync.vote(self.rank, step, local, stop)
        return self.sync.any_rank(step, local, stop)

    def leave(self, error: BaseException | None) -> None:
        if isinstance(self.sync, RankedEndSync):
            self.sync.leave(self.rank, error)


def _positive(name: str, value: Any, who: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SpecError(f"{who}: {name} must be a positive number, got {value!r}")


def _why(error: BaseException | None) -> str:
    if error is None:
        return "its loader closed"
    return f"it failed with {type(error).__name__}: {error}"


class ThreadEndSync:
    """An ``EndSync`` for ``world_size`` loaders in one process (one producer thread each).

    A loader that closes or fails makes every peer waiting on a step it has not voted for raise
    ``RankLostError`` at once, naming it (and its error); a rank that has not voted within
    ``timeout`` seconds (e.g. its loader was never made) makes the waiting peers raise then.
    """

    def __init__(
        self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        check_int(world_size, "world_size")
        _positive("timeout", timeout, "ThreadEndSync")
        self.world_size = world_size
        self.timeout = float(timeout)
        self._clock = clock
        self._cond = threading.Condition()
        self._votes: dict[int, dict[object, bool]] = {}
        self._done: dict[int, bool] = {}
        self._readers: dict[int, int] = {}
        # rank -> (whether it left because another rank did, why it left)
        self._left: dict[int, tuple[bool, str]] = {}

    def any_rank(self, step: int, local: bool, stop: threading.Event) -> bool:
        """A vote that names no rank (an ``EndSync`` caller that is not a ``Loader``)."""
        return self._vote(object(), step, local, stop)

    def vote(self, rank: int, step: int, local: bool, stop: threading.Event) -> bool:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise SpecError(f"rank must be in [0, {self.world_size}) for this ThreadEndSync, got {rank!r}")
        return self._vote(rank, step, local, stop)

    def leave(self, rank: int, error: BaseException | None) -> None:
        with self._cond:
            self._left.setdefault(rank, (isinstance(error, RankLostError), _why(error)))
            self._cond.notify_all()

    def _vote(self, voter: object, step: int, local: bool, stop: threading.Event) -> bool:
        with self._cond:
            if isinstance(voter, int):
                self._left.pop(voter, None)  # a new loader of a rank that left earlier
            votes = self._votes.setdefault(step, {})
            if voter in votes:
                raise SpecError(
                    f"rank {voter} voted twice on step {step}: two loaders of the same rank share "
                    f"this ThreadEndSync; give each rank of the {self.world_size} its own rank="
                )
            votes[voter] = local
            if len(votes) == self.world_size:
                self._done[step] = any(votes.values())
                del self._votes[step]
                self._cond.notify_all()
            deadline = self._clock.now() + self.timeout
            while step not in self._done:
                if stop.is_set():
                    return False
                self._check_peers(step, deadline)
                self._clock.wait(self._cond, _POLL)
            result = self._done[step]
            self._readers[step] = self._readers.get(step, 0) + 1
            if self._readers[step] == self.world_size:
                del self._done[step], self._readers[step]
            return result

    def _check_peers(self, step: int, deadline: float) -> None:
        """Raises if step ``step`` can no longer be agreed: a rank that has not voted on it
        left, or the wait has passed its deadline."""
        voted = self._votes.get(step, {})
        # The rank that failed first of all before one that failed because of it.
        gone = sorted((self._left[r][0], r) for r in self._left if r not in voted)
        if gone:
            rank = gone[0][1]
            raise RankLostError(
                f"rank {rank} of {self.world_size} left before the ranks agreed on step {step}, "
                f"so they cannot agree on the end of this pass: {self._left[rank][1]}"
            )
        if self._clock.now() >= deadline:
            missing = [r for r in range(self.world_size) if r not in voted]
            named = len(voted) == len([v for v in voted if isinstance(v, int)])
            who = f"rank(s) {missing}" if named else f"{self.world_size - len(voted)} rank(s)"
            raise RankLostError(
                f"{who} of {self.world_size} did not vote on step {step} within {self.timeout:g} s "
                f"(ThreadEndSync(timeout=...)): each rank's loader must be made and iterated"
            )


class TorchEndSync:
    """An ``EndSync`` over ``torch.distributed``: a MAX all-reduce of one integer per step on a
    gloo group made for it. Every rank must construct its loader (and so this) in the same
    order, as with any ``torch.distributed`` group.

    A peer that dies closes its gloo connections: the all-reduce fails and this raises
    ``RankLostError`` at once; a peer that stops answering makes it raise after ``timeout``
    seconds (the group is made with that timeout too). With two ranks the peer is named; with
    more, the ranks it waited for.
    """

    lockstep = True

    def __init__(
        self, group: Any = None, *, timeout: float = DEFAULT_TIMEOUT, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        import torch
        import torch.distributed as dist

        _positive("timeout", timeout, "TorchEndSync")
        if not dist.is_available() or not dist.is_initialized():
            raise SpecError("TorchEndSync needs torch.distributed initialised (init_process_group)")
        self._torch, self._dist = torch, dist
        self.timeout = float(timeout)
        self._clock = clock
        if group is None:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))
        self._group = group
        self._rank = dist.get_rank()
        self._world = dist.get_world_size(group)

    def any_rank(self, step: int, local: bool, stop: threading.Event) -> bool:
        flag = self._torch.tensor([1 if local else 0], dtype=self._torch.int32)
        try:
            work = self._dist.all_reduce(flag, op=self._dist.ReduceOp.MAX, group=self._group, async_op=True)
        except RuntimeError as exc:  # torch's errors for a broken group derive from it
            raise self._lost(step, exc) from exc
        deadline = self._clock.now() + self.timeout
        # Polled, so that a loader closing while other ranks have stopped does not hang here.
        while not work.is_completed():
            if stop.is_set():
                return False
            if self._clock.now() >= deadline:
                raise self._lost(step, None)
            self._clock.sleep(0.001)
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._lost(step, exc) from exc
        return bool(flag.item())

    def _lost(self, step: int, error: BaseException | None) -> RankLostError:
        peers = [r for r in range(self._world) if r != self._rank]
        who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {peers}"
        if error is None:
            how = f"did not answer within {self.timeout:g} s (TorchEndSync(timeout=...))"
        else:
            how = f"failed or died (torch.distributed: {_first_sentence(error)})"
        return RankLostError(
            f"rank {self._rank} of {self._world}: the ranks could not agree on step {step}: {who} {how}"
        )


class OwnersEndSync:
    """The end of a finite pass for a rank that reads lane owners (on Ray, or served over
    gRPC). Every lane runs on some owner, and an owner can say whether its lanes have a real
    sample at a step (``LaneOwner.live``): a rank whose own rows have one goes on at once, and
    otherwise asks the owners in turn until one says yes. No rank waits for another, so no
    ranks need to enter it together. ``lives(step)`` yields each owner's answer, asking it
    only when the one before said no."""

    def __init__(self, lives: Callable[[int], Iterable[bool]]) -> None:
        self._lives = lives

    def any_rank(self, step: int, local: bool, stop: threading.Event) -> bool:
        return local or any(self._lives(step))


def _first_sentence(error: BaseException) -> str:
    """gloo's message without its source location: ``[.../pair.cc:553] Connection closed by
    peer [127.0.0.1]:26781. This is typically ...`` -> ``Connection closed by peer ...:26781``."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    return text.split(". ")[0].splitlines()[0] if text else type(error).__name__


def bind_end_sync(sync: EndSync | None, rank: int) -> RankEndSync | None:
    """What rank ``rank``'s loader holds of ``sync`` (None: no agreement is needed)."""
    return None if sync is None else RankEndSync(sync, rank)


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
