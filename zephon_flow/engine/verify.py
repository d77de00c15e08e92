"""``zephon verify``: a checkpoint's lanes run to their first window, offline, and compared with
the checks the checkpoint recorded (the same check a resume makes, without training)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zephon_flow.core.checkpoint.state import LaneState, LoaderState
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.errors import ResumeMismatchError, SpecError
from zephon_flow.engine.loader import build_lane_runners, restore_lanes
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.runners.backends import make_backend
from zephon_flow.runners.lane import LaneRunner, prime_lanes
from zephon_flow.runners.streams import CHUNK_RECORDS

#: A lane's verdict: its first window is the recorded one, is not, or cannot be told.
OK, MISMATCH, UNVERIFIABLE = "ok", "mismatch", "unverifiable"


@dataclass(frozen=True)
class LaneVerdict:
    """One lane's result: ``verdict`` (``ok``, ``mismatch``, ``unverifiable``), the check
    recorded (hex, empty if none) and, for a mismatch, what changed."""

    lane: int
    step: int
    verdict: str
    recorded: str
    message: str = ""
    seconds: float = 0.0


def verify_state(
    spec: LoaderSpec,
    state: LoaderState | bytes | Mapping[str, Any],
    *,
    lanes: Sequence[int] | None = None,
    backend: str = "inline",
    workers: int = 1,
) -> list[LaneVerdict]:
    """Runs each of ``lanes`` (default: every lane the state holds) from ``state`` to its first
    window and compares it with the check the state recorded. A state for another pipeline is
    refused as a resume would refuse it (``FingerprintMismatchError``, ...)."""
    loaded = to_loader_state(state)
    ids = sorted(loaded.lane_states) if lanes is None else sorted(set(lanes))
    wrong = [lane for lane in ids if lane not in loaded.lane_states]
    if wrong:
        raise SpecError(
            f"the checkpoint holds lanes {sorted(loaded.lane_states)}; it has no state for lane(s) {wrong}"
        )
    plan = spec.compile()
    backend_ = make_backend(backend, workers=workers, segment=plan.front_segment())
    try:
        start = restore_lanes(
            spec, plan, loaded, ids, who="zephon verify", submit=backend_.submit, verify=True, quiet=True
        )
        runners = build_lane_runners(
            spec, plan, backend_, start, chunk_records=CHUNK_RECORDS, depth=8, on_skip=_ignore
        )
        try:
            prime_lanes(runners)
            verdicts = [_verdict(runner, start.lanes[runner.lane], loaded.step) for runner in runners]
        finally:
            for runner in runners:
                runner.close()
    finally:
        backend_.close()
    return verdicts


def _verdict(runner: LaneRunner, recorded: LaneState | None, step: int) -> LaneVerdict:
    """Lane ``runner``'s first window from ``recorded`` against the check it recorded."""
    check = None if recorded is None else recorded.next_window
    begun = time.perf_counter()
    if check is None:
        return LaneVerdict(runner.lane, step, UNVERIFIABLE, "")
    try:
        runner.next_window()
    except ResumeMismatchError as exc:
        return LaneVerdict(runner.lane, step, MISMATCH, check.digest, str(exc), time.perf_counter() - begun)
    return LaneVerdict(runner.lane, step, OK, check.digest, "", time.perf_counter() - begun)


def _ignore(source: int, message: str) -> None:
    pass


def render(verdicts: list[LaneVerdict]) -> str:
    """One line per lane, then a summary line."""
    lines = []
    for v in verdicts:
        if v.verdict == OK:
            lines.append(f"lane {v.lane}: OK at step {v.step} (next window {v.recorded})")
        elif v.verdict == UNVERIFIABLE:
            lines.append(
                f"lane {v.lane}: NOT VERIFIABLE at step {v.step}: the checkpoint records no check of its "
                f"next window (written before zephon-flow recorded one)"
            )
        else:
            lines.append(f"lane {v.lane}: MISMATCH: {v.message}")
    bad = [v.lane for v in verdicts if v.verdict != OK]
    lines.append(
        f"{len(verdicts) - len(bad)} of {len(verdicts)} lane(s) resume onto the recorded stream"
        + ("" if not bad else f"; not proven: lane(s) {bad}")
    )
    return "\n".join(lines)
