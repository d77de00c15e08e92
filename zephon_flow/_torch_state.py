"""A trainer's view of loader states: kept snapshots, and lane values encoded only when pickled.

``ZephonDataset.state_dict()`` is called by trainers before or after every batch, so it must
not encode anything: its values are ``LaneBytes``, references to a snapshot the loader took
anyway, that become checkpoint bytes when pickled (``torch.save``, ``torch.distributed.checkpoint``,
``copy.deepcopy``) or when asked (``bytes(value)``). They unpickle as plain ``bytes``, which
``torch.load(weights_only=True)`` accepts. No torch import here.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Callable
from typing import Any

from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.checkpoint.store import encode_state

#: A lane (or a whole dataset) with no state yet: a fresh start at step 0.
FRESH = b""


class Snapshot:
    """A loader state as taken (a reference, never changed afterwards) and how to save it:
    ``finish`` is the loader's ``saved_form`` (recipes with ``state_mode="recipe"``), applied
    once, when first needed."""

    __slots__ = ("_finish", "_lock", "_saved", "state")

    def __init__(self, state: LoaderState, finish: Callable[[LoaderState], LoaderState] | None) -> None:
        self.state = state
        self._finish = finish
        self._saved: LoaderState | None = None
        self._lock = threading.Lock()

    @property
    def step(self) -> int:
        return self.state.step

    def saved(self) -> LoaderState:
        """The state as a checkpoint holds it."""
        with self._lock:
            if self._saved is None:
                self._saved = self.state if self._finish is None else self._finish(self.state)
                self._finish = None
            return self._saved

    def lane(self, lane: int) -> LoaderState:
        """The saved state narrowed to one lane (the others' states are not copied)."""
        st = self.saved()
        return LoaderState(
            st.step,
            st.lanes,
            st.fingerprint,
            {lane: st.lane_states[lane]},
            st.mix_history,
            st.recipe,
            codecs=st.codecs,
        )

    def encoded(self) -> bytes:
        """The saved state's checkpoint bytes."""
        return encode_state(self.saved())


class LaneBytes:
    """One lane's state in a ``state_dict()``: checkpoint bytes of that lane alone, encoded when
    pickled or converted (``bytes(x)``), once. Equal to another with the same bytes, or to them."""

    __slots__ = ("_data", "_lane", "_snapshot")

    def __init__(self, snapshot: Snapshot, lane: int) -> None:
        self._snapshot = snapshot
        self._lane = lane
        self._data: bytes | None = None

    @property
    def step(self) -> int:
        return self._snapshot.step

    def state(self) -> LoaderState:
        """The lane's state, without encoding it."""
        return self._snapshot.lane(self._lane)

    def __bytes__(self) -> bytes:
        if self._data is None:
            self._data = encode_state(self.state())
        return self._data

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles as the bytes themselves, in the form pickle protocol 2 gives bytes, which
        # torch's weights-only unpickler allows: loading needs no zephon_flow class.
        return codecs.encode, (bytes(self).decode("latin-1"), "latin-1")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LaneBytes):
            return other is self or bytes(other) == bytes(self)
        if isinstance(other, bytes | bytearray | memoryview):
            return bytes(other) == bytes(self)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LaneBytes(lane={self._lane}, step={self.step})"


def lane_parts(snapshot: Snapshot | None, lanes: list[int]) -> dict[str, LaneBytes | bytes]:
    """``{str(lane): LaneBytes}`` for ``lanes`` (``FRESH`` where ``snapshot`` has no state)."""
    parts: dict[str, LaneBytes | bytes] = {}
    for lane in lanes:
        has = snapshot is not None and lane in snapshot.state.lane_states
        parts[str(lane)] = LaneBytes(snapshot, lane) if snapshot is not None and has else FRESH
    return parts
