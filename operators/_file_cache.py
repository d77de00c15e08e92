"""Facts about data files kept on disk between runs (seek indexes, a tar's sample offsets), keyed by the file.

Listing is paid at every start of a trainer: a ``.gz`` file's seek points, every member header
of every WebDataset shard. Such a fact is a pure function of the file's bytes, so it is cached
under ``$ZEPHON_CACHE_DIR`` (default ``~/.cache/zephon-flow/index``), keyed by the kind of fact,
the file's path, size and modification time, and a hash of its first and last MiB. An entry
that cannot be read is rebuilt; a cache that cannot be written only costs a rebuild next time.
A local file's key is found again from its ``stat`` alone (``stat_key``), so listing many
unchanged files reads none of their bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from typing import Any, NamedTuple

from zephon_flow.core import files

#: How much of each end of the file goes into the key.
HASHED = 1 << 20
#: A file whose inode changed (ctime) or whose data changed (mtime) less than this many seconds
#: ago gets no stat note: a filesystem's timestamps can be that coarse, so a write in the same
#: tick would leave them as they are (git's "racily clean" files).
RACY_SECONDS = 2.0
_HEX40 = re.compile(r"[0-9a-f]{40}")


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


class Stat(NamedTuple):
    """What tells one version of a local file from another without reading it: the kernel sets
    ctime at every write, rename or ``utime`` of the inode, and no call sets it back, so a file
    rewritten or replaced under its name, even with its size and mtime restored, has another."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    def settled(self) -> bool:
        """Whether both its times are more than ``RACY_SECONDS`` old."""
        return time.time_ns() - max(self.mtime_ns, self.ctime_ns) > RACY_SECONDS * 1e9


def stat_of(path: str) -> Stat | None:
    """A local file's ``Stat`` (None for other files, or one gone: the hash names the error)."""
    if not files.is_local(path):
        return None
    local = files.local_path(path)
    try:
        st = os.stat(local)
    except OSError:
        return None
    return Stat(os.path.abspath(local), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def stat_key(
    path: str, info: files.FileInfo, kind: str, *, operator: str, notes: str, stat: Stat | None
) -> str:
    """``key``, found from the file's ``stat`` alone when a note (``<notes>-stat-*.json``)
    made at an earlier listing says which key that exact ``Stat`` had, so an unchanged local
    file is not read; a file changed in any way since has another stat and is hashed again.
    A file without a stat (not local) or changed less than ``RACY_SECONDS`` ago is hashed every
    time, and gets no note."""
    settled = stat if stat is not None and stat.settled() else None
    if settled is None:
        return key(path, info, kind, operator=operator)
    note = f"{notes}-stat-" + hashlib.sha256(repr((kind, *settled)).encode()).hexdigest()[:40] + ".json"
    noted = load_json(note)
    if isinstance(noted, str) and _HEX40.fullmatch(noted):
        return noted
    found = key(path, info, kind, operator=operator)
    store_json(note, found)
    return found
