"""Checkpoints as bytes and files: encoding, decoding, saving and loading a ``LoaderState``."""

from __future__ import annotations

import io
import os
from dataclasses import replace
from typing import IO, Any

from zephon_flow.core import files
from zephon_flow.core.checkpoint import blob, framed_file, manifest
from zephon_flow.core.checkpoint.derived_fields import DerivedCodecs
from zephon_flow.core.checkpoint.packed_segments import BUILTIN
from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.errors import CorruptStateError, StateError

#: The one file extension of checkpoints that zephon-flow writes (``zephon serve``, the demo).
CHECKPOINT_SUFFIX = ".zfstate"


def to_loader_state(state: Any) -> LoaderState:
    """Accepts a ``LoaderState``, its plain form (``Loader.state_dict()``, torch's door), or
    encoded checkpoint bytes (a state whose next-window checks are still pending is completed
    first)."""
    if isinstance(state, LoaderState):
        return state if state.checks is None else state.completed()
    if isinstance(state, bytes | bytearray | memoryview):
        return decode_state(bytes(state))
    if isinstance(state, str | os.PathLike):
        raise StateError(
            f"a state is a state_dict() (or merge_states of several, or checkpoint bytes), not a "
            f"path: read the checkpoint file with zf.load_state({os.fspath(state)!r})"
        )
    return LoaderState.from_plain(state)


def _header(state: LoaderState) -> dict[str, Any]:
    plain = {k: v for k, v in state.to_plain().items() if k != "lane_states"}
    return {**plain, "lane_ids": sorted(state.lane_states)}


def write_state(
    state: Any, out: IO[bytes], *, base: str | os.PathLike[str] | None = None, target: str | None = None
) -> framed_file.WriteStats:
    """Writes ``state`` to ``out`` lane by lane; ``base``: an earlier checkpoint file to write
    only the changes against, recorded by its path relative to the folder of ``target``, the
    file ``out`` will become (refused if it is a file of the base's chain: writing there would
    destroy a base the new checkpoint needs)."""
    st = to_loader_state(state)
    ref = None
    if base is not None:
        base_path = os.fspath(base)
        chain: list[str] = []
        header, index, digest = framed_file.row_index(base_path, files=chain)
        if target is not None and os.path.realpath(target) in chain:
            raise StateError(
                f"cannot save to {target}: it is a file of the chain of bases this checkpoint "
                f"would stand on ({' <- '.join(reversed(chain))}), so writing there would destroy a base "
                f"it needs; save to another path"
            )
        base_state = LoaderState.from_plain({**header, "lane_states": []})
        if base_state.lanes != st.lanes or base_state.fingerprint != st.fingerprint:
            raise StateError(
                f"base {base_path} was written for another pipeline or lane count than this state; "
                f"an incremental checkpoint needs a base of the same pipeline"
            )
        if base_state.recipe != st.recipe:
            raise StateError(
                f"base {base_path} is a {'recipe' if base_state.recipe else 'compact'} state and this "
                f"one is not; an incremental checkpoint needs a base of the same state_mode"
            )
        folder = os.path.dirname(os.path.abspath(target)) if target is not None else os.path.abspath(".")
        name = os.path.relpath(os.path.abspath(base_path), folder)
        ref = (framed_file.Base(name, digest), index)
    lanes = ((lane, st.lane_states[lane].to_plain()) for lane in sorted(st.lane_states))
    return framed_file.write(_header(st), lanes, out, base=ref, codecs=st.codecs)


def _only_a_state(state: Any, function: str) -> LoaderState:
    """``state`` if it is a ``LoaderState``; anything else is refused, naming what it is."""
    if isinstance(state, LoaderState):
        return state
    raise TypeError(
        f"zf.{function} takes a LoaderState (loader.state(), zf.load_state, zf.decode_state or "
        f"zf.merge_states), not a {type(state).__name__}"
        + (
            ": a state_dict() is the plain form torch stores; make it a LoaderState with "
            "zf.LoaderState.from_plain(state_dict) or zf.merge_states([...])"
            if isinstance(state, dict)
            else ""
        )
    )


