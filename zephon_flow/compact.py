"""The compact value encoding of checkpoint format 3: narrowed arrays, element lists as columns.

One frame encodes one plain-data tree (a lane's state, or the checkpoint's header) as
``u64 JSON length | JSON | payload``; the caller compresses it. Beyond the tags of
``codec`` (``~f`` float, ``~b`` bytes, ``~t`` tuple, ``~d`` dict with other keys), it writes:

- ``~a`` ``[dtype, stored dtype, shape, offset, size, scalar]``: an array, integers stored in
  the smallest integer type that holds its values (restored to ``dtype`` on load);
- ``~c``: a list of like elements (dicts with the same keys, each value an array of one dtype
  per key) stored as one column per key (rows stacked, or ragged with per-row lengths), with
  the fields a registered ``derived.DerivedFields`` can rebuild left out, a 16-byte digest per
  row, and, in an incremental checkpoint, the rows found in the base stored as their index
  there instead of their content.

``Frame`` and ``decode_frame`` are the two directions. The row digests (of the rows a frame
stores; the others are its base's) go to a separate small index (``Frame.index_tree``, read by
``full_digests``), so a child checkpoint learns its base's rows without decoding them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zephon_flow import derived
from zephon_flow.errors import StateError

_LEN = struct.Struct("<Q")
_ROW_DIGEST = 16
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


def _as_columns(items: list[Any]) -> tuple[list[str], dict[str, derived.Column]] | None:
    """``items`` as columns, if they are dicts with the same keys and per-key array dtypes."""
    first = items[0]
    if type(first) is not dict or not first or not all(isinstance(k, str) for k in first):
        return None
    keys = list(first)
    for item in items:
        if type(item) is not dict or list(item) != keys:
            return None
    columns: dict[str, derived.Column] = {}
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
            columns[key] = derived.Ragged(np.concatenate(arrays), lengths)
        else:
            return None
    return keys, columns


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _byte_rows(array: np.ndarray) -> np.ndarray:
    """``array`` as ``[len, bytes per entry]`` uint8 (C-contiguous), one row per first-axis entry."""
    per = int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).reshape(array.shape[0], per)


def _column_nbytes(col: derived.Column) -> int:
    return col.values.nbytes + col.lengths.nbytes if isinstance(col, derived.Ragged) else col.nbytes


def _row_digests(schema: str, columns: dict[str, derived.Column], rows: int) -> np.ndarray:
    """A 16-byte blake2b digest per row over every stored column (in key order) and the schema."""
    seed = hashlib.blake2b(schema.encode("utf-8"), digest_size=_ROW_DIGEST)
    parts: list[_RowSlicer] = []
    for key in sorted(columns):
        col = columns[key]
        if isinstance(col, derived.Ragged):
            parts.append(_RowSlicer(_byte_rows(col.values), _offsets(col.lengths)))
            parts.append(_RowSlicer(_byte_rows(np.asarray(col.lengths, dtype="<i8")), None))
        else:
            parts.append(_RowSlicer(_byte_rows(col), None))
    out = np.empty((rows, _ROW_DIGEST), dtype=np.uint8)
    for i in range(rows):
        h = seed.copy()
        for part in parts:
            h.update(part(i).data)
        out[i] = np.frombuffer(h.digest(), dtype=np.uint8)
    return out


@dataclass(frozen=True)
class _RowSlicer:
    """Row ``i`` of a stacked column (``offsets`` None) or of a ragged one's values."""

    values: np.ndarray
    offsets: np.ndarray | None

    def __call__(self, i: int) -> np.ndarray:
        if self.offsets is None:
            return self.values[i, ...]
        return self.values[self.offsets[i] : self.offsets[i + 1]]


def _values(col: derived.Column) -> np.ndarray:
    return col.values if isinstance(col, derived.Ragged) else col


def _narrowed(col: derived.Column) -> derived.Column:
    """The column in the smallest integer types that hold it (ragged lengths too)."""
    if isinstance(col, derived.Ragged):
        return derived.Ragged(_narrowed(col.values), _narrowed(col.lengths))  # type: ignore[arg-type]
    kind = narrowest(col)
    return col if kind == col.dtype else col.astype(kind)


def _column_schema(col: derived.Column) -> list[Any]:
    if isinstance(col, derived.Ragged):
        return ["ragged", col.values.dtype.str, list(col.values.shape[1:])]
    return ["stacked", col.dtype.str, list(col.shape[1:])]


