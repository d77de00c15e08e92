"""Lane snapshots packed in an owner for its coordinator: each immutable item pickled once.

Every ``snapshot_every`` steps the coordinator keeps a copy of each owner's lane snapshots, what
a replacement starts from if the owner dies. Pickled whole, that copy costs the owner a pickle
of every buffered element each time (the demo's shuffle buffers and pending outputs: ~4 MB, a
few thousand small arrays) and the coordinator an unpickle of it. Most of those elements were
in the previous snapshot too: by the state contract (``runners/userstate.py``
``snapshot_value``), a state value's top-level list or dict is copied per snapshot, but what
it holds, like a lane's pending outputs, is never changed in place once stored. So a
``SnapshotPacker`` pickles each such item once, keeps its bytes while a snapshot holds it, and
packs a snapshot as a small pickled skeleton whose items are references into a list of those
bytes (``PackedSnapshot``). The coordinator keeps the packed form as it is (bytes, nothing to
rebuild) and unpacks it only to start a replacement; it tells the owner which items it holds
already (``Held``), and the owner sends only the others. A transient form between two
processes of one run, never written anywhere: checkpoints keep their own codec.
"""

from __future__ import annotations

import io
import pickle
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_flow.core.checkpoint.state import LaneState

#: Types of items worth pickling once and referring to (an int or a string is cheaper inline).
_ITEM_TYPES = (dict, list, tuple, np.ndarray)
#: Array kinds whose bytes, dtype string and shape are the whole array (bool, integers,
#: floats, complex): pickled as raw bytes, several times faster than numpy's own pickling.
_RAW_KINDS = frozenset("biufc")


#: dtype -> its string when its kind is raw (else None): asked of every array packed.
_DTYPE_STRINGS: dict[np.dtype[Any], str | None] = {}
#: The first byte of an item's bytes: what follows is the pickle of a dict of raw arrays'
#: fields, of one raw array's fields, or of the item itself.
_ARRAYS, _ARRAY, _PICKLED = b"d", b"a", b"p"


def _raw(value: Any) -> tuple[str, tuple[int, ...], bytes] | None:
    """An array's dtype string, shape and bytes, if they are the whole array (else None)."""
    if type(value) is not np.ndarray:
        return None
    dtype = value.dtype
    text = _DTYPE_STRINGS.get(dtype, "")
    if text == "":
        if len(_DTYPE_STRINGS) > 1024:
            _DTYPE_STRINGS.clear()
        text = _DTYPE_STRINGS[dtype] = dtype.str if dtype.kind in _RAW_KINDS else None
    if text is None or not value.flags.c_contiguous:
        return None
    return text, value.shape, value.tobytes()


def _array(dtype: str, shape: tuple[int, ...], data: bytes) -> np.ndarray:
    """An array rebuilt from its raw bytes (its own, writable copy, as unpickling gives)."""
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()


def _dumps(item: Any) -> bytes:
    """One item's bytes (``_loads`` gives it back): an array, or a dict of arrays with string
    keys (an element: ``input_ids``...), as each array's dtype string, shape and raw bytes,
    several times faster than numpy's own pickling; anything else pickled as it is."""
    if type(item) is dict:
        fields = []
        for key, value in item.items():
            raw = _raw(value) if type(key) is str else None
            if raw is None:
                break
            fields.append((key, *raw))
        else:
            return _ARRAYS + pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)
    elif (raw := _raw(item)) is not None:
        return _ARRAY + pickle.dumps(raw, protocol=pickle.HIGHEST_PROTOCOL)
    return _PICKLED + pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)


def _loads(data: bytes) -> Any:
    """The item ``_dumps`` gave ``data`` for."""
    kind, body = data[:1], memoryview(data)[1:]
    if kind == _ARRAYS:
        return {key: _array(dtype, shape, raw) for key, dtype, shape, raw in pickle.loads(body)}
    if kind == _ARRAY:
        return _array(*pickle.loads(body))
    if kind == _PICKLED:
        return pickle.loads(body)
    raise ValueError(
        f"a packed snapshot's item starts with {bytes(kind)!r}, not one of {_ARRAYS + _ARRAY + _PICKLED!r}"
    )