def encode_state(state: LoaderState) -> bytes:
    """The checkpoint bytes of a ``LoaderState`` (anything else is refused: ``TypeError``)."""
    out = io.BytesIO()
    write_state(_only_a_state(state, "encode_state"), out)
    return out.getvalue()


def _read(
    stream: IO[bytes], source: str, path: str | None, chain: tuple[str, ...], codecs: DerivedCodecs
) -> tuple[LoaderState, dict[str, Any], str]:
    """The state in a checkpoint stream, its plain form and its sha256; ``path`` locates a base."""
    version, head = framed_file.read_version(stream, source)
    if version <= blob.BLOB_VERSION:
        data = head + stream.read()
        plain = blob.decode(data, source=source)
        try:
            st = LoaderState.from_plain(plain)  # validate structure now, with the source's name
        except CorruptStateError as exc:
            raise CorruptStateError(f"{source}: {exc}") from exc
        return replace(st, codecs=codecs), dict(plain), data[-32:].hex()
    stream.seek(0)
    digest = framed_file.verify(stream, source)
    framed_file.read_version(stream, source)
    opened = framed_file.open_v3(stream, source)
    header = opened.header
    base_lanes: dict[int, Any] | None = None
    if header["base"] is not None:
        base_lanes = _load_base(header, source, path, chain, codecs)
    lane_states = list(opened.lanes(base_lanes, codecs))
    opened.finish()
    plain = {k: v for k, v in header.items() if k not in ("lane_ids", "base")}
    plain["lane_states"] = lane_states
    try:
        st = LoaderState.from_plain(plain)
    except CorruptStateError as exc:
        raise CorruptStateError(f"{source}: {exc}") from exc
    if sorted(st.lane_states) != sorted(header["lane_ids"]):
        raise CorruptStateError(f"{source}: its lane frames do not match the lane ids in its header")
    return replace(st, codecs=codecs), plain, digest


def _load_base(
    header: dict[str, Any], source: str, path: str | None, chain: tuple[str, ...], codecs: DerivedCodecs
) -> dict[int, Any]:
    if path is None:
        framed_file.refuse_incremental_bytes(header, source)
    assert path is not None
    base = framed_file.base_of(header, path)
    assert base is not None
    framed_file.check_chain(source, base, chain)
    with open(base.path, "rb") as f:
        _, base_plain, digest = _read(f, base.path, base.path, (*chain, source), codecs)
    framed_file.check_base(source, base, digest)
    if base_plain["fingerprint"] != header.get("fingerprint") or base_plain["lanes"] != header.get("lanes"):
        raise CorruptStateError(f"{source}: its base {base.path} was written for another pipeline")
    return {ls["lane"]: ls for ls in base_plain["lane_states"]}


def decode_state(data: bytes, *, source: str = "checkpoint", codecs: DerivedCodecs = BUILTIN) -> LoaderState:
    """The state in checkpoint bytes; ``source`` names them in errors; ``codecs`` rebuild
    derived fields beyond the format's own (a pipeline's: ``spec.compile().derived_codecs``)."""
    return _read(io.BytesIO(data), source, None, (), codecs)[0]


def save_state(
    state: LoaderState, path: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None
) -> framed_file.WriteStats:
    """Writes a ``LoaderState`` (anything else is refused: ``TypeError``) as a checkpoint,
    atomically, lane by lane: temporary file, fsync, rename, fsync of the directory. With
    ``base`` (an earlier checkpoint file of the same pipeline) only what changed since is
    written; loading needs the base, next to where it was. Returns what was written."""
    _only_a_state(state, "save_state")
    target = os.fspath(path)
    return files.atomic_write(
        target,
        lambda f: write_state(state, f, base=base, target=target),
        prefix=".zephon-state-",
    )


def load_state(path: str | os.PathLike[str], *, codecs: DerivedCodecs = BUILTIN) -> LoaderState:
    """Reads a checkpoint file written by ``save_state`` lane by lane (following its bases, if
    incremental), or the manifest of one written in parts by lane owners (its parts checked
    against it); errors name the file."""
    name = os.fspath(path)
    if manifest.is_manifest(name):
        return manifest.read_manifest(name, lambda part: load_state(part, codecs=codecs))
    with open(name, "rb") as f:
        return _read(f, name, name, (), codecs)[0]