def _take(col: derived.Column, rows: np.ndarray) -> derived.Column:
    if isinstance(col, derived.Ragged):
        off = _offsets(col.lengths)
        idx = [np.arange(off[i], off[i + 1]) for i in rows]
        flat = np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64)
        return derived.Ragged(col.values[flat], col.lengths[rows])
    taken: np.ndarray = col[rows]
    return taken


@dataclass
class Frame:
    """Encodes one tree; ``base`` (row digests of the same lane in the base) makes it a delta."""

    base: RowIndex | None = None
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
        return _LEN.pack(len(head)) + head

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

    def _column(self, col: derived.Column, logical: np.dtype[Any], where: str) -> Any:
        if isinstance(col, derived.Ragged):
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
        reduced: derived.Reduced | None = None
        name: str | None = None
        for fields in derived.registered():
            reduced = fields.reduce(columns)
            if reduced is not None:
                name = fields.name
                break
        logical = {k: v for k, v in columns.items() if reduced is None or k not in reduced.derived}
        if reduced is not None:
            logical.update({f"~{k}": v for k, v in reduced.stored.items()})
        # Narrowed before hashing: half the bytes to hash for token ids, and stored as hashed.
        stored = {k: _narrowed(v) for k, v in logical.items()}
        dtypes = {k: _values(v).dtype for k, v in logical.items()}
        del logical, columns  # the stacked copies (derived fields, int32 ids) are done with
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


# -- decoding -------------------------------------------------------------------------------
class FrameError(ValueError):
    """A frame's structure is malformed (the caller names the file and the frame)."""


def _split(raw: bytes) -> tuple[Any, memoryview]:
    if len(raw) < _LEN.size:
        raise FrameError("frame shorter than its length prefix")
    (head_len,) = _LEN.unpack_from(raw)
    if head_len > len(raw) - _LEN.size:
        raise FrameError(f"header length {head_len} runs past the frame ({len(raw)} bytes)")
    head = raw[_LEN.size : _LEN.size + head_len]
    try:
        tree = json.loads(head.decode("utf-8"))
    except RecursionError as exc:
        raise FrameError("structure nested too deeply") from exc
    except ValueError as exc:  # not UTF-8, not JSON
        raise FrameError(f"header is not JSON ({exc})") from exc
    return tree, memoryview(raw)[_LEN.size + head_len :]


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise FrameError(f"{what} should be a non-negative integer, found {value!r}")
    return value


