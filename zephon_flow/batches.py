"""Assembling samples into batches, and the digest that identifies a global batch."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_flow.errors import StageError

Batch = dict[str, np.ndarray]


def stack(samples: Sequence[Any], *, where: str) -> Batch:
    """Stacks samples (dicts of equally shaped arrays, or arrays) into one dict of arrays."""
    if not samples:
        raise StageError(f"{where}: no samples to stack")
    first = samples[0]
    if isinstance(first, Mapping):
        keys = sorted(first)
        for i, s in enumerate(samples):
            if not isinstance(s, Mapping) or sorted(s) != keys:
                raise StageError(
                    f"{where}: sample {i} has keys {sorted(s) if isinstance(s, Mapping) else type(s).__name__}, expected {keys}"
                )
        return {k: _stack_field([s[k] for s in samples], where=f"{where}, field {k!r}") for k in keys}
    return {"data": _stack_field(list(samples), where=where)}


def _stack_field(values: list[Any], *, where: str) -> np.ndarray:
    arrays = [np.asarray(v) for v in values]
    shape, dtype = arrays[0].shape, arrays[0].dtype
    for i, a in enumerate(arrays):
        if a.shape != shape or a.dtype != dtype:
            raise StageError(
                f"{where}: sample {i} is {a.dtype}{list(a.shape)}, expected {dtype}{list(shape)}"
            )
    return np.stack(arrays)


def batch_digest(batch: Mapping[str, np.ndarray]) -> str:
    """sha256 over every field's name, dtype, shape and bytes, in sorted field order."""
    h = hashlib.sha256()
    for key in sorted(batch):
        arr = np.ascontiguousarray(batch[key])
        h.update(f"{key}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def concat(parts: Sequence[Mapping[str, np.ndarray]]) -> Batch:
    """Concatenates rank slices (in rank order) back into a global batch."""
    keys = sorted(parts[0])
    return {k: np.concatenate([p[k] for p in parts]) for k in keys}
