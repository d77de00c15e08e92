"""A checkpoint written in parts: each lane owner writes its own lanes' part, and a small
manifest names the parts and their sha256.

The manifest is the checkpoint's one file (``zf.load_state`` reads it as any checkpoint): a
JSON object of kind ``MANIFEST_KIND`` with the step, the lane count, the pipeline's total
fingerprint and, per part, its file (relative to the manifest's folder), its sha256 and its
lanes. The parts are ordinary checkpoint files of some lanes each, in the folder
``<manifest>.parts/``. Reading checks every part against its sha256 and the manifest, and
that the parts hold every lane exactly once; a part missing or changed is refused by name.
This module does not read or write state files itself: it is handed the functions that do.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zephon_flow.core import files
from zephon_flow.core.checkpoint.state import LaneState, LoaderState
from zephon_flow.core.errors import CorruptStateError, StateError

MANIFEST_KIND = "zephon-flow/loader-state+manifest"
MANIFEST_VERSION = 1
#: A manifest is JSON that starts with its kind: enough of its head to tell it from a state.
_INDENT = 1
_HEAD = json.dumps({"kind": MANIFEST_KIND}, indent=_INDENT).rstrip("\n}").encode()


@dataclass(frozen=True)
class Part:
    """One part of a checkpoint: its file (relative to the manifest's folder), the file's
    sha256, and the lanes it holds."""

    file: str
    sha256: str
    lanes: tuple[int, ...]

    def to_plain(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256, "lanes": list(self.lanes)}


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def part_path(manifest: str, index: int) -> str:
    """Where part ``index`` of the checkpoint whose manifest is ``manifest`` is written."""
    return os.path.join(manifest + ".parts", f"part-{index}.zfstate")


def write_part(
    state: LoaderState,
    manifest: str,
    index: int,
    save: Callable[[LoaderState, str, str | None], Any],
    *,
    base: str | None = None,
) -> Part:
    """Writes ``state`` (some lanes of a checkpoint) with ``save(state, path, base)`` as part
    ``index`` of the checkpoint whose manifest will be ``manifest``; with ``base`` (an earlier
    manifest) the part holds only what changed since that checkpoint's part of the same index,
    when there is one. Returns what the manifest records of it."""
    path = part_path(manifest, index)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    earlier = None if base is None else part_path(base, index)
    save(state, path, earlier if earlier is not None and os.path.exists(earlier) else None)
    where = os.path.dirname(os.path.abspath(manifest))
    return Part(os.path.relpath(path, where), sha256_of(path), tuple(sorted(state.lane_states)))


def write_manifest(path: str, *, step: int, lanes: int, fingerprint: str, parts: list[Part]) -> None:
    """Writes the manifest of a checkpoint at ``step`` whose ``parts`` are written (atomically:
    a reader sees the old manifest or this one, never a part of it)."""
    held = sorted(lane for part in parts for lane in part.lanes)
    if held != list(range(lanes)):
        raise StateError(f"{path}: the parts hold lanes {held}, not each of 0..{lanes - 1} once")
    body = {
        "kind": MANIFEST_KIND,
        "version": MANIFEST_VERSION,
        "step": step,
        "lanes": lanes,
        "fingerprint": fingerprint,
        "parts": [part.to_plain() for part in parts],
    }
    text = json.dumps(body, indent=_INDENT).encode()
    files.atomic_write(path, lambda f: f.write(text), prefix=".zephon-manifest-")


def is_manifest(path: str) -> bool:
    """Whether the checkpoint file ``path`` is a manifest (read from its first bytes)."""
    with open(path, "rb") as f:
        return f.read(len(_HEAD)) == _HEAD


def read_manifest(path: str, load: Callable[[str], LoaderState]) -> LoaderState:
    """The checkpoint whose manifest is ``path``: its parts read with ``load``, checked against
    their sha256 and the manifest, and joined into one state."""
    body = _body(path)
    where = os.path.dirname(os.path.abspath(path))
    states: list[LoaderState] = []
    for part in body["parts"]:
        part_path = os.path.join(where, part["file"])
        if not os.path.exists(part_path):
            raise StateError(f"{path}: its part {part['file']} is missing (looked for {part_path})")
        if sha256_of(part_path) != part["sha256"]:
            raise CorruptStateError(
                f"{path}: its part {part['file']} was changed or damaged since it was written "
                f"(sha256 differs from the manifest's)"
            )
        state = load(part_path)
        if (state.step, state.lanes) != (body["step"], body["lanes"]) or sorted(state.lane_states) != sorted(
            part["lanes"]
        ):
            raise CorruptStateError(f"{path}: its part {part['file']} is not of this checkpoint")
        if state.fingerprint.get("total") != body["fingerprint"]:
            raise CorruptStateError(f"{path}: its part {part['file']} was written for another pipeline")
        states.append(state)
    return _joined(path, body, states)


def _body(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read())
        parts = body["parts"]
        ok = (
            body["kind"] == MANIFEST_KIND
            and isinstance(body["step"], int)
            and isinstance(body["lanes"], int)
            and isinstance(body["fingerprint"], str)
            and isinstance(parts, list)
            and bool(parts)
            and all(isinstance(p["file"], str) and isinstance(p["sha256"], str) for p in parts)
            and all(isinstance(p["lanes"], list) for p in parts)
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptStateError(
            f"{path}: a damaged checkpoint manifest ({type(exc).__name__}: {exc})"
        ) from None
    if not ok:
        raise CorruptStateError(f"{path}: a damaged checkpoint manifest (a field has the wrong type)")
    if body.get("version") != MANIFEST_VERSION:
        raise StateError(
            f"{path}: a checkpoint manifest of version {body.get('version')!r}; this zephon-flow "
            f"reads version {MANIFEST_VERSION}"
        )
    return dict(body)


def _joined(path: str, body: dict[str, Any], states: list[LoaderState]) -> LoaderState:
    """The parts' lanes in one state (they agree on everything else)."""
    first = states[0]
    lanes: dict[int, LaneState] = {}
    for state in states:
        if (state.fingerprint, state.mix_history, state.recipe) != (
            first.fingerprint,
            first.mix_history,
            first.recipe,
        ):
            raise CorruptStateError(f"{path}: its parts disagree on the pipeline or its mixture history")
        lanes.update(state.lane_states)
    if sorted(lanes) != list(range(body["lanes"])):
        raise CorruptStateError(f"{path}: its parts hold lanes {sorted(lanes)}, not 0..{body['lanes'] - 1}")
    return LoaderState(
        first.step,
        first.lanes,
        dict(first.fingerprint),
        lanes,
        list(first.mix_history),
        recipe=first.recipe,
        codecs=first.codecs,
    )
