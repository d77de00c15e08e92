"""Fuzzing the checkpoint decoder: random and mutated (resealed) checkpoints raise only our errors,
and the decoder checks the consistency of what it decodes, not only the checksum."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import struct
from typing import Any

import numpy as np
import pytest
import zstandard
from helpers import Corpus, example_spec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import zephon_flow as zf
from zephon_flow.core.checkpoint import FORMAT_VERSION, blob
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.errors import CorruptStateError, StateError
from zephon_flow.engine.simulate import global_digests

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def plain(corpus: Corpus) -> dict[str, Any]:
    final: list[dict[str, Any]] = []
    global_digests(example_spec(corpus, lanes=2, global_batch_size=4, buffer=3), steps=3, final_state=final)
    return final[0]


@pytest.fixture(scope="module")
def v3(plain: dict[str, Any]) -> bytes:
    return zf.encode_state(zf.LoaderState.from_plain(plain))


@pytest.fixture(scope="module")
def v2(plain: dict[str, Any]) -> bytes:
    return blob.encode({**to_loader_state(plain).to_plain(), "format_version": 2})


def reseal(data: bytes) -> bytes:
    """The same bytes with a valid checksum again (what a crafted file would have)."""
    return data[:-32] + hashlib.sha256(data[:-32]).digest()


def split_frames(data: bytes) -> list[bytes]:
    """The raw (decompressed) frames of a format-3 checkpoint."""
    stream = io.BytesIO(data[12:-32])
    out = []
    while stream.tell() < len(data) - 44:
        size, _ = struct.unpack("<QQ", stream.read(16))
        out.append(zstandard.ZstdDecompressor().decompressobj().decompress(stream.read(size)))
    return out


def join_frames(frames: list[bytes], version: int = 3) -> bytes:
    body = struct.pack("<8sI", blob.MAGIC, version)
    for raw in frames:
        packed = zstandard.ZstdCompressor().compress(raw)
        body += struct.pack("<QQ", len(packed), len(raw)) + packed
    return body + hashlib.sha256(body).digest()


def frame_json(raw: bytes) -> tuple[Any, bytes]:
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def frame_of(tree: Any, payload: bytes) -> bytes:
    head = json.dumps(tree).encode()
    return struct.pack("<Q", len(head)) + head + payload


def only_our_errors(data: bytes) -> None:
    with contextlib.suppress(StateError):
        zf.decode_state(data)


# -- random and mutated bytes ---------------------------------------------------------------
@FUZZ
@given(
    st.binary(max_size=300),
    st.sampled_from([b"", blob.MAGIC, blob.MAGIC + b"\x03\0\0\0", blob.MAGIC + b"\x02\0\0\0"]),
)
def test_random_bytes_raise_only_state_errors(data: bytes, prefix: bytes) -> None:
    only_our_errors(prefix + data)
    only_our_errors(reseal(prefix + data + bytes(32)))


mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "insert", "delete", "truncate"]),
        st.integers(0, 1 << 30),
        st.integers(0, 255),
    ),
    min_size=1,
    max_size=4,
)


def mutate(data: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, where, value in edits:
        i = where % max(len(out), 1)
        if kind == "flip" and out:
            out[i] ^= value or 1
        elif kind == "insert":
            out[i:i] = bytes([value])
        elif kind == "delete" and out:
            del out[i]
        elif kind == "truncate":
            del out[i:]
    return bytes(out)


@FUZZ
@given(edits=mutations)
def test_mutated_checkpoints_raise_only_state_errors(
    v3: bytes, v2: bytes, edits: list[tuple[str, int, int]]
) -> None:
    for data in (v3, v2):
        damaged = mutate(data, edits)
        if damaged != data:
            with pytest.raises(StateError):  # corrupt (or, if the version changed, a newer format)
                zf.decode_state(damaged)
        only_our_errors(reseal(damaged))  # crafted: the checksum is valid again


@FUZZ
@given(edits=mutations, which=st.integers(0, 10))
def test_mutated_frames_raise_only_state_errors(
    v3: bytes, edits: list[tuple[str, int, int]], which: int
) -> None:
    frames = split_frames(v3)
    i = which % len(frames)
    frames[i] = mutate(frames[i], edits)
    only_our_errors(join_frames(frames))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["~a", "~c", "~b", "~f", "~t", "~d", "x", "n"]), inner, max_size=3)
    ),
    max_leaves=8,
)


def paths(tree: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            out += paths(v, (*at, i))
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out += paths(v, (*at, k))
    return out


def replaced(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, list):
        return [replaced(v, rest, value) if i == head else v for i, v in enumerate(tree)]
    return {k: replaced(v, rest, value) if k == head else v for k, v in tree.items()}


@FUZZ
@given(which=st.integers(0, 10), where=st.integers(0, 1 << 20), value=json_values)
def test_structurally_mutated_frames_raise_only_state_errors(
    v3: bytes, which: int, where: int, value: Any
) -> None:
    frames = split_frames(v3)
    i = which % len(frames)
    tree, payload = frame_json(frames[i])
    places = paths(tree)
    frames[i] = frame_of(replaced(tree, places[where % len(places)], value), payload)
    only_our_errors(join_frames(frames))


def test_deeply_nested_json_is_corrupt_not_a_recursion_error(v3: bytes, v2: bytes) -> None:
    frames = split_frames(v3)
    deep = ("[" * 200_000 + "]" * 200_000).encode()
    frames[1] = struct.pack("<Q", len(deep)) + deep
    with pytest.raises(
        CorruptStateError,
        match=r"checkpoint: malformed checkpoint structure in the state of lane 0 .*nested too deeply",
    ):
        zf.decode_state(join_frames(frames))
    body = struct.pack("<8sIQ", blob.MAGIC, 2, len(deep)) + deep
    with pytest.raises(CorruptStateError, match=r"nested too deeply"):
        zf.decode_state(body + hashlib.sha256(body).digest())


# -- consistency beyond the checksum ---------------------------------------------------------
def with_header(v3: bytes, **changes: Any) -> bytes:
    frames = split_frames(v3)
    tree, payload = frame_json(frames[0])
    tree.update(changes)
    frames[0] = frame_of(tree, payload)
    return join_frames(frames)


def with_lane(v3: bytes, index: int, change: Any) -> bytes:
    frames = split_frames(v3)  # the header, then each lane's state and row index
    tree, payload = frame_json(frames[1 + 2 * index])
    change(tree)
    frames[1 + 2 * index] = frame_of(tree, payload)
    return join_frames(frames)


def test_a_negative_step_is_refused(v3: bytes) -> None:
    with pytest.raises(CorruptStateError, match=r"checkpoint: checkpoint step is -1, it cannot be below 0"):
        zf.decode_state(with_header(v3, step=-1))


def test_lane_ids_out_of_range_or_repeated_are_refused(v3: bytes) -> None:
    with pytest.raises(
        CorruptStateError,
        match=r"lane states are for lanes \[0, 1\]: each must appear once and be below lanes=1",
    ):
        zf.decode_state(with_header(v3, lanes=1))
    with pytest.raises(CorruptStateError, match=r"lane ids \[0, 0\] are not distinct lane numbers"):
        zf.decode_state(with_header(v3, lane_ids=[0, 0]))

    def relabel(tree: dict[str, Any]) -> None:
        tree["lane"] = 0

    with pytest.raises(CorruptStateError, match=r"lane states are for lanes \[0, 0\]: each must appear once"):
        zf.decode_state(with_lane(v3, 1, relabel))


def test_a_lane_count_that_does_not_match_the_frames_is_refused(v3: bytes) -> None:
    with pytest.raises(
        CorruptStateError, match=r"checkpoint: 1 bytes follow the last lane|follow the last lane"
    ):
        zf.decode_state(with_header(v3, lane_ids=[0]))
    with pytest.raises(CorruptStateError, match=r"runs past the end of the checkpoint|truncated"):
        zf.decode_state(with_header(v3, lane_ids=[0, 1, 2]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(sources=[["a", 1]]), r"cursor, source 0\[0\] should be an integer, found 'a'"),
        (lambda c: c.update(sources=[[]]), r"cursor, source 0: a cursor of 0 integers is malformed"),
        (lambda c: c.update(sources=[list(range(40))]), r"a cursor of 40 integers is malformed"),
        (
            lambda c: c.update(sources=[[0, 0, -1]]),
            r"cursor, source 0: a cursor of 3 integers is malformed, a source cursor is \[pass, share, position, count\]",
        ),
        (lambda c: c.update(sources=[[0, 0, -2, 0]]), r"cursor, source 0\[2\] is -2, it cannot be below -1"),
        (lambda c: c.update(skip=-2), r"cursor, skip is -2, it cannot be below 0"),
        (lambda c: c.update(skip=1, source=7), r"skip 1 names source 7, which has no cursor"),
        (lambda c: c.update(skipped=[0, 0, 0]), r"source cursor\(s\), 3 skip count\(s\) .* do not agree"),
        (lambda c: c.update(mix_position=True), r"mix_position should be an integer, found 'True'"),
        (lambda c: c.pop("skip"), r"cursor is missing 'skip'"),
    ],
)
def test_malformed_cursors_are_refused(v3: bytes, change: Any, message: str) -> None:
    def edit(tree: dict[str, Any]) -> None:
        change(tree["cursor"])

    with pytest.raises(
        CorruptStateError, match=rf"checkpoint: state of lane 0, {message}|state of lane 0, .*{message}"
    ):
        zf.decode_state(with_lane(v3, 0, edit))


def test_a_negative_stage_position_is_refused(v3: bytes) -> None:
    def edit(tree: dict[str, Any]) -> None:
        tree["stages"]["pack"]["position"] = -1

    with pytest.raises(CorruptStateError, match=r"state of lane 0, stage 'pack', position is -1"):
        zf.decode_state(with_lane(v3, 0, edit))


def test_an_unknown_derivation_is_named(v3: bytes) -> None:
    frames = split_frames(v3)
    tree, payload = frame_json(frames[1])
    text = json.dumps(tree).replace("pack.segments/1", "someone.else/9")
    assert "someone.else/9" in text
    frames[1] = frame_of(json.loads(text), payload)
    with pytest.raises(
        CorruptStateError,
        match=r"reduced by derived fields 'someone.else/9', which neither the checkpoint format nor the "
        r"codecs handed in \(pack.segments/1\) know",
    ):
        zf.decode_state(join_frames(frames))


def test_a_frame_claiming_a_huge_size_is_refused(v3: bytes) -> None:
    body = bytearray(v3[:-32])
    struct.pack_into("<Q", body, 12 + 8, 1 << 50)
    with pytest.raises(CorruptStateError, match=r"the header claims 1125899906842624 bytes from"):
        zf.decode_state(reseal(bytes(body) + bytes(32)))


def test_valid_checkpoints_still_decode(v3: bytes, v2: bytes, plain: dict[str, Any]) -> None:
    for data in (v3, v2):
        back = zf.decode_state(data).to_plain()
        assert back["step"] == plain["step"] == 3
        assert np.array_equal(
            back["lane_states"][0]["cursor"]["sources"], plain["lane_states"][0]["cursor"]["sources"]
        )
    assert v3[8:12] == struct.pack("<I", FORMAT_VERSION) and v2[8:12] == struct.pack("<I", blob.BLOB_VERSION)


@FUZZ
@given(where=st.integers(0, 1 << 20), value=json_values)
@example(where=1509, value=1 << 63)  # a record run past int64 (found by CI's random draw)
def test_structurally_mutated_format_2_checkpoints_raise_only_state_errors(
    v2: bytes, where: int, value: Any
) -> None:
    (n,) = struct.unpack_from("<Q", v2, 12)
    tree = json.loads(v2[20 : 20 + n])
    places = paths(tree)
    head = json.dumps(replaced(tree, places[where % len(places)], value)).encode()
    body = struct.pack("<8sIQ", blob.MAGIC, 2, len(head)) + head + v2[20 + n : -32]
    only_our_errors(body + hashlib.sha256(body).digest())