@dataclass
class _Decoder:
    payload: memoryview
    base: Any  # the base lane's plain tree, for delta rows

    def array(self, body: Any) -> Any:
        if not isinstance(body, list) or len(body) != 6:
            raise FrameError(f"array node {body!r} is not [dtype, stored, shape, offset, size, scalar]")
        dtype, stored, shape, start, size, scalar = body
        if not isinstance(dtype, str) or not isinstance(stored, str) or not isinstance(shape, list):
            raise FrameError(f"array node {body!r} has malformed dtypes or shape")
        start, size = _int(start, "array offset"), _int(size, "array size")
        if start + size > len(self.payload):
            raise FrameError(f"array at {start}+{size} runs past the payload ({len(self.payload)} bytes)")
        logical, kept = np.dtype(dtype), np.dtype(stored)
        if logical.hasobject or kept.hasobject:
            raise FrameError(f"array node declares an object dtype ({dtype}, {stored})")
        dims = [_int(d, "array dimension") for d in shape]
        arr = np.frombuffer(self.payload[start : start + size], dtype=kept).reshape(dims)
        arr = arr.astype(logical) if kept != logical else arr.copy()
        return arr[()] if scalar is True else arr

    def column(self, node: Any) -> derived.Column:
        if isinstance(node, dict) and len(node) == 1 and "a" in node:
            return self._ndarray(node["a"])
        if (
            isinstance(node, dict)
            and len(node) == 1
            and isinstance(node.get("r"), list)
            and len(node["r"]) == 2
        ):
            values, lengths = (self._ndarray(n) for n in node["r"])
            if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths < 0).any():
                raise FrameError("ragged column lengths are not a list of non-negative integers")
            if values.ndim < 1 or int(lengths.sum()) != values.shape[0]:
                raise FrameError("ragged column lengths do not add up to its values")
            return derived.Ragged(values, lengths)
        raise FrameError(f"column node {str(node)[:80]} is neither stacked nor ragged")

    def _ndarray(self, node: Any) -> np.ndarray:
        if not isinstance(node, dict) or len(node) != 1 or "~a" not in node:
            raise FrameError(f"expected an array node, found {str(node)[:80]}")
        arr = self.array(node["~a"])
        if not isinstance(arr, np.ndarray):
            raise FrameError("expected an array, found a scalar")
        return arr

    def columns(self, body: Any, path: Path) -> list[Any]:
        if not isinstance(body, dict) or set(body) != {"n", "keys", "cols", "derived", "base"}:
            raise FrameError(
                f"column list node has keys {sorted(body) if isinstance(body, dict) else body!r}"
            )
        n = _int(body["n"], "row count")
        keys = body["keys"]
        if (
            not isinstance(keys, list)
            or not all(isinstance(k, str) for k in keys)
            or not isinstance(body["cols"], dict)
        ):
            raise FrameError("column list keys or columns are malformed")
        cols = {k: self.column(v) for k, v in body["cols"].items()}
        refs = None if body["base"] is None else self._ndarray(body["base"])
        new = n if refs is None else int((refs < 0).sum())
        if refs is not None and (refs.shape != (n,) or refs.dtype.kind not in "iu"):
            raise FrameError(f"base row references do not cover the {n} rows")
        for k, c in cols.items():
            rows = c.lengths.size if isinstance(c, derived.Ragged) else (c.shape[0] if c.ndim else -1)
            if rows != new:
                raise FrameError(f"column {k!r} has {rows} rows, expected {new}")
        if body["derived"] is not None:
            cols = self._rebuild(body["derived"], cols)
        if set(cols) != set(keys):
            raise FrameError(f"columns {sorted(cols)} do not match the element keys {sorted(keys)}")
        rows_out = _rows(keys, cols, new)
        if refs is None:
            return rows_out
        base = _at(self.base, path)
        out: list[Any] = []
        fresh = iter(rows_out)
        for r in refs.tolist():
            if r < 0:
                out.append(next(fresh))
            elif r < len(base):
                out.append(base[r])
            else:
                raise FrameError(f"row refers to base row {r}, the base list has {len(base)}")
        return out

    def _rebuild(self, spec: Any, cols: dict[str, derived.Column]) -> dict[str, derived.Column]:
        if (
            not isinstance(spec, list)
            or len(spec) != 2
            or not isinstance(spec[0], str)
            or not isinstance(spec[1], list)
        ):
            raise FrameError(f"derived-fields node {spec!r} is not [name, fields]")
        fields = derived.lookup(spec[0])
        if fields is None:
            raise FrameError(
                f"columns were reduced by derived fields {spec[0]!r}, which no imported operator "
                f"declares; import the operator's module (e.g. zephon_flow.operators) first"
            )
        kept = {k: v for k, v in cols.items() if not k.startswith("~")}
        stored = {k[1:]: v for k, v in cols.items() if k.startswith("~")}
        names = tuple(str(x) for x in spec[1])
        try:
            rebuilt = fields.rebuild(kept, stored, names)
        except (KeyError, IndexError, TypeError, AssertionError, ValueError) as exc:
            raise FrameError(f"derived fields {spec[0]!r} cannot be rebuilt: {exc!r}") from exc
        if set(rebuilt) != set(names):
            raise FrameError(f"derived fields {spec[0]!r} rebuilt {sorted(rebuilt)}, expected {list(names)}")
        return {**kept, **rebuilt}

    def tree(self, node: Any, path: Path) -> Any:
        if isinstance(node, list):
            return [self.tree(v, (*path, i)) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            ((tag, body),) = node.items()
            if tag == "~f":
                if not isinstance(body, str):
                    raise FrameError(f"float node {body!r} is not a hex string")
                return float.fromhex(body)
            if tag == "~b":
                if not isinstance(body, list) or len(body) != 2:
                    raise FrameError(f"bytes node {body!r} is not [offset, size]")
                start, size = _int(body[0], "bytes offset"), _int(body[1], "bytes size")
                if start + size > len(self.payload):
                    raise FrameError(f"bytes at {start}+{size} run past the payload")
                return bytes(self.payload[start : start + size])
            if tag == "~a":
                return self.array(body)
            if tag == "~c":
                return self.columns(body, path)
            if tag == "~t":
                if not isinstance(body, list):
                    raise FrameError("tuple node is not a list")
                return tuple(self.tree(v, ()) for v in body)
            if tag == "~d":
                if not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2 for p in body):
                    raise FrameError("dict node is not a list of [key, value] pairs")
                return {_hashable(self.tree(k, ())): self.tree(v, ()) for k, v in body}
            if tag.startswith("~"):
                raise FrameError(f"unknown node tag {tag!r}")
        return {k: self.tree(v, (*path, k)) for k, v in node.items()}


