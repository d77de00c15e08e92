"""Tests of the checkpoint codec and the state file format: round trips and every refusal."""

from __future__ import annotations

import hashlib
import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import Corpus, example_spec

import zephon_flow as zf
from zephon_flow.core.checkpoint import FORMAT_VERSION, blob
from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.core.errors import CorruptStateError, FormatVersionError, StateError


def roundtrip(value: Any) -> Any:
    return blob.decode(blob.encode(value))


def with_version(data: bytes, version: int) -> bytes:
    """The same checkpoint declaring another format version, its checksum made valid again."""
    body = bytearray(data[:-32])
    struct.pack_into("<I", body, 8, version)
    return bytes(body) + hashlib.sha256(body).digest()


def reseal(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


@pytest.fixture(scope="module")
def loader_state(corpus: Corpus) -> LoaderState:
    with zf.Loader(example_spec(corpus, lanes=2, global_batch_size=4)) as loader:
        for step, _ in loader:
            if step == 2:
                return loader.state()
    raise AssertionError("the loader ended early")


# -- round trips ---------------------------------------------------------------------------
def test_nested_plain_data_round_trips() -> None:
    value = {
        "ints": [0, -1, 2**70, True, False, None],
        "text": "ünïcödé \u2028 \x00",
        "floats": [1.5, -2.25e-300, 1e308, math.inf, -math.inf],
        "tuple": (1, ("a", b"\x00\xff"), []),
        "bytes": b"\x00" * 3 + bytes(range(256)),
        "int keys": {1: "one", -2: [3], (4, "x"): {"nested": (None,)}},
        "~tilde": {"~f": "not a tag", "~b": 1},
        "empty": [{}, (), b"", ""],
    }
    assert roundtrip(value) == value
    assert type(roundtrip(value)["tuple"][1]) is tuple


def test_special_floats_keep_sign_and_nan() -> None:
    neg_zero, nan = roundtrip([-0.0, math.nan])
    assert neg_zero == 0.0 and math.copysign(1.0, neg_zero) == -1.0
    assert math.isnan(nan)
    assert roundtrip(0.1 + 0.2) == 0.1 + 0.2  # bit exact, not a decimal rendering


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.array([1.5, -0.0, np.nan, np.inf], dtype=np.float64),
        np.arange(6, dtype=np.float16).reshape(2, 3),
        np.array([0, 255], dtype=np.uint8),
        np.array([True, False]),
        np.arange(3, dtype=">i4"),
        np.zeros((0, 5), dtype=np.int64),
        np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        np.array(["ab", "c"]),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        np.array([1 + 2j], dtype=np.complex64),
    ],
    ids=lambda a: f"{a.dtype.str}{list(a.shape)}",
)
def test_numpy_arrays_round_trip_with_dtype_and_shape(array: np.ndarray) -> None:
    got = roundtrip({"a": array})["a"]
    assert isinstance(got, np.ndarray)
    assert got.dtype == array.dtype and got.shape == array.shape
    assert got.tobytes() == np.ascontiguousarray(array).tobytes()
    assert got.flags.writeable  # a copy, not a view of the checkpoint bytes


def test_numpy_scalars_stay_numpy_scalars() -> None:
    got = roundtrip([np.int64(-5), np.float32(1.5), np.uint8(7), np.bool_(True)])
    assert [type(v) for v in got] == [np.int64, np.float32, np.uint8, np.bool_]
    assert got == [-5, 1.5, 7, True]


def test_structured_arrays_are_refused_with_their_place_and_dtype() -> None:
    array = np.array([(1, 2.5)], dtype=[("x", "<i4"), ("y", "<f8")])
    with pytest.raises(
        StateError, match=r"state at state\.a holds a .*'x', '<i4'.* array; .*no object or structured"
    ):
        blob.encode({"a": array})


def test_encoding_is_deterministic(loader_state: LoaderState) -> None:
    assert zf.encode_state(loader_state) == zf.encode_state(zf.decode_state(zf.encode_state(loader_state)))
    first = blob.canonical_digest({"a": 1, "b": [2, np.arange(3)]})
    assert first == blob.canonical_digest({"a": 1, "b": [2, np.arange(3)]})  # built anew, same value
    assert first != blob.canonical_digest({"a": 1, "b": [2, np.arange(1, 4)]})  # one leaf differs


def test_a_loader_state_round_trips_through_bytes_and_files(
    loader_state: LoaderState, tmp_path: Path
) -> None:
    data = zf.encode_state(loader_state)
    assert data.startswith(blob.MAGIC)
    assert zf.encode_state(zf.decode_state(data)) == data
    path = tmp_path / "ck.zf"
    zf.save_state(loader_state, path)
    assert path.read_bytes() == data
    assert zf.encode_state(zf.load_state(path)) == data
    assert os.listdir(tmp_path) == ["ck.zf"]  # no temporary file left behind
    assert loader_state.step == 3 and loader_state.to_plain()["kind"] == "zephon-flow/loader-state"


# -- refusals -------------------------------------------------------------------------------
def test_objects_are_refused_with_their_place_in_the_tree() -> None:
    with pytest.raises(
        StateError, match=r"state at state\.buf\[1\] is a builtins\.object; checkpoints hold plain data only"
    ):
        blob.encode({"buf": [1, object()]})
    with pytest.raises(StateError, match=r"state at state is a builtins\.set"):
        blob.encode({1, 2})
    with pytest.raises(
        StateError,
        match=r"state at state\.a holds a object array; only plain numeric, bool, string and bytes dtypes",
    ):
        blob.encode({"a": np.array([1, None], dtype=object)})


