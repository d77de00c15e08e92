"""The bounded window of global batches a server holds, and the ranks' positions in it.

The window holds global batches ``[low, produced)`` and, for each step in ``[low, produced]``,
the loader state from which that step is the next batch. A rank's position is the step it has
*acknowledged*: its client has handed every batch before it to the trainer (the ``Ack`` RPC).
Production may run ``ahead`` steps past the slowest rank's position and blocks there; a rank's
stream sends at most ``ahead`` steps past its own position and waits there, so the batches in
flight are bounded by the window, not by gRPC's buffers. Steps up to ``keep`` behind the
slowest rank stay held, so that a rank that reconnects from the step it was at gets the same
bytes, and ``Checkpoint(step)`` for the step a trainer is at finds that step's state. Ranks are
tracked for one world size at a time: all ``W`` ranks start at the first rank's start step (a
rank that has not connected yet holds production back, as it would hold back training), and
the world size can change only while no rank is connected.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zephon_flow.core.batches import Batch


class WindowError(Exception):
    """A request the window cannot satisfy; ``code`` names the gRPC status code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class WindowStatus:
    world_size: int
    low: int
    produced: int
    ended: bool
    positions: dict[int, int]
    sent: dict[int, int]
    connected: dict[int, bool]
    batches_per_second: float
    latest_state: Any


