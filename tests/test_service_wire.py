"""Batch <-> wire: rank slicing (with and without ragged provenance), chunking, in-place decoding."""

from __future__ import annotations

import numpy as np
import pytest

from zephon_flow.core.batches import batch_digest, concat
from zephon_flow.core.errors import ServiceError
from zephon_flow.service._proto import batch_service_pb2 as pb
from zephon_flow.service.wire import StepAssembler, encode_step, slice_rows, split_payload


def _batch(rows: int = 6, seq: int = 5) -> dict[str, np.ndarray]:
    return {
        "tokens": np.arange(rows * seq, dtype=np.int32).reshape(rows, seq),
        "mask": (np.arange(rows * seq).reshape(rows, seq) % 3 == 0),
        "weight": np.linspace(0, 1, rows, dtype=np.float64),
    }


def _with_documents(batch: dict[str, np.ndarray], counts: list[int]) -> dict[str, np.ndarray]:
    n = sum(counts)
    out = dict(batch)
    out["documents_count"] = np.asarray(counts, dtype=np.int32)
    out["documents"] = np.arange(n * 3, dtype=np.int64).reshape(n, 3)
    return out


def _decode(messages: list[bytes], *, as_torch: bool = False) -> tuple[int, dict[str, object]]:
    asm = StepAssembler(as_torch=as_torch)
    results = [asm.feed(m) for m in messages]
    assert all(r is None for r in results[:-1])
    last = results[-1]
    assert last is not None
    return last


def test_slice_rows_without_documents_takes_rows_of_every_field() -> None:
    batch = _batch()
    part = slice_rows(batch, 2, 4)
    assert sorted(part) == sorted(batch)
    for key in batch:
        np.testing.assert_array_equal(part[key], batch[key][2:4])


def test_slice_rows_cuts_documents_by_cumulative_counts() -> None:
    batch = _with_documents(_batch(rows=4), [2, 0, 3, 1])
    parts = [slice_rows(batch, r, r + 2) for r in (0, 2)]
    np.testing.assert_array_equal(parts[0]["documents"], batch["documents"][0:2])
    np.testing.assert_array_equal(parts[1]["documents"], batch["documents"][2:6])
    np.testing.assert_array_equal(parts[1]["documents_count"], [3, 1])
    # The slices of all ranks put back together are the global batch.
    assert batch_digest(concat(parts)) == batch_digest(batch)


def test_slice_rows_refuses_inconsistent_documents() -> None:
    batch = _with_documents(_batch(rows=2), [1, 1])
    batch["documents_count"] = np.asarray([1, 2], dtype=np.int32)
    with pytest.raises(ServiceError, match=r"'documents_count' sums to 3 but 'documents' has 2 rows"):
        slice_rows(batch, 0, 1)
    del batch["documents_count"]
    with pytest.raises(ServiceError, match="'documents' without 'documents_count'"):
        slice_rows(batch, 0, 1)


@pytest.mark.parametrize("with_documents", [False, True])
def test_one_message_round_trip_reads_arrays_in_place(with_documents: bool) -> None:
    batch = _with_documents(_batch(), [1, 2, 0, 0, 1, 3]) if with_documents else _batch()
    messages = list(encode_step(7, batch))
    assert len(messages) == 1
    step, got = _decode(messages)
    assert step == 7
    assert batch_digest(got) == batch_digest(batch)  # type: ignore[arg-type]
    for arr in got.values():
        assert isinstance(arr, np.ndarray)
        assert np.shares_memory(arr, np.frombuffer(messages[0], dtype=np.uint8))
        assert arr.flags.aligned


def test_payload_is_raw_bytes_not_repeated_numbers() -> None:
    batch = {"tokens": np.arange(1000, dtype=np.int32).reshape(10, 100)}
    (message,) = encode_step(0, batch)
    head, payload = split_payload(message)
    assert bytes(payload[: batch["tokens"].nbytes]) == batch["tokens"].tobytes()
    assert [(h.name, h.dtype, list(h.shape)) for h in head.arrays] == [("tokens", "<i4", [10, 100])]
    # The generated parser agrees with the in-place reader.
    parsed = pb.BatchChunk.FromString(message)
    assert parsed.payload == bytes(payload)


def test_the_servers_window_travels_in_part_zero_only() -> None:
    messages = encode_step(3, _batch(rows=64, seq=100), chunk_bytes=4096, ahead=8)
    assert [pb.BatchChunk.FromString(m).window for m in messages] == [8] + [0] * (len(messages) - 1)
    asm = StepAssembler()
    assert asm.ahead == 0  # nothing seen yet: a client acknowledges every step
    for m in messages:
        asm.feed(m)
        assert asm.ahead == 8
    (old,) = encode_step(4, _batch())  # as an older server sends it
    asm.feed(old)
    assert asm.ahead == 0


def test_large_step_is_split_into_chunks_and_reassembled() -> None:
    batch = _batch(rows=64, seq=100)  # ~26 KB payload
    messages = list(encode_step(3, batch, chunk_bytes=4096))
    assert len(messages) > 5
    assert all(len(m) < 4096 + 512 for m in messages)
    step, got = _decode(messages)
    assert step == 3
    assert batch_digest(got) == batch_digest(batch)  # type: ignore[arg-type]


def test_as_torch_gives_tensors_sharing_the_bytes() -> None:
    torch = pytest.importorskip("torch")
    batch = _batch()
    step, got = _decode(list(encode_step(1, batch)), as_torch=True)
    assert step == 1
    for key, value in got.items():
        assert isinstance(value, torch.Tensor)
        np.testing.assert_array_equal(value.numpy(), batch[key])


def test_out_of_order_chunk_is_refused() -> None:
    messages = list(encode_step(3, _batch(rows=64, seq=100), chunk_bytes=4096))
    asm = StepAssembler()
    asm.feed(messages[0])
    with pytest.raises(ServiceError, match=r"expected part 1 of \d+ of step 3, got part 2"):
        asm.feed(messages[2])


def test_malformed_messages_are_refused_with_a_message() -> None:
    (message,) = encode_step(0, _batch())
    with pytest.raises(ServiceError, match="malformed BatchChunk message"):
        split_payload(message[:-7] + b"\xff")
    bad = pb.BatchChunk(
        step=0, part=0, parts=1, payload_size=8, payload=bytes(8),
        arrays=[pb.ArrayHeader(name="x", dtype="<i4", shape=[4], offset=0, nbytes=16)],
    ).SerializeToString()  # fmt: skip
    with pytest.raises(ServiceError, match=r"step 0: field 'x' runs past the payload \(8 bytes\)"):
        StepAssembler().feed(bad)
    bad = pb.BatchChunk(
        step=0, part=0, parts=1, payload_size=8, payload=bytes(8),
        arrays=[pb.ArrayHeader(name="x", dtype="|O", shape=[1], offset=0, nbytes=8)],
    ).SerializeToString()  # fmt: skip
    with pytest.raises(ServiceError, match="field 'x' header is inconsistent"):
        StepAssembler().feed(bad)


def test_object_arrays_cannot_be_sent() -> None:
    with pytest.raises(ServiceError, match="field 'text' has dtype object"):
        list(encode_step(0, {"text": np.asarray(["a", None], dtype=object)}))
