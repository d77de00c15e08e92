"""The processes backend's messages: large arrays out of band, the same values, no pickling copy."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np
import pytest
from helpers import chain_spec, run_batches, write_jsonl

from zephon_flow.core.errors import StageError
from zephon_flow.core.source import Record
from zephon_flow.runners.backends import oob
from zephon_flow.runners.segment import Skipped


def _pair() -> tuple[Any, Any]:
    return multiprocessing.Pipe(duplex=True)  # a socketpair, as between the backend and a worker


def _send_in_thread(conn: Any, obj: Any) -> threading.Thread:
    # A socket holds less than a message: the writer must run while the reader reads.
    thread = threading.Thread(target=oob.send, args=(conn, obj))
    thread.start()
    return thread


def _sample() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "image": rng.integers(0, 256, size=(336, 336, 3), dtype=np.uint8),
        "ids": np.arange(100, dtype=np.int32),  # small: stays in the pickle stream
        "fortran": np.asfortranarray(rng.random((300, 200))),
        "strided": rng.random((400, 400))[:, ::2],  # not contiguous: in band, still equal
        "caption": "a red square",
        "raw": b"\x89PNG" * 30_000,
        "nested": [(1, np.full(70_000, 7, dtype=np.int64)), None],
    }


def _assert_same(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want)
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _assert_same(a, b)
    else:
        assert got == want


def test_a_message_round_trips_with_its_large_arrays_out_of_band() -> None:
    sample = _sample()
    frame, buffers = oob.dumps(sample)
    # The image, the Fortran array and the large int64 array travel beside the stream.
    assert sorted(b.nbytes for b in buffers) == sorted([336 * 336 * 3, 300 * 200 * 8, 70_000 * 8])
    assert len(frame) < 200_000 + 400 * 200 * 8  # the bytes and the strided copy, not the image
    parent, child = _pair()
    writer = _send_in_thread(child, sample)
    got = oob.recv(parent)
    writer.join()
    _assert_same(got, sample)
    # Views of the memory the reader filled, not copies made by unpickling.
    assert got["image"].base is not None and got["image"].flags.writeable
    assert got["ids"].base is None or got["ids"].base.nbytes < oob.OUT_OF_BAND


def test_many_buffers_cross_the_readv_batch() -> None:
    arrays = [np.full(oob.OUT_OF_BAND // 8, k, dtype=np.int64) for k in range(600)]
    parent, child = _pair()
    writer = _send_in_thread(child, (5, arrays))
    task, got = oob.recv(parent)
    writer.join()
    assert task == 5
    assert [int(a[0]) for a in got] == list(range(600))
    assert all(np.array_equal(a, b) for a, b in zip(got, arrays, strict=True))


def test_small_messages_have_no_out_of_band_part() -> None:
    frame, buffers = oob.dumps((3, [np.arange(10, dtype=np.int32)]))
    assert buffers == []
    parent, child = _pair()
    oob.send(child, (3, [np.arange(10, dtype=np.int32)]))
    task, (ids,) = oob.recv(parent)
    assert task == 3 and ids.tolist() == list(range(10))
    assert frame[:4] == b"\0\0\0\0"


def test_a_writer_that_dies_mid_message_is_an_eof_naming_the_cut() -> None:
    frame, buffers = oob.dumps({"image": np.ones((336, 336, 3), dtype=np.uint8)})
    parent, child = _pair()
    child.send_bytes(frame)
    child.send_bytes(buffers[0][:1000].tobytes())  # part of the image, then the worker is gone
    child.close()
    with pytest.raises(EOFError, match="closed in the middle of a message"):
        oob.recv(parent)


class _Unsendable(beam.DoFn):  # type: ignore[misc]
    """Outputs a sample holding a lock: it cannot be pickled back to the consumer."""

    def process(self, text: str) -> Iterator[dict[str, Any]]:
        yield {"n": np.int64(int(text)), "lock": threading.Lock()}


def test_outputs_that_do_not_pickle_fail_the_loader_by_name(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, [str(i) for i in range(4)])
    spec = chain_spec(str(path), ("unsendable", _Unsendable()), epochs=1)
    with pytest.raises(StageError, match=r"the outputs of a chunk cannot be sent back: cannot pickle"):
        run_batches(spec, backend="processes", workers=1)


def _round_trip(obj: Any) -> Any:
    """``obj`` through pickle, as the backend sends a chunk or its result."""
    return pickle.loads(ForkingPickler.dumps(obj))


def test_a_chunk_of_records_travels_as_columns_and_comes_back_the_same() -> None:
    records = [
        (i % 2, Record(payload, "/data/a.jsonl", f"byte {i * 10}", i * 10))
        for i, payload in enumerate([b"{}", "text", {"jpg": b"\xff\xd8"}, b""])
    ]
    packed = oob.pack_chunk(records)
    assert type(packed) is not list  # columns, not a list of named tuples
    back = oob.unpack_chunk(_round_trip(packed))
    assert back == records
    assert all(type(r) is Record for _, r in back)
    # Anything else (one record, another record type) goes as it is.
    one = records[:1]
    assert oob.pack_chunk(one) is one
    other = [(0, ("not", "a", "record", 1)), *records]
    assert oob.unpack_chunk(_round_trip(oob.pack_chunk(other))) == other


def test_small_token_arrays_travel_as_one_array_and_come_back_as_own_writable_copies() -> None:
    rng = np.random.default_rng(1)
    result = [[rng.integers(0, 50_000, n, dtype=np.int32)] for n in (5, 0, 300, 1)] + [
        [],
        [np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32)],
    ]
    result[0][0].flags.writeable = False
    packed = oob.pack_result(result)
    assert type(packed) is not list
    back = oob.unpack_result(_round_trip(packed))
    assert [len(r) for r in back] == [len(r) for r in result]
    for got, want in zip((a for r in back for a in r), (a for r in result for a in r), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
        assert got.flags.writeable and got.base is None  # a copy, not a view of the message
    first = back[0][0]
    first[0] += 1  # its own memory: the next array is untouched
    assert np.array_equal(back[2][0], result[2][0])


@pytest.mark.parametrize(
    "result",
    [
        [[np.arange(3, dtype=np.int32)], [np.arange(3, dtype=np.int64)]],  # two dtypes
        [[np.arange(3, dtype=np.int32)], [np.zeros((2, 2), dtype=np.int32)]],  # not 1-d
        [[np.arange(3, dtype=np.int32)], [np.zeros(oob.OUT_OF_BAND, dtype=np.int32)]],  # large
        [[np.arange(3, dtype=np.int32)], [{"ids": np.arange(3)}]],  # not an array
        [[np.arange(3, dtype=np.int32)], Skipped("bad line")],  # a skipped record
        [[np.array(["a"])], [np.array(["b"])]],  # not numeric
        [[np.arange(3, dtype=np.int32)]],  # one record: nothing to gain
    ],
)
def test_other_results_travel_as_they_are(result: Any) -> None:
    assert oob.pack_result(result) is result
    back = oob.unpack_result(_round_trip(result))
    assert len(back) == len(result)