class StepWindow:
    """Thread-safe: one producer thread calls ``wait_for_room``/``add``/``finish``; stream
    handlers call ``join``/``take`` (or ``wait_to_send``/``get``/``sent``)/``leave``;
    acknowledgements call ``ack``; checkpoints call ``state_for``."""

    def __init__(
        self, *, first_step: int, first_state: Any, ahead: int = 8, keep: int = 8, reach: int | None = None
    ) -> None:
        if ahead < 1 or keep < 0:
            raise ValueError(f"ahead must be >= 1 and keep >= 0, got ahead={ahead}, keep={keep}")
        self.ahead, self.keep = ahead, keep
        #: How far past the produced step a stream may start (production catches up to it):
        #: ``ahead`` by default; more for a server resumed from a checkpoint its ranks outran.
        self.reach = ahead if reach is None else max(ahead, reach)
        self._cond = threading.Condition()
        self._low = self._produced = first_step
        self._batches: dict[int, Batch] = {}
        self._states: dict[int, Any] = {first_step: first_state}
        self._ended = False
        self._error: BaseException | None = None
        self._world_size = 0
        self._positions: dict[int, int] = {}
        self._sent: dict[int, int] = {}
        self._connected: dict[int, int] = {}
        # Per rank, the number of the newest stream: an older stream of the rank is replaced.
        self._streams: dict[int, int] = {}
        self._joins = 0
        self._times: list[float] = []

    # -- producer ------------------------------------------------------------------------------
    def _slowest(self) -> int:
        return min(self._positions.values()) if self._positions else self._low

    def has_room(self) -> bool:
        """Whether production may go on now (fewer than ``ahead`` steps past the slowest rank)."""
        with self._cond:
            return self._produced < self._slowest() + self.ahead

    def wait_for_room(self, stopped: Callable[[], bool]) -> bool:
        """Blocks while ``ahead`` steps past the slowest rank are produced; False once stopped."""
        with self._cond:
            while self._produced >= self._slowest() + self.ahead:
                if stopped():
                    return False
                self._cond.wait(0.2)
            return not stopped()

    def add(self, batch: Batch, state_after: Any) -> None:
        """Holds global batch ``produced`` and the state from which the next step follows."""
        with self._cond:
            self._batches[self._produced] = batch
            self._produced += 1
            self._states[self._produced] = state_after
            self._times = [*self._times[-31:], time.monotonic()]
            self._cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        """The data ended (``error`` None) or the pipeline failed."""
        with self._cond:
            self._ended = True
            self._error = error
            self._cond.notify_all()

    # -- ranks ---------------------------------------------------------------------------------
    def _held(self) -> str:
        return f"the server holds steps [{self._low}, {self._produced})"

    def join(self, rank: int, world_size: int, step: int) -> int:
        """Registers a stream of ``rank`` of ``world_size`` starting at ``step``; returns its
        number. A rank has one stream: an older one still open is replaced (its ``take`` raises
        ``ABORTED``), so a trainer that reconnects is never refused by its own dead stream."""
        with self._cond:
            if world_size != self._world_size:
                busy = sorted(r for r, n in self._connected.items() if n)
                if busy:
                    raise WindowError(
                        "FAILED_PRECONDITION",
                        f"the server is serving world_size={self._world_size} (ranks {busy} connected); "
                        f"world_size={world_size} can connect once they have all disconnected",
                    )
            self._check_step(step)
            if step > self._produced + self.reach:
                raise WindowError(
                    "OUT_OF_RANGE",
                    f"step {step} is too far ahead: {self._held()} and a stream may start at most "
                    f"{self.reach} steps past it; to start at step {step}, restart the server with "
                    f"--resume from a checkpoint of that step",
                )
            if world_size != self._world_size:
                self._world_size = world_size
                self._positions = dict.fromkeys(range(world_size), step)
                self._sent = dict.fromkeys(range(world_size), step)
                self._connected = dict.fromkeys(range(world_size), 0)
            self._positions[rank] = step
            self._sent[rank] = step
            self._connected[rank] += 1
            self._joins += 1
            self._streams[rank] = self._joins
            self._release()
            return self._joins

    def _check_current(self, rank: int, stream: int | None) -> None:
        if stream is not None and self._streams.get(rank) != stream:
            raise WindowError(
                "ABORTED",
                f"rank {rank} opened a new stream: this one is replaced (a rank reads one stream at a time)",
            )

    def _check_step(self, step: int) -> None:
        if step < self._low:
            raise WindowError(
                "OUT_OF_RANGE",
                f"step {step} is no longer held: {self._held()} (resume from a checkpoint to go back further)",
            )
        if self._ended and self._error is None and step > self._produced:
            raise WindowError(
                "OUT_OF_RANGE",
                f"step {step} is past the end of the data: the last step is {self._produced - 1}",
            )

    def get(self, step: int, active: Callable[[], bool]) -> Batch | None:
        """Global batch ``step``, waiting for it to be produced; None at the end of the data
        or when ``active()`` turns false."""
        with self._cond:
            return self._await_produced(step, active)

    def _await_produced(self, step: int, active: Callable[[], bool]) -> Batch | None:
        """``get``'s wait, with the lock held."""
        while step >= self._produced:
            if self._error is not None:
                raise WindowError("INTERNAL", f"the pipeline failed at step {self._produced}: {self._error}")
            if self._ended or not active():
                return None
            self._cond.wait(0.2)
        self._check_step(step)
        return self._batches[step]

    def wait_to_send(self, rank: int, world_size: int, step: int, active: Callable[[], bool]) -> bool:
        """Blocks while ``step`` is ``ahead`` steps or more past ``rank``'s acknowledged step;
        False when ``active()`` turns false (the stream's client is gone)."""
        with self._cond:
            while world_size == self._world_size and step >= self._positions[rank] + self.ahead:
                if not active():
                    return False
                self._cond.wait(0.2)
            return active()

    def take(
        self,
        rank: int,
        world_size: int,
        step: int,
        active: Callable[[], bool],
        stream: int | None = None,
    ) -> Batch | None:
        """For ``rank``'s stream, which has sent every step before ``step``: records that (as
        ``sent``), waits as ``wait_to_send`` and then as ``get``, under one lock; returns global
        batch ``step``, or None when the stream should end (data ended or client gone).
        ``stream`` (from ``join``) raises ``ABORTED`` once the rank has opened a newer stream."""
        with self._cond:
            self._check_current(rank, stream)
            current = world_size == self._world_size
            if current:
                self._sent[rank] = step
            while current and step >= self._positions[rank] + self.ahead:
                if not active():
                    return None
                self._cond.wait(0.2)
                self._check_current(rank, stream)
                current = world_size == self._world_size
            return self._await_produced(step, active)

    def waiting_for_client(self, rank: int, world_size: int, step: int) -> bool:
        """Whether ``rank``'s stream at ``step`` could send now but for its client: the step is
        produced, or production waits for the rank's acknowledgements."""
        with self._cond:
            if world_size != self._world_size:
                return False
            return step < self._produced or step >= self._positions[rank] + self.ahead

    def slowest(self) -> int:
        """The step every connected world's rank has acknowledged (the first step if none)."""
        with self._cond:
            return self._slowest()

    def sent(self, rank: int, world_size: int, next_step: int) -> None:
        """``rank``'s stream has sent every step before ``next_step`` (shown by ``status``)."""
        with self._cond:
            if world_size == self._world_size:
                self._sent[rank] = next_step

    def ack(self, rank: int, world_size: int, next_step: int) -> None:
        """``rank`` has taken every batch before ``next_step``; releases what nobody needs.

        Acknowledgements only move a rank forward (a late one from before a reconnect is
        ignored); a reconnect at an earlier step moves it back through ``join``."""
        with self._cond:
            if world_size != self._world_size:
                raise WindowError(
                    "FAILED_PRECONDITION",
                    f"the server is serving world_size={self._world_size}, not {world_size}: "
                    f"acknowledge steps of the stream you are reading",
                )
            if next_step > self._produced:
                raise WindowError(
                    "OUT_OF_RANGE",
                    f"rank {rank} acknowledged step {next_step - 1}, which was never served: {self._held()}",
                )
            if next_step > self._positions[rank]:
                self._positions[rank] = next_step
                self._release()

    def _release(self) -> None:
        """Drops the steps more than ``keep`` behind the slowest rank (holding the lock)."""
        low = max(self._low, min(self._slowest() - self.keep, self._produced))
        for s in range(self._low, low):
            self._batches.pop(s, None)
            self._states.pop(s, None)
        self._low = low
        self._cond.notify_all()

    def leave(self, rank: int, world_size: int, stream: int | None = None) -> None:
        with self._cond:
            if world_size == self._world_size and self._connected.get(rank):
                self._connected[rank] -= 1
                if stream is not None and self._streams.get(rank) == stream:
                    del self._streams[rank]
            self._cond.notify_all()

    # -- checkpoints and status ----------------------------------------------------------------
    def state_for(self, step: int, *, timeout: float) -> Any:
        """The loader state from which ``step`` is the next batch (waits for it to be produced)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while step > self._produced:
                if self._error is not None:
                    raise WindowError(
                        "INTERNAL", f"the pipeline failed at step {self._produced}: {self._error}"
                    )
                self._check_step(step)
                if step > self._slowest() + self.ahead:
                    raise WindowError(
                        "OUT_OF_RANGE",
                        f"step {step} is not produced yet and cannot be before the slowest rank "
                        f"(at step {self._slowest()}) moves on: {self._held()}",
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WindowError("DEADLINE_EXCEEDED", f"step {step} was not produced in {timeout:g} s")
                self._cond.wait(min(left, 0.2))
            self._check_step(step)
            return self._states[step]

    def status(self) -> WindowStatus:
        with self._cond:
            times = self._times
            rate = (
                (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
            )
            return WindowStatus(
                world_size=self._world_size,
                low=self._low,
                produced=self._produced,
                ended=self._ended,
                positions=dict(self._positions),
                sent=dict(self._sent),
                connected={r: n > 0 for r, n in self._connected.items()},
                batches_per_second=rate,
                latest_state=self._states[self._produced],
            )
