"""Typed lane and loader state, their plain-data form, and the file format around the codec."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from zephon_flow import codec
from zephon_flow.batches import SampleLayout
from zephon_flow.errors import (
    CorruptStateError,
    FingerprintMismatchError,
    FormatVersionError,
    LaneCountMismatchError,
    StateConflictError,
)

STATE_KIND = "zephon-flow/loader-state"


def _need(plain: Any, key: str, where: str) -> Any:
    if not isinstance(plain, dict):
        raise CorruptStateError(f"{where} should be a mapping, found {type(plain).__name__}")
    if key not in plain:
        raise CorruptStateError(f"{where} is missing {key!r}: the checkpoint is corrupt or incomplete")
    return plain[key]


def _int_list(plain: Any, where: str) -> list[int]:
    if not isinstance(plain, list) or not all(isinstance(v, int) for v in plain):
        raise CorruptStateError(f"{where} should be a list of integers, found {plain!r}")
    return [int(v) for v in plain]


@dataclass
class FeedCursor:
    """Where a lane's (mixed) source stream resumes: the first record not yet consumed.

    ``sources[i]`` is ``[pass, share, position, count]`` for source ``i`` (see
    ``runners/streams.py``: ``SourceReader``); ``skip``
    counts outputs of the record at the cursor that were already consumed, and ``source`` is
    that record's source when ``skip > 0`` (else -1), so a resume takes it from the same
    source whatever the mixture says at the resume step. ``exhausted`` lists the sources the
    lane's mix dropped (``Mix(exhausted="renormalize")``); ``skipped[i]`` counts the records
    of source ``i`` dropped by ``on_error="skip"``.
    """

    mix_position: int
    sources: list[list[int]]
    skip: int = 0
    source: int = -1
    exhausted: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def copy(self) -> FeedCursor:
        """A copy; the per-source cursors are shared: replace them, never
        mutate them in place."""
        return FeedCursor(
            self.mix_position,
            list(self.sources),
            self.skip,
            self.source,
            list(self.exhausted),
            list(self.skipped),
        )

    def to_plain(self) -> dict[str, Any]:
        return {
            "mix_position": self.mix_position,
            "sources": [list(s) for s in self.sources],
            "skip": self.skip,
            "source": self.source,
            "exhausted": list(self.exhausted),
            "skipped": list(self.skipped),
        }

    @classmethod
    def from_plain(cls, plain: Any, where: str) -> FeedCursor:
        sources = _need(plain, "sources", where)
        return cls(
            mix_position=int(_need(plain, "mix_position", where)),
            sources=[_int_list(s, f"{where}, source cursor") for s in sources],
            skip=int(_need(plain, "skip", where)),
            source=int(_need(plain, "source", where)),
            exhausted=[int(i) for i in _need(plain, "exhausted", where)],
            skipped=[int(n) for n in _need(plain, "skipped", where)],
        )


@dataclass
class LaneState:
    """Everything needed to continue one lane: cursor, stateful DoFns' state, open window.

    ``ended``: the lane's finite input has ended (its windows are padding from then on);
    ``layout``: the layout of the lane's first sample, for padding when no operator declares
    a padding sample (None until the lane made one).
    """

    lane: int
    cursor: FeedCursor
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)
    ended: bool = False
    layout: SampleLayout | None = None

    def to_plain(self) -> dict[str, Any]:
        return {
            "lane": self.lane,
            "cursor": self.cursor.to_plain(),
            "stages": self.stages,
            "pending": self.pending,
            "ended": self.ended,
            "layout": None if self.layout is None else self.layout.to_plain(),
        }

    @classmethod
    def from_plain(cls, plain: Any) -> LaneState:
        lane = int(_need(plain, "lane", "lane state"))
        where = f"state of lane {lane}"
        stages = _need(plain, "stages", where)
        for label, st in stages.items():
            for key in ("values", "timers", "position"):
                _need(st, key, f"{where}, stage {label!r}")
        return cls(
            lane=lane,
            cursor=FeedCursor.from_plain(_need(plain, "cursor", where), f"{where}, cursor"),
            stages=stages,
            pending=list(_need(plain, "pending", where)),
            ended=bool(_need(plain, "ended", where)),
            layout=_layout(_need(plain, "layout", where), where),
        )


def _layout(plain: Any, where: str) -> SampleLayout | None:
    return None if plain is None else SampleLayout.from_plain(plain, where=f"{where}, layout")


@dataclass
class LoaderState:
    """A checkpoint: the next step, the pipeline's identity, and the states of some lanes.

    ``mix_history`` is ``[[from_step, Mix params], ...]``, from step 0, one entry per mixture
    in force (a new one per accepted change on resume); empty for a pipeline without a Mix.
    """

    step: int
    lanes: int
    fingerprint: dict[str, str]
    lane_states: dict[int, LaneState]
    mix_history: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    def to_plain(self) -> dict[str, Any]:
        return {
            "kind": STATE_KIND,
            "format_version": codec.FORMAT_VERSION,
            "step": self.step,
            "lanes": self.lanes,
            "fingerprint": dict(self.fingerprint),
            "mix_history": [[step, params] for step, params in self.mix_history],
            "lane_states": [self.lane_states[k].to_plain() for k in sorted(self.lane_states)],
        }

    @classmethod
    def from_plain(cls, plain: Any) -> LoaderState:
        if _need(plain, "kind", "checkpoint") != STATE_KIND:
            raise CorruptStateError(f"checkpoint kind is {plain['kind']!r}, expected {STATE_KIND!r}")
        version = int(_need(plain, "format_version", "checkpoint"))
        if version > codec.FORMAT_VERSION:
            raise FormatVersionError(
                f"checkpoint format version {version} is newer than the version "
                f"{codec.FORMAT_VERSION} this zephon-flow reads; upgrade zephon-flow to load it"
            )
        if version < codec.FORMAT_VERSION:
            raise FormatVersionError(
                f"checkpoint format version {version} is older than the version "
                f"{codec.FORMAT_VERSION} this zephon-flow reads; it was written by an earlier "
                f"zephon-flow: resume it with that version, or start again"
            )
        states = [LaneState.from_plain(s) for s in _need(plain, "lane_states", "checkpoint")]
        history = []
        for entry in _need(plain, "mix_history", "checkpoint"):
            if not isinstance(entry, list | tuple) or len(entry) != 2 or not isinstance(entry[1], dict):
                raise CorruptStateError(f"checkpoint mix_history entry {entry!r} is not [step, params]")
            history.append((int(entry[0]), dict(entry[1])))
        return cls(
            step=int(_need(plain, "step", "checkpoint")),
            lanes=int(_need(plain, "lanes", "checkpoint")),
            fingerprint={str(k): str(v) for k, v in _need(plain, "fingerprint", "checkpoint").items()},
            lane_states={s.lane: s for s in states},
            mix_history=history,
        )

    def check_compatible(
        self,
        *,
        lanes: int,
        fingerprint: dict[str, str],
        mix_part: str | None = None,
        allow_mix_change: bool = False,
        allow_code_change: bool = False,
    ) -> bool:
        """Refuses a state written for another lane count or another pipeline, naming the part.

        ``mix_part`` names the fingerprint part of the pipeline's Mix: a state that differs
        only there is accepted with ``allow_mix_change`` (returns True: the mixture changes).
        Parts ``code <label>`` (the code of a user's function or DoFn) that differ are named
        ``operator <label>: code changed`` and accepted with ``allow_code_change``.
        """
        if self.lanes != lanes:
            raise LaneCountMismatchError(
                f"the checkpoint was written for lanes={self.lanes}, this spec has lanes={lanes}; "
                f"the lane count is part of a pipeline's identity and cannot change on resume"
            )
        if self.fingerprint == fingerprint:
            return False
        parts = sorted(set(self.fingerprint) | set(fingerprint))
        differ = [p for p in parts if p != "total" and self.fingerprint.get(p) != fingerprint.get(p)]
        code = [p for p in differ if p.startswith("code ")]
        if allow_code_change:
            differ = [p for p in differ if p not in code]
            if not differ:
                return False
        named = [f"operator {p[5:]}: code changed" if p in code else p for p in differ]
        message = (
            "the checkpoint was written for another pipeline; these parts of the fingerprint "
            f"differ: {', '.join(named) or 'total'}"
        )
        if code and not allow_code_change:
            old = [p for p in code if p not in self.fingerprint]
            if old:
                message += (
                    f" (the checkpoint has no digest of the code of {', '.join(p[5:] for p in old)}: "
                    f"it was written before zephon-flow fingerprinted code)"
                )
            message += (
                "; if the code change is deliberate (a fix or a refactor you accept for the rest "
                "of the run), pass allow_code_change=True to zf.Loader"
            )
        if mix_part is not None and differ == [mix_part]:
            if allow_mix_change:
                return True
            raise FingerprintMismatchError(
                f"{message}; if only the Mix's weights, schedule or interpolation changed, pass "
                f"allow_mix_change=True to zf.Loader to use the new mixture from step {self.step} on "
                f"(the change is recorded in the state)"
            )
        raise FingerprintMismatchError(message)


def merge_states(states: list[Any]) -> dict[str, Any]:
    """Unions the lane states of several ranks' checkpoints (plain dicts or bytes) into one.

    All must be for the same step and pipeline; ranks that share a lane must hold identical
    states for it.
    """
    if not states:
        raise StateConflictError("merge_states needs at least one state")
    parsed = [to_loader_state(s) for s in states]
    first = parsed[0]
    merged: dict[int, LaneState] = {}
    digests: dict[int, str] = {}
    for i, st in enumerate(parsed):
        if st.step != first.step:
            raise StateConflictError(
                f"cannot merge states of different steps: {first.step} (state 0) and {st.step} (state {i})"
            )
        if st.lanes != first.lanes:
            raise LaneCountMismatchError(
                f"cannot merge states for lanes={first.lanes} (state 0) and lanes={st.lanes} (state {i})"
            )
        if st.fingerprint != first.fingerprint:
            raise FingerprintMismatchError(f"state {i} was written for another pipeline than state 0")
        if st.mix_history != first.mix_history:
            raise StateConflictError(
                f"states disagree about the mixture history: state 0 has {first.mix_history!r}, "
                f"state {i} has {st.mix_history!r}"
            )
        for lane, ls in st.lane_states.items():
            digest = codec.canonical_digest(ls.to_plain())
            if lane in digests and digests[lane] != digest:
                raise StateConflictError(
                    f"states disagree about lane {lane} at step {st.step} (state {i} differs)"
                )
            digests[lane] = digest
            merged[lane] = ls
    return LoaderState(first.step, first.lanes, first.fingerprint, merged, first.mix_history).to_plain()


def to_loader_state(state: Any) -> LoaderState:
    """Accepts a ``LoaderState``, its plain form, or encoded checkpoint bytes."""
    if isinstance(state, LoaderState):
        return state
    if isinstance(state, bytes | bytearray | memoryview):
        state = codec.decode(bytes(state))
    return LoaderState.from_plain(state)


def encode_state(state: Any) -> bytes:
    """The checkpoint bytes of a state (plain dict as returned by ``Loader.state_dict``)."""
    return codec.encode(to_loader_state(state).to_plain())


def decode_state(data: bytes, *, source: str = "checkpoint") -> dict[str, Any]:
    """The plain state in checkpoint bytes; ``source`` names them in errors."""
    plain = codec.decode(data, source=source)
    LoaderState.from_plain(plain)  # validate structure now, with the source's name
    return dict(plain)


def save_state(state: Any, path: str | os.PathLike[str]) -> None:
    """Writes a checkpoint atomically: temporary file, fsync, rename."""
    data = encode_state(state)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".zephon-state-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a checkpoint file written by ``save_state``; errors name the file."""
    with open(path, "rb") as f:
        return decode_state(f.read(), source=str(path))