def _hashable(key: Any) -> Any:
    key = tuple(key) if isinstance(key, list) else key
    hash(key)  # TypeError for a dict or array key: the caller reports it as malformed
    return key


def _rows(keys: list[str], cols: dict[str, derived.Column], n: int) -> list[dict[str, Any]]:
    getters: list[_RowSlicer] = []
    for key in keys:
        col = cols[key]
        if isinstance(col, derived.Ragged):
            getters.append(_RowSlicer(col.values, _offsets(col.lengths)))
        else:
            if col.ndim == 0 or col.shape[0] != n:
                raise FrameError(f"column {key!r} has the wrong number of rows")
            getters.append(_RowSlicer(col, None))
    return [dict(zip(keys, (g(i) for g in getters), strict=True)) for i in range(n)]


def _at(tree: Any, path: Path) -> list[Any]:
    node = tree
    for step in path:
        found = isinstance(step, str) and isinstance(node, dict) and step in node
        if found or (isinstance(step, int) and isinstance(node, list) and step < len(node)):
            node = node[step]
        else:
            raise FrameError(f"the base has no element list at {'.'.join(map(str, path))}")
    if not isinstance(node, list):
        raise FrameError(f"the base holds no element list at {'.'.join(map(str, path))}")
    return node


def decode_frame(raw: bytes, base: Any = None) -> Any:
    """The tree in a frame; ``base`` is the same lane's tree in the base checkpoint (for deltas)."""
    tree, payload = _split(raw)
    try:
        return _Decoder(payload, base).tree(tree, ())
    except RecursionError as exc:
        raise FrameError("structure nested too deeply") from exc
    except (TypeError, KeyError, AttributeError, OverflowError) as exc:
        raise FrameError(f"malformed structure ({exc!r})") from exc
    except ValueError as exc:  # numpy: bad dtype string, reshape, astype
        if isinstance(exc, FrameError):
            raise
        raise FrameError(f"malformed structure ({exc})") from exc


def index_tree(frame: Frame) -> dict[str, Any]:
    """The plain tree of a frame's row index (encode it with a fresh ``Frame``)."""
    return {"lists": [[list(path), n, digests, refs] for path, n, digests, refs in frame.index]}


def full_digests(tree: Any, base: RowIndex | None) -> RowIndex:
    """Every row's digest per element list, from a decoded ``index_tree`` and, for the rows
    taken from the base, the base's own digests (``base``: the same lane's, in the base)."""
    lists = tree.get("lists") if isinstance(tree, dict) else None
    if not isinstance(lists, list):
        raise FrameError("the row index is not a list of element lists")
    out: RowIndex = {}
    for entry in lists:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], list)):
            raise FrameError("a row index entry is not [path, rows, digests, refs]")
        path: Path = tuple(entry[0])
        n = _int(entry[1], "row count")
        stored, refs = entry[2], entry[3]
        if refs is None:
            refs = np.full(n, -1, dtype=np.int64)
        if not (isinstance(stored, np.ndarray) and isinstance(refs, np.ndarray) and refs.dtype.kind in "iu"):
            raise FrameError("a row index entry holds no digest or reference arrays")
        refs = refs.astype(np.int64)
        new = refs < 0
        if refs.shape != (n,) or stored.shape != (int(new.sum()), _ROW_DIGEST):
            raise FrameError(f"row digests do not cover the {n} rows")
        full = np.empty((n, _ROW_DIGEST), dtype=np.uint8)
        full[new] = stored
        if not new.all():
            offered = None if base is None else base.get(path)
            if offered is None or int(refs.max()) >= len(offered):
                raise FrameError("rows refer to base rows whose digests the base does not have")
            full[~new] = offered[refs[~new]]
        out[path] = full
    return out
