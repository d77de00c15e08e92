"""Batch <-> wire: rank slices of a global batch, encoded as raw array bytes in BatchChunk messages.

A step's payload is its arrays laid end to end, each at an offset aligned to ``ALIGN`` bytes;
``ArrayHeader`` entries (in part 0) give name, dtype, shape, offset and size. The server
writes each serialized message in one copy straight from the numpy buffers; the client reads
the arrays in place from the received message bytes (``np.frombuffer``, no copy) when a step
fits in one message, and assembles a step of several messages into one buffer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_flow.core.batches import Batch
from zephon_flow.core.errors import ServiceError
from zephon_flow.service._proto import batch_service_pb2 as pb

ALIGN = 64
CHUNK_BYTES = 4 << 20
"""Largest payload carried by one message; a larger step is split into several."""
MAX_MESSAGE_BYTES = CHUNK_BYTES + (1 << 20)
"""Largest message either end accepts: a full chunk plus room for the array headers."""
DOCUMENTS, DOCUMENTS_COUNT = "documents", "documents_count"
_PAYLOAD_TAG = bytes([(6 << 3) | 2])
_ALIGN_TAG = bytes([(7 << 3) | 2])
_DTYPE_KINDS = frozenset("biufc")


def slice_rows(batch: Mapping[str, np.ndarray], start: int, stop: int) -> Batch:
    """Rows ``[start, stop)`` of a batch (views, no copy).

    Every field is sliced by rows, except the ragged pair ``documents`` (one row per document,
    ``[n, k]``) + ``documents_count`` (documents per batch row): ``documents`` is sliced by the
    cumulative counts so that the slice keeps exactly the documents of its rows.
    """
    out = {k: v[start:stop] for k, v in batch.items() if k != DOCUMENTS}
    if DOCUMENTS in batch:
        if DOCUMENTS_COUNT not in batch:
            raise ServiceError(f"the batch has {DOCUMENTS!r} without {DOCUMENTS_COUNT!r}: cannot slice it")
        counts = np.asarray(batch[DOCUMENTS_COUNT], dtype=np.int64)
        ends = np.concatenate([[0], np.cumsum(counts)])
        docs = batch[DOCUMENTS]
        if ends[-1] != len(docs):
            raise ServiceError(
                f"{DOCUMENTS_COUNT!r} sums to {int(ends[-1])} but {DOCUMENTS!r} has {len(docs)} rows"
            )
        out[DOCUMENTS] = docs[int(ends[start]) : int(ends[stop])]
    return out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _layout(batch: Mapping[str, np.ndarray]) -> tuple[list[pb.ArrayHeader], list[memoryview | bytes], int]:
    """Headers and the payload as a list of segments (array bytes and zero padding)."""
    headers: list[pb.ArrayHeader] = []
    segments: list[memoryview | bytes] = []
    offset = 0
    for name in sorted(batch):
        arr = np.ascontiguousarray(batch[name])
        if arr.dtype.kind not in _DTYPE_KINDS:
            raise ServiceError(f"field {name!r} has dtype {arr.dtype}, which the batch service cannot send")
        pad = -offset % ALIGN
        if pad:
            segments.append(bytes(pad))
            offset += pad
        headers.append(
            pb.ArrayHeader(
                name=name, dtype=arr.dtype.str, shape=list(arr.shape), offset=offset, nbytes=arr.nbytes
            )
        )
        if arr.nbytes:
            segments.append(arr.data.cast("B"))
            offset += arr.nbytes
    return headers, segments, offset


def _cut(segments: list[memoryview | bytes], start: int, stop: int) -> list[memoryview | bytes]:
    """The segments' bytes ``[start, stop)``, as views."""
    out: list[memoryview | bytes] = []
    pos = 0
    for seg in segments:
        end = pos + len(seg)
        if end > start and pos < stop:
            out.append(memoryview(seg)[max(start - pos, 0) : min(stop, end) - pos])
        pos = end
    return out


