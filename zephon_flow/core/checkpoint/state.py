"""Typed lane and loader state and their plain-data form: what a checkpoint holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from zephon_flow.core.batches import SampleLayout
from zephon_flow.core.checkpoint import FORMAT_VERSION
from zephon_flow.core.checkpoint.derived_fields import DerivedCodecs
from zephon_flow.core.checkpoint.packed_segments import BUILTIN
from zephon_flow.core.checkpoint.window_check import PendingChecks, WindowCheck
from zephon_flow.core.errors import (
    CorruptStateError,
    FingerprintMismatchError,
    FormatVersionError,
    LaneCountMismatchError,
)
from zephon_flow.core.source import START

STATE_KIND = "zephon-flow/loader-state"
#: The kind of a recipe state (``state_mode="recipe"``): buffered sequences are stored as the
#: documents they came from (``core/recipe.py``) and rebuilt by re-reading them. A reader that
#: does not know recipes refuses the kind instead of misreading the state.
RECIPE_KIND = "zephon-flow/loader-state+recipe"


#: The oldest format whose plain state this version reads (format 3 changed only the bytes).
OLDEST_READ = 2


def _need(plain: Any, key: str, where: str) -> Any:
    if not isinstance(plain, dict):
        raise CorruptStateError(f"{where} should be a mapping, found {type(plain).__name__}")
    if key not in plain:
        raise CorruptStateError(f"{where} is missing {key!r}: the checkpoint is corrupt or incomplete")
    return plain[key]


def _int(value: Any, where: str, *, minimum: int | None = 0) -> int:
    """``value`` as an int (a Python or numpy integer, not a bool), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise CorruptStateError(f"{where} should be an integer, found {str(value)[:60]!r}")
    if minimum is not None and value < minimum:
        raise CorruptStateError(f"{where} is {value}, it cannot be below {minimum}")
    return int(value)


def _ints(value: Any, where: str, *, minimum: int | None = 0) -> list[int]:
    if not isinstance(value, list | tuple):
        raise CorruptStateError(f"{where} should be a list of integers, found {type(value).__name__}")
    return [_int(v, f"{where}[{i}]", minimum=minimum) for i, v in enumerate(value)]


