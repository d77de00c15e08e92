"""Facts about data files kept on disk between runs (seek indexes, a tar's sample offsets), keyed by the file.

Listing is paid at every start of a trainer: a ``.gz`` file's seek points, every member header
of every WebDataset shard. Such a fact is a pure function of the file's bytes, so it is cached
under ``$ZEPHON_CACHE_DIR`` (default ``~/.cache/zephon-flow/index``), keyed by the kind of fact,
the file's path, size and modification time, and a hash of its first and last MiB. An entry
that cannot be read is rebuilt; a cache that cannot be written only costs a rebuild next time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any

from zephon_flow.core import files

#: How much of each end of the file goes into the key.
HASHED = 1 << 20


def cache_dir() -> str:
    """Where cached facts live: ``$ZEPHON_CACHE_DIR`` or ``~/.cache/zephon-flow/index``."""
    return os.environ.get("ZEPHON_CACHE_DIR") or os.path.expanduser("~/.cache/zephon-flow/index")


def key(path: str, info: files.FileInfo, kind: str, *, operator: str) -> str:
    """The cache key of fact ``kind`` (its name and version) about the file at ``path``."""
    name = os.path.abspath(files.local_path(path)) if files.is_local(path) else path
    h = hashlib.sha256()
    h.update(f"{kind}\0{name}\0{info.size}\0{info.mtime_ns}\0".encode())
    h.update(files.read_bytes(path, 0, HASHED, operator=operator))
    h.update(files.read_bytes(path, max(0, info.size - HASHED), HASHED, operator=operator))
    return h.hexdigest()[:40]


def load_json(name: str) -> Any | None:
    """The JSON value stored as ``name`` in the cache folder, or None (absent or unreadable)."""
    try:
        with open(os.path.join(cache_dir(), name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def store_json(name: str, value: Any) -> None:
    """Stores ``value`` as ``name`` in the cache folder, all or nothing; failures are ignored."""
    body = json.dumps(value).encode()
    with contextlib.suppress(OSError):
        os.makedirs(cache_dir(), exist_ok=True)
        files.atomic_write(os.path.join(cache_dir(), name), lambda f: f.write(body))
