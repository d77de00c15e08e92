"""The compact value encoding of checkpoint format 3: narrowed arrays, element lists as columns.

One frame encodes one plain-data tree (a lane's state, or the checkpoint's header) as
``u64 JSON length | JSON | payload``; the caller compresses it. Beyond the tags of
``blob`` (``~f`` float, ``~b`` bytes, ``~t`` tuple, ``~d`` dict with other keys), it writes:

- ``~a`` ``[dtype, stored dtype, shape, offset, size, scalar]``: an array, integers stored in
  the smallest integer type that holds its values (restored to ``dtype`` on load);
- ``~c``: a list of like elements (dicts with the same keys, each value an array of one dtype
  per key) stored as one column per key (rows stacked, or ragged with per-row lengths), with
  the fields a ``derived_fields.DerivedFields`` handed in can rebuild left out, a 16-byte digest per
  row, and, in an incremental checkpoint, the rows found in the base stored as their index
  there instead of their content.

``Frame`` encodes (``frame_decode`` decodes). The row digests (of the rows a frame stores; the
others are its base's) go to a separate small index (``index_tree``, read back by
``frame_decode.full_digests``), so a child checkpoint learns its base's rows without decoding
them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zephon_flow.core.checkpoint import derived_fields
from zephon_flow.core.checkpoint.packed_segments import BUILTIN
from zephon_flow.core.errors import StateError

LEN_PREFIX = struct.Struct("<Q")
ROW_DIGEST = 16
_INT_TYPES = [np.dtype(t).newbyteorder("<") for t in ("u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8")]
#: A place in a lane's tree: dict keys and list indices from its root.
Path = tuple[str | int, ...]
#: Per path of an element list: the digests of its rows, ``[rows, 16]`` uint8, in row order
#: (what a base offers its children).
RowIndex = dict[Path, np.ndarray]


def narrowest(array: np.ndarray) -> np.dtype[Any]:
    """The smallest little-endian integer type that holds every value of an integer array."""
    if array.dtype.kind not in "iu" or array.size == 0:
        return array.dtype
    lo, hi = int(array.min()), int(array.max())
    for dt in _INT_TYPES:
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return dt if dt.itemsize < array.dtype.itemsize else array.dtype
    return array.dtype


def _plain_array(value: np.ndarray, where: str) -> None:
    if value.dtype.hasobject or value.dtype.fields is not None or value.dtype.kind == "V":
        raise StateError(
            f"state at {where} holds a {value.dtype} array; only plain numeric, bool, "
            f"string and bytes dtypes are allowed (no object or structured dtypes)"
        )


def _as_columns(items: list[Any]) -> tuple[list[str], dict[str, derived_fields.Column]] | None:
    """``items`` as columns, if they are dicts with the same keys and per-key array dtypes."""
    first = items[0]
    if type(first) is not dict or not first or not all(isinstance(k, str) for k in first):
        return None
    keys = list(first)
    for item in items:
        if type(item) is not dict or list(item) != keys:
            return None
    columns: dict[str, derived_fields.Column] = {}
    for key in keys:
        arrays = [item[key] for item in items]
        dtype = getattr(arrays[0], "dtype", None)
        if dtype is None or dtype.hasobject or dtype.fields is not None or dtype.kind == "V":
            return None
        if not all(type(a) is np.ndarray and a.dtype == dtype for a in arrays):
            return None
        shape = arrays[0].shape
        if all(a.shape == shape for a in arrays):
            columns[key] = np.stack(arrays)
        elif arrays[0].ndim >= 1 and all(a.ndim >= 1 and a.shape[1:] == shape[1:] for a in arrays):
            lengths = np.array([a.shape[0] for a in arrays], dtype=np.int64)
            columns[key] = derived_fields.Ragged(np.concatenate(arrays), lengths)
        else:
            return None
    return keys, columns


def offsets(lengths: np.ndarray) -> np.ndarray:
    """Where each ragged row starts (and, last, where the values end)."""
    out = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _byte_rows(array: np.ndarray) -> np.ndarray:
    """``array`` as ``[len, bytes per entry]`` uint8 (C-contiguous), one row per first-axis entry."""
    per = int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).reshape(array.shape[0], per)


def _column_nbytes(col: derived_fields.Column) -> int:
    return col.values.nbytes + col.lengths.nbytes if isinstance(col, derived_fields.Ragged) else col.nbytes


def _row_digests(schema: str, columns: dict[str, derived_fields.Column], rows: int) -> np.ndarray:
    """A 16-byte blake2b digest per row over every stored column (in key order) and the schema."""
    seed = hashlib.blake2b(schema.encode("utf-8"), digest_size=ROW_DIGEST)
    parts: list[RowSlicer] = []
    for key in sorted(columns):
        col = columns[key]
        if isinstance(col, derived_fields.Ragged):
            parts.append(RowSlicer(_byte_rows(col.values), offsets(col.lengths)))
            parts.append(RowSlicer(_byte_rows(np.asarray(col.lengths, dtype="<i8")), None))
        else:
            parts.append(RowSlicer(_byte_rows(col), None))
    out = np.empty((rows, ROW_DIGEST), dtype=np.uint8)
    for i in range(rows):
        h = seed.copy()
        for part in parts:
            h.update(part(i).data)
        out[i] = np.frombuffer(h.digest(), dtype=np.uint8)
    return out


@dataclass(frozen=True)
class RowSlicer:
    """Row ``i`` of a stacked column (``offsets`` None) or of a ragged one's values."""

    values: np.ndarray
    offsets: np.ndarray | None

    def __call__(self, i: int) -> np.ndarray:
        if self.offsets is None:
            return self.values[i, ...]
        return self.values[self.offsets[i] : self.offsets[i + 1]]