def test_a_newer_format_version_is_refused(loader_state: LoaderState, corpus: Corpus, tmp_path: Path) -> None:
    data = with_version(zf.encode_state(loader_state), FORMAT_VERSION + 1)
    with pytest.raises(
        FormatVersionError,
        match=r"checkpoint uses checkpoint format version 4, newer than the version 3 .*upgrade zephon-flow",
    ):
        zf.decode_state(data)
    path = tmp_path / "new.zf"
    path.write_bytes(data)
    with pytest.raises(FormatVersionError, match=rf"{path} uses checkpoint format version 4"):
        zf.load_state(path)
    with pytest.raises(FormatVersionError, match=r"version 4"):
        zf.Loader(example_spec(corpus, lanes=2, global_batch_size=4), state=data)


def test_an_older_state_format_is_refused_by_name(loader_state: LoaderState) -> None:
    plain = to_loader_state(loader_state).to_plain()
    plain["format_version"] = 1
    with pytest.raises(
        FormatVersionError, match=r"format version 1 is older than the oldest version 2 .*earlier zephon-flow"
    ):
        LoaderState.from_plain(plain)


def test_a_zero_format_version_is_corrupt(loader_state: LoaderState) -> None:
    with pytest.raises(CorruptStateError, match=r"declares invalid format version 0"):
        zf.decode_state(with_version(zf.encode_state(loader_state), 0))


def test_a_flipped_byte_is_caught_by_the_checksum(loader_state: LoaderState, tmp_path: Path) -> None:
    data = bytearray(zf.encode_state(loader_state))
    for index in (len(blob.MAGIC) + 12 + 5, len(data) // 2, len(data) - 40, len(data) - 1):
        damaged = bytearray(data)
        damaged[index] ^= 0x01
        with pytest.raises(
            CorruptStateError, match=r"checkpoint: checksum mismatch, the bytes are corrupt or truncated"
        ):
            zf.decode_state(bytes(damaged))
    path = tmp_path / "bad.zf"
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(CorruptStateError, match=rf"{path}: checksum mismatch"):
        zf.load_state(path)


def test_bytes_that_are_not_a_checkpoint_are_refused() -> None:
    for data in (b"", b"PK\x03\x04" + b"\x00" * 100, blob.MAGIC):
        with pytest.raises(
            CorruptStateError, match=r"checkpoint is not a zephon-flow checkpoint \(missing magic header\)"
        ):
            blob.decode(data)


def test_a_sealed_but_malformed_structure_is_corrupt() -> None:
    header = b"{not json"
    body = struct.pack("<8sIQ", blob.MAGIC, blob.BLOB_VERSION, len(header)) + header
    with pytest.raises(CorruptStateError, match=r"checkpoint: malformed checkpoint structure"):
        blob.decode(reseal(body))


def test_plain_data_that_is_not_a_loader_state_is_refused() -> None:
    with pytest.raises(CorruptStateError, match=r"checkpoint should be a mapping, found list"):
        zf.decode_state(blob.encode([1, 2]))
    with pytest.raises(
        CorruptStateError, match=r"checkpoint is missing 'kind': the checkpoint is corrupt or incomplete"
    ):
        zf.decode_state(blob.encode({"step": 1}))


def test_a_lane_state_missing_a_key_names_it(loader_state: LoaderState) -> None:
    plain = zf.decode_state(zf.encode_state(loader_state)).to_plain()
    del plain["lane_states"][1]["cursor"]
    with pytest.raises(CorruptStateError, match=r"state of lane 1 is missing 'cursor'"):
        zf.LoaderState.from_plain(plain)
    plain = zf.decode_state(zf.encode_state(loader_state)).to_plain()
    del plain["lane_states"][0]["stages"]["pack"]["position"]
    with pytest.raises(CorruptStateError, match=r"state of lane 0, stage 'pack' is missing 'position'"):
        zf.decode_state(blob.encode(plain))


def test_the_public_functions_give_and_take_loader_states(loader_state: LoaderState, tmp_path: Path) -> None:
    data = zf.encode_state(loader_state)
    zf.save_state(loader_state, tmp_path / "ck.zf")
    for got in (
        zf.decode_state(data),
        zf.load_state(tmp_path / "ck.zf"),
        zf.merge_states([loader_state.to_plain()]),
    ):
        assert isinstance(got, zf.LoaderState)
        assert blob.canonical_digest(got.to_plain()) == blob.canonical_digest(loader_state.to_plain())
    plain = loader_state.to_plain()  # what state_dict() gives torch
    for write in (lambda s: zf.save_state(s, tmp_path / "x.zf"), zf.encode_state):
        with pytest.raises(
            TypeError,
            match=r"takes a LoaderState \(loader.state\(\), zf.load_state, "
            r"zf.decode_state or zf.merge_states\), not a dict: a state_dict\(\) is the plain "
            r"form torch stores; make it a LoaderState with zf.LoaderState.from_plain",
        ):
            write(plain)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"takes a LoaderState .*, not a bytes$"):
            write(data)  # type: ignore[arg-type]
    assert not (tmp_path / "x.zf").exists()
    assert zf.encode_state(zf.LoaderState.from_plain(plain)) == data
