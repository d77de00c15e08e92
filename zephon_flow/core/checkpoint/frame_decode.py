"""Decoding checkpoint format 3's compact frames (see ``frame_encode``), checking every node's form.

Anything malformed raises ``FrameError`` (the caller names the file and the frame); a frame that
stores rows by reference to its base is decoded against the base's same lane.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_flow.core.checkpoint import derived_fields
from zephon_flow.core.checkpoint.frame_encode import (
    LEN_PREFIX,
    ROW_DIGEST,
    Path,
    RowIndex,
    RowSlicer,
    offsets,
)
from zephon_flow.core.checkpoint.packed_segments import BUILTIN


class FrameError(ValueError):
    """A frame's structure is malformed (the caller names the file and the frame)."""


def _split(raw: bytes) -> tuple[Any, memoryview]:
    if len(raw) < LEN_PREFIX.size:
        raise FrameError("frame shorter than its length prefix")
    (head_len,) = LEN_PREFIX.unpack_from(raw)
    if head_len > len(raw) - LEN_PREFIX.size:
        raise FrameError(f"header length {head_len} runs past the frame ({len(raw)} bytes)")
    head = raw[LEN_PREFIX.size : LEN_PREFIX.size + head_len]
    try:
        tree = json.loads(head.decode("utf-8"))
    except RecursionError as exc:
        raise FrameError("structure nested too deeply") from exc
    except ValueError as exc:  # not UTF-8, not JSON
        raise FrameError(f"header is not JSON ({exc})") from exc
    return tree, memoryview(raw)[LEN_PREFIX.size + head_len :]


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise FrameError(f"{what} should be a non-negative integer, found {value!r}")
    return value


@dataclass
class _Decoder:
    payload: memoryview
    base: Any  # the base lane's plain tree, for delta rows
    codecs: derived_fields.DerivedCodecs

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

    def column(self, node: Any) -> derived_fields.Column:
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
            return derived_fields.Ragged(values, lengths)
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
            rows = c.lengths.size if isinstance(c, derived_fields.Ragged) else (c.shape[0] if c.ndim else -1)
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

    def _rebuild(self, spec: Any, cols: dict[str, derived_fields.Column]) -> dict[str, derived_fields.Column]:
        if (
            not isinstance(spec, list)
            or len(spec) != 2
            or not isinstance(spec[0], str)
            or not isinstance(spec[1], list)
        ):
            raise FrameError(f"derived-fields node {spec!r} is not [name, fields]")
        fields = self.codecs.lookup(spec[0])
        if fields is None:
            raise FrameError(
                f"columns were reduced by derived fields {spec[0]!r}, which neither the checkpoint "
                f"format nor the codecs handed in ({', '.join(self.codecs.names()) or 'none'}) know; "
                f"read it with the codecs of the pipeline that wrote it (spec.compile().derived_codecs)"
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


def _rows(keys: list[str], cols: dict[str, derived_fields.Column], n: int) -> list[dict[str, Any]]:
    getters: list[RowSlicer] = []
    for key in keys:
        col = cols[key]
        if isinstance(col, derived_fields.Ragged):
            getters.append(RowSlicer(col.values, offsets(col.lengths)))
        else:
            if col.ndim == 0 or col.shape[0] != n:
                raise FrameError(f"column {key!r} has the wrong number of rows")
            getters.append(RowSlicer(col, None))
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


def decode_frame(raw: bytes, base: Any = None, codecs: derived_fields.DerivedCodecs = BUILTIN) -> Any:
    """The tree in a frame; ``base`` is the same lane's tree in the base checkpoint (for deltas);
    ``codecs`` rebuild the derived fields the frame left out (by the name it records)."""
    tree, payload = _split(raw)
    try:
        return _Decoder(payload, base, codecs).tree(tree, ())
    except RecursionError as exc:
        raise FrameError("structure nested too deeply") from exc
    except (TypeError, KeyError, AttributeError, OverflowError) as exc:
        raise FrameError(f"malformed structure ({exc!r})") from exc
    except ValueError as exc:  # numpy: bad dtype string, reshape, astype
        if isinstance(exc, FrameError):
            raise
        raise FrameError(f"malformed structure ({exc})") from exc


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
        if refs.shape != (n,) or stored.shape != (int(new.sum()), ROW_DIGEST):
            raise FrameError(f"row digests do not cover the {n} rows")
        full = np.empty((n, ROW_DIGEST), dtype=np.uint8)
        full[new] = stored
        if not new.all():
            offered = None if base is None else base.get(path)
            if offered is None or int(refs.max()) >= len(offered):
                raise FrameError("rows refer to base rows whose digests the base does not have")
            full[~new] = offered[refs[~new]]
        out[path] = full
    return out
