"""The global batches a server holds (``HeldSteps``), bounded in steps and bytes, and the
ranks' positions in them.

The server holds global batches ``[low, produced)`` and, for each step in ``[low, produced]``,
the loader state from which that step is the next batch. A rank's position is the step it has
*acknowledged*: its client has handed every batch before it to the trainer (the ``Ack`` RPC).
Production may run ``ahead`` steps past the slowest rank's position and blocks there (and, with
``max_bytes``, also once the held batches would pass that many bytes); a rank's stream sends at
most ``ahead`` steps past its own position and waits there, so the batches in flight are
bounded by ``ahead`` and ``max_bytes``, not by gRPC's buffers. Steps up to ``keep`` behind the
slowest rank stay held, so that a rank that reconnects from the step it was at gets the same
bytes, and ``Checkpoint(step)`` for the step a trainer is at finds that step's state. Ranks are
tracked for one world size at a time: all ``W`` ranks start at the first rank's start step (a
rank that has not connected yet holds production back, as it would hold back training), and
the world size can change only while no rank is connected.

(*Window* is the runner's word for a lane's outputs of one step; the service says *held
steps* and *ahead*.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from zephon_flow.core.batches import Batch
from zephon_flow.core.clock import SYSTEM_CLOCK, Clock
from zephon_flow.engine.hold import StepStore

S = TypeVar("S")

#: How often a wait looks again at what does not notify it: a stream's ``active()`` (its gRPC
#: client may vanish) and the producer's ``stopped()``.
POLL_SECONDS = 0.2


class HeldStepsError(Exception):
    """A request the held steps cannot satisfy; ``code`` names the gRPC status code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class HeldStatus(Generic[S]):
    world_size: int
    low: int
    produced: int
    ended: bool
    positions: dict[int, int]
    sent: dict[int, int]
    connected: dict[int, bool]
    batches_per_second: float
    held_bytes: int
    latest_state: S


