"""Merging several ranks' checkpoints into one: the union of their lanes, checked to agree."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from zephon_flow.core.checkpoint import blob
from zephon_flow.core.checkpoint.state import LaneState, LoaderState
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.errors import FingerprintMismatchError, LaneCountMismatchError, StateConflictError


def merge_states(states: list[Any]) -> LoaderState:
    """Unions the lane states of several ranks' checkpoints into one ``LoaderState``; each is a
    ``LoaderState``, a ``Loader.state_dict()`` (torch's plain form) or checkpoint bytes.

    All must be for the same step and pipeline; ranks that share a lane must hold identical
    states for it, and agree on the check of its next window where both recorded one.
    """
    if not states:
        raise StateConflictError("merge_states needs at least one state")
    parsed = [to_loader_state(s) for s in states]
    first = parsed[0]
    merged: dict[int, LaneState] = {}
    digests: dict[int, str] = {}
    for i, st in enumerate(parsed):
        _check_alike(first, st, i)
        _add_lanes(merged, digests, st, i)
    return LoaderState(
        first.step,
        first.lanes,
        first.fingerprint,
        merged,
        first.mix_history,
        recipe=first.recipe,
        codecs=first.codecs,
    )


def _check_alike(first: LoaderState, st: LoaderState, i: int) -> None:
    """Refuses state ``i`` unless it is of ``first``'s step, lanes, pipeline, kind and mixture
    history."""
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
    if st.recipe != first.recipe:
        raise StateConflictError(
            f"cannot merge a recipe state with a compact one (state 0 is "
            f"{'recipe' if first.recipe else 'compact'}, state {i} is not): save every rank's "
            f"state with the same state_mode"
        )
    if st.mix_history != first.mix_history:
        raise StateConflictError(
            f"states disagree about the mixture history: state 0 has {first.mix_history!r}, "
            f"state {i} has {st.mix_history!r}"
        )


def _add_lanes(merged: dict[int, LaneState], digests: dict[int, str], st: LoaderState, i: int) -> None:
    """Adds state ``i``'s lanes to ``merged``: a lane already there must be identical (its
    canonical digest, in ``digests``, without the next window's check) and agree on that
    check where both recorded one; the one that recorded it is kept."""
    for lane, ls in st.lane_states.items():
        digest = blob.canonical_digest(replace(ls, next_window=None).to_plain())
        if lane in digests and digests[lane] != digest:
            raise StateConflictError(
                f"states disagree about lane {lane} at step {st.step} (state {i} differs)"
            )
        digests[lane] = digest
        known = merged.get(lane)
        mine, theirs = ls.next_window, None if known is None else known.next_window
        if known is not None and mine is None:
            continue  # a rank that did not record the next window's check defers to one that did
        if mine is not None and theirs is not None and mine.digest != theirs.digest:
            raise StateConflictError(
                f"states disagree about the next window of lane {lane} at step {st.step} (state "
                f"{i} recorded {mine.digest[:16]}..., an earlier state {theirs.digest[:16]}...): "
                f"the ranks made different windows"
            )
        merged[lane] = ls