def encode_step(
    step: int, batch: Mapping[str, np.ndarray], *, chunk_bytes: int = CHUNK_BYTES, ahead: int = 0
) -> list[bytes]:
    """The serialized ``BatchChunk`` messages of one step's slice; part 0 carries ``ahead`` (in the
    message's ``window`` field, its name in protocol v1)."""
    headers, segments, size = _layout(batch)
    parts = max(1, -(-size // chunk_bytes))
    out: list[bytes] = []
    for part in range(parts):
        lo, hi = part * chunk_bytes, min(size, (part + 1) * chunk_bytes)
        first = part == 0
        head = pb.BatchChunk(
            step=step,
            part=part,
            parts=parts,
            arrays=headers if first else [],
            payload_size=size,
            window=ahead if first else 0,
        ).SerializeToString()
        length = _varint(hi - lo)
        # Pad so the payload starts at a multiple of 16 in the message: 2 + k bytes of padding field.
        k = -(len(head) + 2 + len(_PAYLOAD_TAG) + len(length)) % 16
        out.append(
            b"".join([head, _ALIGN_TAG, bytes([k]), bytes(k), _PAYLOAD_TAG, length, *_cut(segments, lo, hi)])
        )
    return out


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ServiceError("malformed BatchChunk message: truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def split_payload(raw: bytes) -> tuple[pb.BatchChunk, memoryview]:
    """Parses a serialized ``BatchChunk``; the payload is returned as a view into ``raw``."""
    view = memoryview(raw)
    rest: list[memoryview] = []
    payload = view[0:0]
    pos = 0
    while pos < len(view):
        start = pos
        key, pos = _read_varint(view, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _read_varint(view, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = _read_varint(view, pos)
            if key >> 3 == 6:
                payload = view[pos : pos + n]
                pos += n
                continue
            pos += n
        else:
            raise ServiceError(f"malformed BatchChunk message: wire type {wire} at byte {start}")
        if pos > len(view):
            raise ServiceError("malformed BatchChunk message: a field runs past its end")
        rest.append(view[start:pos])
    if pos != len(view):
        raise ServiceError("malformed BatchChunk message: truncated")
    return pb.BatchChunk.FromString(b"".join(rest)), payload


@dataclass
class _Pending:
    step: int
    parts: int
    size: int
    headers: list[pb.ArrayHeader]
    buffer: bytearray
    filled: int = 0
    next_part: int = 0


class StepAssembler:
    """Feeds on serialized chunks in order; yields ``(step, batch)`` when a step is complete."""

    def __init__(self, *, as_torch: bool = False) -> None:
        self._as_torch = as_torch
        self._pending: _Pending | None = None
        self.ahead = 0
        """The server's ``ahead`` (steps a stream sends past its acknowledged step), from the
        last part 0 fed (0: the server does not say)."""

    def feed(self, raw: bytes) -> tuple[int, dict[str, Any]] | None:
        chunk, payload = split_payload(raw)
        if chunk.part == 0:
            self.ahead = chunk.window
        if chunk.parts == 1 and chunk.part == 0 and self._pending is None:
            if len(payload) != chunk.payload_size:
                raise ServiceError(
                    f"step {chunk.step}: payload has {len(payload)} bytes, header says {chunk.payload_size}"
                )
            return chunk.step, decode_arrays(list(chunk.arrays), payload, self._as_torch, step=chunk.step)
        p = self._pending
        if p is None:
            if chunk.part != 0 or chunk.parts < 1:
                raise ServiceError(f"step {chunk.step}: first chunk is part {chunk.part} of {chunk.parts}")
            p = self._pending = _Pending(
                chunk.step, chunk.parts, chunk.payload_size, list(chunk.arrays), bytearray(chunk.payload_size)
            )
        if (chunk.step, chunk.part, chunk.parts) != (p.step, p.next_part, p.parts):
            raise ServiceError(
                f"expected part {p.next_part} of {p.parts} of step {p.step}, "
                f"got part {chunk.part} of {chunk.parts} of step {chunk.step}"
            )
        if p.filled + len(payload) > p.size:
            raise ServiceError(f"step {p.step}: chunks exceed the payload size {p.size}")
        p.buffer[p.filled : p.filled + len(payload)] = payload
        p.filled += len(payload)
        p.next_part += 1
        if p.next_part < p.parts:
            return None
        self._pending = None
        if p.filled != p.size:
            raise ServiceError(f"step {p.step}: chunks hold {p.filled} bytes, header says {p.size}")
        return p.step, decode_arrays(p.headers, memoryview(p.buffer), self._as_torch, step=p.step)


def decode_arrays(
    headers: list[pb.ArrayHeader], payload: memoryview, as_torch: bool, *, step: int
) -> dict[str, Any]:
    """Arrays viewing ``payload`` in place (numpy, or torch tensors sharing the memory)."""
    out: dict[str, Any] = {}
    for h in headers:
        try:
            dtype = np.dtype(h.dtype)
        except TypeError as exc:
            raise ServiceError(f"step {step}: field {h.name!r} has unknown dtype {h.dtype!r}") from exc
        shape = tuple(int(s) for s in h.shape)
        count = int(np.prod(shape, dtype=np.int64))
        if dtype.kind not in _DTYPE_KINDS or count * dtype.itemsize != h.nbytes:
            raise ServiceError(
                f"step {step}: field {h.name!r} header is inconsistent "
                f"(dtype {h.dtype!r}, shape {list(shape)}, {h.nbytes} bytes)"
            )
        if h.offset + h.nbytes > len(payload):
            raise ServiceError(f"step {step}: field {h.name!r} runs past the payload ({len(payload)} bytes)")
        arr = np.frombuffer(payload, dtype=dtype, count=count, offset=h.offset).reshape(shape)
        if not arr.flags.aligned:
            arr = arr.copy()
        out[h.name] = arr
    if as_torch:
        return to_torch(out)
    return out


def to_torch(batch: dict[str, Any]) -> dict[str, Any]:
    """Torch tensors sharing the arrays' memory (torch is imported only here)."""
    import warnings

    import torch

    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        # Arrays viewing received message bytes are read-only; the tensors share that memory.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, arr in batch.items():
            out[name] = torch.from_numpy(arr)
    return out