class HeldSteps(Generic[S]):
    """Thread-safe: one producer thread calls ``wait_for_room``/``add``/``finish``; stream
    handlers call ``join``/``take``/``leave``; acknowledgements call ``ack``; checkpoints call
    ``state_for``. ``S`` is the state type (the server holds ``LoaderState``s).

    ``max_bytes`` (None: no bound) bounds the bytes of the held batches: when one more batch
    would pass it, steps behind the slowest rank are released first (fewer than ``keep`` are
    then held), then production waits; the step the slowest rank needs next is always made. ``clock`` is what every wait and rate reads (tests pass a ``ManualClock``).
    """

    def __init__(
        self,
        *,
        first_step: int,
        first_state: S,
        ahead: int = 8,
        keep: int = 8,
        reach: int | None = None,
        max_bytes: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        # The held batches and states, their byte bound and the waits for room are the
        # engine's ``StepStore`` (``engine/hold.py``, as a lane owner holds its steps); the
        # ranks' streams, acknowledgements and world size are the server's own, under its lock.
        self._store: StepStore[Batch, S] = StepStore(
            first_step=first_step,
            first_state=first_state,
            ahead=ahead,
            keep=keep,
            max_bytes=max_bytes,
            size=_batch_bytes,
            clock=clock,
            poll=POLL_SECONDS,
        )
        self._hold, self._cond = self._store.rule, self._store.cond
        self.ahead, self.keep, self.max_bytes = ahead, keep, max_bytes
        self._clock = clock
        #: How far past the produced step a stream may start (production catches up to it):
        #: ``ahead`` by default; more for a server resumed from a checkpoint its ranks outran.
        self.reach = ahead if reach is None else max(ahead, reach)
        self._world_size = 0
        self._sent: dict[int, int] = {}
        self._connected: dict[int, int] = {}
        # Per rank, the number of the newest stream: an older stream of the rank is replaced.
        self._streams: dict[int, int] = {}
        self._joins = 0
        self._times: list[float] = []

    # -- producer ------------------------------------------------------------------------------
    def _slowest(self) -> int:
        return self._hold.slowest()

    def advised_ahead(self) -> int:
        """How many steps past its acknowledged step a rank can count on being made: ``ahead``,
        or fewer when ``max_bytes`` holds fewer batches (at least 1). Clients acknowledge every
        half of it, so their acknowledgements come before production needs them."""
        return self._store.advised_ahead()

    def wait_for_room(self, stopped: Callable[[], bool]) -> bool:
        """Returns True once production may go on (fewer than ``ahead`` steps past the slowest
        rank, and room in ``max_bytes``); False if ``stopped()`` while it has to wait."""
        return self._store.wait_for_room(stopped)

    def add(self, batch: Batch, state_after: S) -> None:
        """Holds global batch ``produced`` and the state from which the next step follows."""
        with self._cond:
            self._store.add(batch, state_after)
            self._times = [*self._times[-31:], self._clock.now()]
            self._store.release()

    def finish(self, error: BaseException | None = None) -> None:
        """The data ended (``error`` None) or the pipeline failed."""
        self._store.finish(error)

    # -- ranks ---------------------------------------------------------------------------------
    def _held(self) -> str:
        return f"the server holds steps [{self._hold.low}, {self._hold.produced})"

    def join(self, rank: int, world_size: int, step: int) -> int:
        """Registers a stream of ``rank`` of ``world_size`` starting at ``step``; returns its
        number. A rank has one stream: an older one still open is replaced (its ``take`` raises
        ``ABORTED``), so a trainer that reconnects is never refused by its own dead stream."""
        with self._cond:
            if world_size != self._world_size:
                busy = sorted(r for r, n in self._connected.items() if n)
                if busy:
                    raise HeldStepsError(
                        "FAILED_PRECONDITION",
                        f"the server is serving world_size={self._world_size} (ranks {busy} connected); "
                        f"world_size={world_size} can connect once they have all disconnected",
                    )
            self._check_step(step)
            if step > self._hold.produced + self.reach:
                raise HeldStepsError(
                    "OUT_OF_RANGE",
                    f"step {step} is too far ahead: {self._held()} and a stream may start at most "
                    f"{self.reach} steps past it; to start at step {step}, restart the server with "
                    f"--resume from a checkpoint of that step",
                )
            if world_size != self._world_size:
                self._world_size = world_size
                self._hold.positions = dict.fromkeys(range(world_size), step)
                self._sent = dict.fromkeys(range(world_size), step)
                self._connected = dict.fromkeys(range(world_size), 0)
            self._hold.place(rank, step)
            self._sent[rank] = step
            self._connected[rank] += 1
            self._joins += 1
            self._streams[rank] = self._joins
            self._store.release()
            return self._joins

    def _check_current(self, rank: int, stream: int | None) -> None:
        if stream is not None and self._streams.get(rank) != stream:
            raise HeldStepsError(
                "ABORTED",
                f"rank {rank} opened a new stream: this one is replaced (a rank reads one stream at a time)",
            )

    def _check_step(self, step: int) -> None:
        if step < self._hold.low:
            raise HeldStepsError(
                "OUT_OF_RANGE",
                f"step {step} is no longer held: {self._held()} (resume from a checkpoint to go back further)",
            )
        if self._store.ended and self._store.error is None and step > self._hold.produced:
            raise HeldStepsError(
                "OUT_OF_RANGE",
                f"step {step} is past the end of the data: the last step is {self._hold.produced - 1}",
            )

    def _await_produced(self, step: int, active: Callable[[], bool]) -> Batch | None:
        """Global batch ``step``, waiting (lock held) for it to be produced; None at the end of
        the data or when ``active()`` turns false."""
        while step >= self._hold.produced:
            self._check_failed()
            if self._store.ended or not active():
                return None
            self._clock.wait(self._cond, POLL_SECONDS)
        self._check_step(step)
        return self._store.get(step)

    def _check_failed(self) -> None:
        if self._store.error is not None:
            raise HeldStepsError(
                "INTERNAL", f"the pipeline failed at step {self._hold.produced}: {self._store.error}"
            )

    def take(
        self,
        rank: int,
        world_size: int,
        step: int,
        active: Callable[[], bool],
        stream: int | None = None,
    ) -> Batch | None:
        """For ``rank``'s stream, which has sent every step before ``step``: records that (shown
        by ``status().sent``), waits while ``step`` is ``ahead`` steps or more past the rank's
        acknowledged step, then until it is produced, under one lock; returns global batch
        ``step``, or None when the stream should end (data ended or client gone).
        ``stream`` (from ``join``) raises ``ABORTED`` once the rank has opened a newer stream."""
        with self._cond:
            self._check_current(rank, stream)
            current = world_size == self._world_size
            if current:
                self._sent[rank] = step
            while current and step >= self._hold.positions[rank] + self.ahead:
                if not active():
                    return None
                self._clock.wait(self._cond, POLL_SECONDS)
                self._check_current(rank, stream)
                current = world_size == self._world_size
            return self._await_produced(step, active)

    def waiting_for_client(self, rank: int, world_size: int, step: int) -> bool:
        """Whether ``rank``'s stream at ``step`` could send now but for its client: the step is
        produced, or production waits for the rank's acknowledgements."""
        with self._cond:
            if world_size != self._world_size:
                return False
            return step < self._hold.produced or step >= self._hold.positions[rank] + self.ahead

    def slowest(self) -> int:
        """The step every connected world's rank has acknowledged (the first step if none)."""
        with self._cond:
            return self._slowest()

    def ack(self, rank: int, world_size: int, next_step: int) -> None:
        """``rank`` has taken every batch before ``next_step``; releases what nobody needs.

        Acknowledgements only move a rank forward (a late one from before a reconnect is
        ignored); a reconnect at an earlier step moves it back through ``join``."""
        with self._cond:
            if world_size != self._world_size:
                raise HeldStepsError(
                    "FAILED_PRECONDITION",
                    f"the server is serving world_size={self._world_size}, not {world_size}: "
                    f"acknowledge steps of the stream you are reading",
                )
            if next_step > self._hold.produced:
                raise HeldStepsError(
                    "OUT_OF_RANGE",
                    f"rank {rank} acknowledged step {next_step - 1}, which was never served: {self._held()}",
                )
            if self._hold.advance(rank, next_step):
                self._store.release()  # the steps nobody needs any more; wakes every waiter

    def leave(self, rank: int, world_size: int, stream: int | None = None) -> None:
        with self._cond:
            if world_size == self._world_size and self._connected.get(rank):
                self._connected[rank] -= 1
                if stream is not None and self._streams.get(rank) == stream:
                    del self._streams[rank]
            self._cond.notify_all()

    # -- checkpoints and status ----------------------------------------------------------------
    def state_for(self, step: int, *, timeout: float) -> S:
        """The loader state from which ``step`` is the next batch (waits for it to be produced)."""
        deadline = self._clock.now() + timeout
        with self._cond:
            while step > self._hold.produced:
                self._check_failed()
                self._check_step(step)
                if step > self._slowest() + self.ahead:
                    raise HeldStepsError(
                        "OUT_OF_RANGE",
                        f"step {step} is not produced yet and cannot be before the slowest rank "
                        f"(at step {self._slowest()}) moves on: {self._held()}",
                    )
                left = deadline - self._clock.now()
                if left <= 0:
                    raise HeldStepsError(
                        "DEADLINE_EXCEEDED", f"step {step} was not produced in {timeout:g} s"
                    )
                self._clock.wait(self._cond, min(left, POLL_SECONDS))
            self._check_step(step)
            return self._held_state(step)

    def _held_state(self, step: int) -> S:
        state = self._store.state(step)
        if state is None:  # checked held by the caller, under the lock
            raise HeldStepsError("OUT_OF_RANGE", f"the state at step {step} is not held: {self._held()}")
        return state

    def status(self) -> HeldStatus[S]:
        with self._cond:
            times = self._times
            rate = (
                (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
            )
            return HeldStatus(
                world_size=self._world_size,
                low=self._hold.low,
                produced=self._hold.produced,
                ended=self._store.ended,
                positions=dict(self._hold.positions),
                sent=dict(self._sent),
                connected={r: n > 0 for r, n in self._connected.items()},
                batches_per_second=rate,
                held_bytes=self._store.held_bytes,
                latest_state=self._held_state(self._hold.produced),
            )


def _batch_bytes(batch: Batch) -> int:
    return sum(int(a.nbytes) for a in batch.values())