def _mapping(value: Any, where: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise CorruptStateError(f"{where} should be a mapping, found {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class SourceCursor:
    """Where a lane's reading of one source resumes: the pass (``epoch``), the index of the
    share in the lane's shares of that pass (``share``), the source's position inside that
    share's split (``START`` at its beginning) and how many records of the split were read
    before that position (``count``; a stride-shared split keeps every ``of``-th of them).

    A checkpoint stores it as the list ``[pass, share, position, count]``.
    """

    epoch: int
    share: int
    position: int
    count: int

    @classmethod
    def first(cls) -> SourceCursor:
        """The cursor of a lane that has read nothing of the source."""
        return cls(0, 0, START, 0)

    def to_plain(self) -> list[int]:
        return [self.epoch, self.share, self.position, self.count]

    @classmethod
    def from_plain(cls, plain: Any, where: str) -> SourceCursor:
        values = _ints(plain, where, minimum=START)
        if len(values) != 4:
            raise CorruptStateError(
                f"{where}: a cursor of {len(values)} integers is malformed, a source cursor is "
                f"[pass, share, position, count]"
            )
        return cls(*values)


@dataclass
class FeedCursor:
    """Where a lane's (mixed) source stream resumes: the first record not yet consumed.

    ``sources[i]`` is where source ``i`` resumes (``SourceCursor``); ``skip``
    counts outputs of the record at the cursor that were already consumed, and ``source`` is
    that record's source when ``skip > 0`` (else -1), so a resume takes it from the same
    source whatever the mixture says at the resume step. ``exhausted`` lists the sources the
    lane's mix dropped (``Mix(exhausted="renormalize")``); ``skipped[i]`` counts the records
    of source ``i`` dropped by ``on_error="skip"``.
    """

    mix_position: int
    sources: list[SourceCursor]
    skip: int = 0
    source: int = -1
    exhausted: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def copy(self) -> FeedCursor:
        """A copy (the per-source cursors are immutable, so shared)."""
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
            "sources": [s.to_plain() for s in self.sources],
            "skip": self.skip,
            "source": self.source,
            "exhausted": list(self.exhausted),
            "skipped": list(self.skipped),
        }

    @classmethod
    def from_plain(cls, plain: Any, where: str) -> FeedCursor:
        sources = _need(plain, "sources", where)
        if not isinstance(sources, list | tuple):
            raise CorruptStateError(f"{where}: sources should be a list, found {type(sources).__name__}")
        cursors = [SourceCursor.from_plain(c, f"{where}, source {i}") for i, c in enumerate(sources)]
        skipped = _ints(_need(plain, "skipped", where), f"{where}, skipped")
        exhausted = _ints(_need(plain, "exhausted", where), f"{where}, exhausted")
        if len(skipped) != len(cursors) or any(i >= len(cursors) for i in exhausted):
            raise CorruptStateError(
                f"{where}: {len(cursors)} source cursor(s), {len(skipped)} skip count(s) and "
                f"exhausted sources {exhausted} do not agree"
            )
        skip = _int(_need(plain, "skip", where), f"{where}, skip")
        source = _int(_need(plain, "source", where), f"{where}, source", minimum=-1)
        if skip and not 0 <= source < len(cursors):
            raise CorruptStateError(f"{where}: skip {skip} names source {source}, which has no cursor")
        return cls(
            mix_position=_int(_need(plain, "mix_position", where), f"{where}, mix_position"),
            sources=cursors,
            skip=skip,
            source=source,
            exhausted=exhausted,
            skipped=skipped,
        )


@dataclass
class StageState:
    """One stateful DoFn's state in one lane, as a checkpoint holds it: its Beam user state
    values (plain data), its timers' deadlines and how many elements it has seen."""

    values: dict[str, Any] = field(default_factory=dict)
    timers: dict[str, int] = field(default_factory=dict)
    position: int = 0

    def to_plain(self) -> dict[str, Any]:
        return {"values": self.values, "timers": dict(self.timers), "position": self.position}

    @classmethod
    def from_plain(cls, plain: Any, where: str) -> StageState:
        values = _mapping(_need(plain, "values", where), f"{where}, values")
        timers = _mapping(_need(plain, "timers", where), f"{where}, timers")
        return cls(
            values=dict(values),
            timers={
                str(name): _int(t, f"{where}, timer {name!r}", minimum=None) for name, t in timers.items()
            },
            position=_int(_need(plain, "position", where), f"{where}, position"),
        )


@dataclass
class LaneState:
    """Everything needed to continue one lane: cursor, stateful DoFns' state, open window.

    ``ended``: the lane's finite input has ended (its windows are padding from then on);
    ``layout``: the layout of the lane's first sample, for padding when no operator declares
    a padding sample (None until the lane made one); ``next_window``: the check of the window
    the lane makes next (``core/checkpoint/window_check.py``), which a restore verifies (None: not known,
    e.g. a checkpoint written before zephon-flow recorded it; such a resume is not verified).
    """

    lane: int
    cursor: FeedCursor
    stages: dict[str, StageState] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)
    ended: bool = False
    layout: SampleLayout | None = None
    next_window: WindowCheck | None = None

    def to_plain(self) -> dict[str, Any]:
        plain = {
            "lane": self.lane,
            "cursor": self.cursor.to_plain(),
            "stages": {label: st.to_plain() for label, st in self.stages.items()},
            "pending": self.pending,
            "ended": self.ended,
            "layout": None if self.layout is None else self.layout.to_plain(),
        }
        if self.next_window is not None:  # an optional key: readers before it ignore it
            plain["next_window"] = self.next_window.to_plain()
        return plain

    @classmethod
    def from_plain(cls, plain: Any, version: int = FORMAT_VERSION) -> LaneState:
        """The lane state ``to_plain`` gave, as written by checkpoint format ``version``
        (before version 3 a lane had no ``layout``)."""
        lane = _int(_need(plain, "lane", "lane state"), "lane state's lane")
        where = f"state of lane {lane}"
        stages: dict[str, StageState] = {}
        for label, st in _mapping(_need(plain, "stages", where), f"{where}, stages").items():
            if not isinstance(label, str):
                raise CorruptStateError(f"{where}: stage label {label!r} is not a string")
            stages[label] = StageState.from_plain(st, f"{where}, stage {label!r}")
        pending = _need(plain, "pending", where)
        ended = _need(plain, "ended", where)
        if not isinstance(pending, list) or not isinstance(ended, bool):
            raise CorruptStateError(f"{where}: pending should be a list and ended a bool")
        layout = _need(plain, "layout", where) if version >= 3 else None
        check = plain.get("next_window")
        return cls(
            lane=lane,
            cursor=FeedCursor.from_plain(_need(plain, "cursor", where), f"{where}, cursor"),
            stages=stages,
            pending=list(pending),
            ended=ended,
            layout=None if layout is None else SampleLayout.from_plain(layout, where=f"{where}, layout"),
            next_window=None if check is None else WindowCheck.from_plain(check, f"{where}, next_window"),
        )