def _values(col: derived_fields.Column) -> np.ndarray:
    return col.values if isinstance(col, derived_fields.Ragged) else col


def _narrowed(col: derived_fields.Column) -> derived_fields.Column:
    """The column in the smallest integer types that hold it (ragged lengths too)."""
    if isinstance(col, derived_fields.Ragged):
        return derived_fields.Ragged(_narrowed(col.values), _narrowed(col.lengths))  # type: ignore[arg-type]
    kind = narrowest(col)
    return col if kind == col.dtype else col.astype(kind)


def _column_schema(col: derived_fields.Column) -> list[Any]:
    if isinstance(col, derived_fields.Ragged):
        return ["ragged", col.values.dtype.str, list(col.values.shape[1:])]
    return ["stacked", col.dtype.str, list(col.shape[1:])]


def _take(col: derived_fields.Column, rows: np.ndarray) -> derived_fields.Column:
    if isinstance(col, derived_fields.Ragged):
        off = offsets(col.lengths)
        idx = [np.arange(off[i], off[i + 1]) for i in rows]
        flat = np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64)
        return derived_fields.Ragged(col.values[flat], col.lengths[rows])
    taken: np.ndarray = col[rows]
    return taken


@dataclass
class Frame:
    """Encodes one tree; ``base`` (row digests of the same lane in the base) makes it a delta;
    ``codecs`` are offered each list of like elements, in order (the first that recognises its
    columns leaves out the fields it rebuilds)."""

    base: RowIndex | None = None
    codecs: derived_fields.DerivedCodecs = BUILTIN
    payload: list[memoryview] = field(default_factory=list)
    size: int = 0
    #: Raw bytes of the state encoded (arrays at their in-memory size), for throughput figures.
    raw_bytes: int = 0
    rows_total: int = 0
    rows_from_base: int = 0
    #: Per element list: its path, row count, digests of the rows stored here, refs to the base.
    index: list[tuple[Path, int, np.ndarray, np.ndarray | None]] = field(default_factory=list)

    def encode(self, value: Any) -> bytes:
        """The JSON header (with its length prefix); the payload buffers follow in ``payload``."""
        tree = self._tree(value, (), "state")
        head = json.dumps(tree, separators=(",", ":"), allow_nan=False).encode("utf-8")
        return LEN_PREFIX.pack(len(head)) + head

    def chunks(self, value: Any) -> Iterator[memoryview | bytes]:
        """The whole frame, piece by piece (the header, then every payload buffer)."""
        yield self.encode(value)
        yield from self.payload

    def _array(
        self, value: np.ndarray, scalar: bool, where: str, logical: np.dtype[Any] | None = None
    ) -> dict[str, Any]:
        """``value`` in the payload, narrowed; ``logical``: its dtype before an earlier narrowing."""
        _plain_array(value, where)
        stored = narrowest(value)
        data = np.ascontiguousarray(value, dtype=stored)
        flat = data.reshape(-1).view(np.uint8)
        kind = value.dtype if logical is None else logical
        node = [kind.str, stored.str, list(value.shape), self.size, flat.size, scalar]
        self.payload.append(memoryview(flat.data))
        self.size += flat.size
        return {"~a": node}

    def _column(self, col: derived_fields.Column, logical: np.dtype[Any], where: str) -> Any:
        if isinstance(col, derived_fields.Ragged):
            values = self._array(col.values, False, where, logical)
            return {"r": [values, self._array(col.lengths, False, where, np.dtype(np.int64))]}
        return {"a": self._array(col, False, where, logical)}

    def _columns(self, items: list[Any], path: Path, where: str) -> Any:
        found = _as_columns(items)
        if found is None:
            return None
        keys, columns = found
        del found
        self.raw_bytes += sum(_column_nbytes(c) for c in columns.values())
        reduced: derived_fields.Reduced | None = None
        name: str | None = None
        for fields in self.codecs.fields:
            reduced = fields.reduce(columns)
            if reduced is not None:
                name = fields.name
                break
        kept = [k for k in columns if reduced is None or k not in reduced.derived]
        logical = {k: columns.pop(k) for k in kept}
        del columns  # the derived fields' stacked copies are done with
        if reduced is not None:
            logical.update({f"~{k}": v for k, v in reduced.stored.items()})
        dtypes = {k: _values(v).dtype for k, v in logical.items()}
        # Narrowed before hashing (half the bytes to hash for token ids), one column at a time
        # so each wide copy goes as soon as its narrow one exists.
        stored = {k: _narrowed(logical.pop(k)) for k in list(logical)}
        schema = json.dumps(
            [name, keys, {k: [dtypes[k].str, *_column_schema(v)] for k, v in sorted(stored.items())}]
        )
        digests = _row_digests(schema, stored, len(items))
        refs: np.ndarray | None = None
        keep = np.arange(len(items))
        offered = None if self.base is None else self.base.get(path)
        if offered is not None and len(offered):
            known = {d.tobytes(): i for i, d in reversed(list(enumerate(offered)))}
            refs = np.array([known.get(d.tobytes(), -1) for d in digests], dtype=np.int64)
            keep = np.flatnonzero(refs < 0)
            stored = {k: _take(v, keep) for k, v in stored.items()}
            digests = digests[keep]  # the others' are the base's
            self.rows_from_base += len(items) - keep.size
        self.index.append((path, len(items), digests, refs))
        self.rows_total += len(items)
        body = {
            "n": len(items),
            "keys": keys,
            "cols": {k: self._column(v, dtypes[k], f"{where}.{k}") for k, v in stored.items()},
            "derived": None if reduced is None else [name, list(reduced.derived)],
            "base": None if refs is None else self._array(refs, False, where),
        }
        return {"~c": body}

    def _tree(self, value: Any, path: Path, where: str) -> Any:
        if value is None or isinstance(value, bool | str | int):
            return value
        if isinstance(value, float):
            return {"~f": value.hex()}
        if isinstance(value, bytes | bytearray | memoryview):
            data = memoryview(bytes(value))
            node: dict[str, Any] = {"~b": [self.size, len(data)]}
            self.payload.append(data)
            self.size += len(data)
            self.raw_bytes += len(data)
            return node
        if isinstance(value, np.generic | np.ndarray):
            array = np.asarray(value)
            self.raw_bytes += array.nbytes
            return self._array(array, isinstance(value, np.generic), where)
        if isinstance(value, list):
            if len(value) >= 2:
                columns = self._columns(value, path, where)
                if columns is not None:
                    return columns
            return [self._tree(v, (*path, i), f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"~t": [self._tree(v, (), f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("~") for k in value):
                return {k: self._tree(v, (*path, k), f"{where}.{k}") for k, v in value.items()}
            return {
                "~d": [
                    [self._tree(k, (), f"{where} key"), self._tree(v, (), f"{where}[{k!r}]")]
                    for k, v in value.items()
                ]
            }
        raise StateError(
            f"state at {where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints "
            f"hold plain data only (None, bool, int, float, str, bytes, numpy arrays, lists, tuples, dicts)"
        )


def index_tree(frame: Frame) -> dict[str, Any]:
    """The plain tree of a frame's row index (encode it with a fresh ``Frame``)."""
    return {"lists": [[list(path), n, digests, refs] for path, n, digests, refs in frame.index]}
