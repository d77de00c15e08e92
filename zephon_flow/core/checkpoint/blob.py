"""The plain-data codec of checkpoint formats 1 and 2: one self-describing, checksummed blob.

Format 3 (``framed_file``, ``frame_encode``) writes checkpoints now; this codec still reads formats 1
and 2, writes format 2 for tests of older checkpoints, and digests states for comparison.

Layout: ``MAGIC | u32 version | u64 header length | header (UTF-8 JSON) | payload | sha256``.
The JSON header is the value tree; numpy arrays and bytes are stored in the payload and
referenced from the header by offset. Accepted values: None, bool, int, float, str, bytes,
numpy arrays and numpy scalars, and lists, tuples and dicts of these. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import numpy as np

from zephon_flow.core.checkpoint import FORMAT_VERSION
from zephon_flow.core.errors import CorruptStateError, FormatVersionError, StateError

MAGIC = b"ZEPHONCK"
#: The format of this codec's single blob. Version 2: lane cursors record the straddling
#: record's source, exhausted sources and skip counts, and the checkpoint records the mixture
#: history.
BLOB_VERSION = 2
_HEAD = struct.Struct("<8sIQ")
_DIGEST = 32


def _encode_tree(value: Any, payload: list[bytes | memoryview], offset: list[int], where: str) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return {"~f": value.hex()}
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        ref: dict[str, Any] = {"~b": [offset[0], len(data)]}
        payload.append(data)
        offset[0] += len(data)
        return ref
    if isinstance(value, np.generic):
        value = np.asarray(value)
        scalar = True
    else:
        scalar = False
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.fields is not None or value.dtype.kind == "V":
            raise StateError(
                f"state at {where} holds a {value.dtype} array; only plain numeric, bool, "
                f"string and bytes dtypes are allowed (no object or structured dtypes)"
            )
        array = memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
        ref = {"~a": [value.dtype.str, list(value.shape), offset[0], len(array), scalar]}
        payload.append(array)
        offset[0] += len(array)
        return ref
    if isinstance(value, list):
        return [_encode_tree(v, payload, offset, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"~t": [_encode_tree(v, payload, offset, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("~") for k in value):
            return {k: _encode_tree(v, payload, offset, f"{where}.{k}") for k, v in value.items()}
        return {
            "~d": [
                [
                    _encode_tree(k, payload, offset, f"{where} key"),
                    _encode_tree(v, payload, offset, f"{where}[{k!r}]"),
                ]
                for k, v in value.items()
            ]
        }
    raise StateError(
        f"state at {where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints "
        f"hold plain data only (None, bool, int, float, str, bytes, numpy arrays, lists, tuples, dicts)"
    )


def _decode_tree(node: Any, payload: memoryview) -> Any:
    if isinstance(node, list):
        return [_decode_tree(v, payload) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        ((tag, body),) = node.items()
        if tag == "~f":
            return float.fromhex(body)
        if tag == "~b":
            start, size = body
            return bytes(payload[start : start + size])
        if tag == "~a":
            dtype, shape, start, size, scalar = body
            arr = np.frombuffer(payload[start : start + size], dtype=np.dtype(dtype)).reshape(shape).copy()
            return arr[()] if scalar else arr
        if tag == "~t":
            return tuple(_decode_tree(v, payload) for v in body)
        if tag == "~d":
            return {_freeze_key(_decode_tree(k, payload)): _decode_tree(v, payload) for k, v in body}
    return {k: _decode_tree(v, payload) for k, v in node.items()}


def _freeze_key(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def _pieces(value: Any) -> list[bytes | memoryview]:
    """The blob without its checksum, as pieces (arrays are views, not copies)."""
    payload: list[bytes | memoryview] = []
    header = json.dumps(_encode_tree(value, payload, [0], "state"), separators=(",", ":"), allow_nan=False)
    head = header.encode("utf-8")
    return [_HEAD.pack(MAGIC, BLOB_VERSION, len(head)) + head, *payload]


def encode(value: Any) -> bytes:
    """Encodes a plain-data tree into checkpoint bytes (format 2)."""
    body = b"".join(_pieces(value))
    return body + hashlib.sha256(body).digest()


def decode(data: bytes, *, source: str = "checkpoint") -> Any:
    """Decodes format 1 or 2 bytes; refuses other formats, newer versions and damaged bytes."""
    if len(data) < _HEAD.size + _DIGEST or not data.startswith(MAGIC):
        raise CorruptStateError(f"{source} is not a zephon-flow checkpoint (missing magic header)")
    _magic, version, header_len = _HEAD.unpack_from(data)
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{source} uses checkpoint format version {version}, newer than the version "
            f"{FORMAT_VERSION} this zephon-flow reads; upgrade zephon-flow to load it"
        )
    if version < 1:
        raise CorruptStateError(f"{source} declares invalid format version {version}")
    if version > BLOB_VERSION:
        raise CorruptStateError(f"{source} is in checkpoint format {version}: read it with zf.decode_state")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptStateError(f"{source}: checksum mismatch, the bytes are corrupt or truncated")
    start = _HEAD.size
    try:
        tree = json.loads(body[start : start + header_len].decode("utf-8"))
        return _decode_tree(tree, memoryview(body)[start + header_len :])
    except RecursionError as exc:
        raise CorruptStateError(f"{source}: malformed checkpoint structure (nested too deeply)") from exc
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        # the checksum passed (or was resealed) yet the structure is bad
        raise CorruptStateError(f"{source}: malformed checkpoint structure ({exc!r})") from exc


def canonical_digest(value: Any) -> str:
    """A sha256 of the value's format-2 encoding (without its checksum), used to compare states
    for equality; hashed piece by piece, so the encoding is never built in memory."""
    digest = hashlib.sha256()
    for piece in _pieces(value):
        digest.update(piece)
    return digest.hexdigest()