@dataclass
class LoaderState:
    """A checkpoint: the next step, the pipeline's identity, and the states of some lanes.

    ``mix_history`` is ``[[from_step, Mix params], ...]``, from step 0, one entry per mixture
    in force (a new one per accepted change on resume); empty for a pipeline without a Mix.
    ``recipe``: the lanes' buffered sequences are recipes (kind ``RECIPE_KIND``), to be rebuilt
    with the pipeline (``engine/recipe.py``) before the lanes run.
    ``checks``: at run time, the checks of the lanes' next windows while they are being made
    (``completed`` waits for them and puts them in the lane states); never stored.
    ``codecs``: the derived-field codecs of the pipeline (its plan's, or those it was read
    with), which encoding it offers its element lists; never stored.
    """

    step: int
    lanes: int
    fingerprint: dict[str, str]
    lane_states: dict[int, LaneState]
    mix_history: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    recipe: bool = False
    checks: PendingChecks | None = field(default=None, repr=False, compare=False)
    codecs: DerivedCodecs = field(default=BUILTIN, repr=False, compare=False)

    def completed(self, alive: Callable[[], bool] | None = None) -> LoaderState:
        """This state with each lane's ``next_window`` check, once its lanes made their next
        windows (waits for them while ``alive()``, by default while the loader that took the
        state is producing: at most the making of one window, usually not at all, as the
        producer runs ahead); unchanged if they will never be made. Writing, encoding,
        merging and ``to_plain`` complete a state first."""
        if self.checks is None:
            return self
        found = self.checks.wait(alive)
        if not found:
            return replace(self, checks=None)
        lanes = {
            lane: ls if lane not in found else replace(ls, next_window=found[lane])
            for lane, ls in self.lane_states.items()
        }
        return replace(self, lane_states=lanes, checks=None)

    def to_plain(self) -> dict[str, Any]:
        if self.checks is not None:
            return self.completed()._plain()
        return self._plain()

    def _plain(self) -> dict[str, Any]:
        return {
            "kind": RECIPE_KIND if self.recipe else STATE_KIND,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "lanes": self.lanes,
            "fingerprint": dict(self.fingerprint),
            "mix_history": [[step, params] for step, params in self.mix_history],
            "lane_states": [self.lane_states[k].to_plain() for k in sorted(self.lane_states)],
        }

    @classmethod
    def from_plain(cls, plain: Any) -> LoaderState:
        kind = _need(plain, "kind", "checkpoint")
        if kind not in (STATE_KIND, RECIPE_KIND):
            raise CorruptStateError(
                f"checkpoint kind is {str(kind)[:60]!r}, expected {STATE_KIND!r} or {RECIPE_KIND!r}"
            )
        version = _int(_need(plain, "format_version", "checkpoint"), "checkpoint format_version")
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                f"checkpoint format version {version} is newer than the version "
                f"{FORMAT_VERSION} this zephon-flow reads; upgrade zephon-flow to load it"
            )
        if version < OLDEST_READ:
            raise FormatVersionError(
                f"checkpoint format version {version} is older than the oldest version "
                f"{OLDEST_READ} this zephon-flow reads; it was written by an earlier "
                f"zephon-flow: resume it with that version, or start again"
            )
        step = _int(_need(plain, "step", "checkpoint"), "checkpoint step")
        lanes = _int(_need(plain, "lanes", "checkpoint"), "checkpoint lanes", minimum=1)
        raw_states = _need(plain, "lane_states", "checkpoint")
        if not isinstance(raw_states, list):
            raise CorruptStateError("checkpoint lane_states should be a list")
        states = [LaneState.from_plain(s, version) for s in raw_states]
        ids = [s.lane for s in states]
        if len(set(ids)) != len(ids) or any(i >= lanes for i in ids):
            raise CorruptStateError(
                f"checkpoint lane states are for lanes {ids}: each must appear once and be below "
                f"lanes={lanes}"
            )
        history = []
        entries = _need(plain, "mix_history", "checkpoint")
        if not isinstance(entries, list | tuple):
            raise CorruptStateError("checkpoint mix_history should be a list of [step, params]")
        for entry in entries:
            if not isinstance(entry, list | tuple) or len(entry) != 2 or not isinstance(entry[1], dict):
                raise CorruptStateError(
                    f"checkpoint mix_history entry {str(entry)[:80]} is not [step, params]"
                )
            history.append((_int(entry[0], "checkpoint mix_history step"), dict(entry[1])))
        fingerprint = _mapping(_need(plain, "fingerprint", "checkpoint"), "checkpoint fingerprint")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in fingerprint.items()):
            raise CorruptStateError("checkpoint fingerprint should map strings to strings")
        return cls(
            step=step,
            lanes=lanes,
            fingerprint=dict(fingerprint),
            lane_states={s.lane: s for s in states},
            mix_history=history,
            recipe=kind == RECIPE_KIND,
        )

    def check_compatible(
        self,
        *,
        lanes: int,
        fingerprint: dict[str, str],
        mix_part: str | None = None,
        allow_mix_change: bool = False,
        allow_code_change: bool = False,
        allow_batch_change: bool = False,
    ) -> bool:
        """Refuses a state written for another lane count or another pipeline, naming the part.

        ``mix_part`` names the fingerprint part of the pipeline's Mix: a state that differs
        only there is accepted with ``allow_mix_change`` (returns True: the mixture changes).
        Parts ``code <label>`` (the code of a user's function or DoFn) that differ are named
        ``operator <label>: code changed`` and accepted with ``allow_code_change``. The part
        ``global_batch_size`` (an int or a schedule) that differs is accepted with
        ``allow_batch_change``: the new sizes apply from the state's step on.
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
        if allow_batch_change:
            differ = [p for p in differ if p != _BATCH_PART]
        if (allow_code_change or allow_batch_change) and not differ:
            return False
        named = _named_parts(differ, code)
        message = (
            "the checkpoint was written for another pipeline; these parts of the fingerprint "
            f"differ: {', '.join(named) or 'total'}"
        )
        if code and not allow_code_change:
            message += _code_change_hint(self.fingerprint, code)
        if _BATCH_PART in differ:
            message += (
                f"; if only the global batch size or its schedule changed, pass "
                f"allow_batch_change=True to zf.Loader to use the new sizes from step {self.step} on"
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


#: The fingerprint part of ``LoaderSpec.global_batch_size`` (an int or a schedule).
_BATCH_PART = "global_batch_size"


def _code_change_hint(recorded: dict[str, str], code: list[str]) -> str:
    """What the refusal of a code change adds: the code ``recorded`` (the checkpoint's
    fingerprint) has no digest of, and how to accept the change."""
    message = ""
    old = [p for p in code if p not in recorded and " :: " not in p]
    if old:
        message += (
            f" (the checkpoint has no digest of the code of {', '.join(p[5:] for p in old)}: "
            f"it was written before zephon-flow fingerprinted code)"
        )
    unreached = sorted(
        {
            label
            for p in code
            for label in [p[5:].partition(" :: ")[0]]
            if " :: " in p
            and f"code {label}" in recorded
            and not any(q.startswith(f"code {label} :: ") for q in recorded)
        }
    )
    if unreached:
        message += (
            f" (the checkpoint has no digests of what the code of {', '.join(unreached)} "
            f"reaches: it was written before zephon-flow fingerprinted a DoFn's helpers)"
        )
    message += (
        "; if the code change is deliberate (a fix or a refactor you accept for the rest "
        "of the run), pass allow_code_change=True to zf.Loader"
    )
    return message


def _named_parts(differ: list[str], code: list[str]) -> list[str]:
    """The differing parts as a refusal names them: code parts per operator, ``operator
    <label>: code changed``, followed by the helpers whose code changed (parts ``code <label>
    :: helper cut in module m``) as ``(helper cut in module m, ...)``."""
    named: list[str] = []
    helpers: dict[str, list[str]] = {}
    for p in differ:
        if p not in code:
            named.append(p)
            continue
        label, _, what = p[5:].partition(" :: ")
        if label not in helpers:
            helpers[label] = []
            named.append(f"code {label}")
        if what:
            helpers[label].append(what)
    return [
        f"operator {n[5:]}: code changed" + (f" ({', '.join(helpers[n[5:]])})" if helpers[n[5:]] else "")
        if n.startswith("code ") and n[5:] in helpers
        else n
        for n in named
    ]