#: What a coordinator holds of an owner's snapshot: the packer that made it and its items' keys.
Held = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class PackedSnapshot:
    """An owner's lane snapshots at ``step``, made by the packer named ``source``:
    ``skeleton`` (the ``{lane: LaneState}`` mapping pickled with each item replaced by its
    key), ``keys`` (the keys it refers to) and ``items`` (key -> the item pickled on its own:
    all of them, or as the owner sends it, only those the coordinator did not hold; see
    ``complete``)."""

    step: int
    source: str
    skeleton: bytes
    keys: tuple[int, ...]
    items: dict[int, bytes]

    @property
    def nbytes(self) -> int:
        return len(self.skeleton) + sum(len(b) for b in self.items.values())

    def held(self) -> Held:
        """What to tell the owner's packer at the next gather (``SnapshotPacker.pack``)."""
        return self.source, self.keys

    def complete(self, before: PackedSnapshot | None) -> PackedSnapshot:
        """This snapshot with every item it refers to: those the owner did not send (it was
        told ``before.held()``) taken from ``before``. A ``KeyError`` if one is in neither."""
        if all(key in self.items for key in self.keys):
            return self
        if before is None or before.source != self.source:
            raise KeyError(f"a packed snapshot of {self.source} refers to items sent before, not held here")
        items = {key: self.items[key] if key in self.items else before.items[key] for key in self.keys}
        return PackedSnapshot(self.step, self.source, self.skeleton, self.keys, items)

    def unpack(self) -> dict[int, LaneState]:
        """The ``{lane: LaneState}`` mapping that was packed (items shared as they were);
        a complete snapshot only (``complete``)."""
        items = {key: _loads(self.items[key]) for key in self.keys}
        unpickler = pickle.Unpickler(io.BytesIO(self.skeleton))
        unpickler.persistent_load = items.__getitem__  # type: ignore[assignment]
        lanes: dict[int, LaneState] = unpickler.load()
        return lanes


def _items(snaps: Mapping[int, LaneState]) -> Iterator[Any]:
    """The items of lane states that are never changed in place once stored: what each stage's
    state values (lists and dicts) hold, and the pending outputs."""
    for ls in snaps.values():
        for stage in ls.stages.values():
            for value in stage.values.values():
                if isinstance(value, list):
                    yield from value
                elif isinstance(value, dict):
                    yield from value.values()
        yield from ls.pending


class SnapshotPacker:
    """Packs an owner's lane snapshots (``pack``), pickling each item only the first time a
    snapshot holds it: the bytes of the items of the last packed snapshot are kept, by the
    item's identity (the item itself is kept with them, so its identity is not reused), with
    a key unique to this packer (``source``)."""

    def __init__(self) -> None:
        self.source = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._next_key = 0
        self._cache: dict[int, tuple[Any, int, bytes]] = {}
        #: Items pickled by the last ``pack``, and items it took from the cache (for tests and
        #: the benchmark).
        self.pickled = 0
        self.reused = 0

    def pack(self, step: int, snaps: Mapping[int, LaneState], held: Held | None = None) -> PackedSnapshot:
        """``snaps`` packed; the items of ``held`` (what the coordinator holds: the
        ``held()`` of a snapshot this packer made) are referred to, not sent again."""
        known = set(held[1]) if held is not None and held[0] == self.source else set()
        with self._lock:
            cache: dict[int, tuple[Any, int, bytes]] = {}
            pickled = reused = 0
            for item in _items(snaps):
                ident = id(item)
                if ident in cache or not isinstance(item, _ITEM_TYPES):
                    continue
                hit = self._cache.get(ident)
                if hit is None:
                    hit = (item, self._next_key, _dumps(item))
                    self._next_key += 1
                    pickled += 1
                else:
                    reused += 1
                cache[ident] = hit
            out = io.BytesIO()
            pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
            pickler.persistent_id = lambda obj: None if (hit := cache.get(id(obj))) is None else hit[1]  # type: ignore[method-assign]
            pickler.dump(dict(snaps))
            self._cache, self.pickled, self.reused = cache, pickled, reused
            keys = tuple(key for _, key, _ in cache.values())
            items = {key: data for _, key, data in cache.values() if key not in known}
            return PackedSnapshot(step, self.source, out.getvalue(), keys, items)
