"""The digest a checkpoint records of each lane's next window, so a resume can prove its stream.

A lane's state at step ``b`` is taken when the lane closes window ``b - 1``; its *check* is
made when the lane makes window ``b``: a digest of that window's samples, and of the records
the lane read while making it (their ids, ``(source, split, offset)``, and the digests of the
stateless front's outputs for them). Both depend only on the lane, never on ranks, workers or
backends, so the check holds under any topology. A lane restored from the state makes window
``b`` again and compares: a record that reads differently (a data file edited in place, a
tokenizer or a stateless DoFn that gives other tokens) is found even when its sequence sits in
a shuffle buffer for many steps; a window that differs while the records agree names the
stateful operators or the libraries under them.

What is stored stays small whatever the window: the record list is cut into at most
``GROUPS`` runs, each kept as its first record's id and an 8-byte digest (so a changed record
is named exactly when a window reads up to ``GROUPS`` records, else by the run it lies in).
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_flow.core.errors import CorruptStateError

#: The most record runs a check keeps (each: a record id and an 8-byte digest).
GROUPS = 32
#: Bytes of a run's digest, and of the window's.
RUN_BYTES = 8
WINDOW_BYTES = 16
#: The version of the canonical form hashed here; a check of another version is not compared.
CHECK_VERSION = 1
_NO_DOC = (-1, -1, -1)

#: A record read while making a window: its id (None: no id) and the front's outputs for it.
FedOutputs = tuple[tuple[int, int, int] | None, Sequence[Any]]
#: Names a record id for a message: "the record at <path> offset <n> (source 'web')".
Namer = Callable[[tuple[int, int, int]], str]


def _feed(h: Any, value: Any) -> None:
    """Feeds ``value`` to hash ``h`` in a canonical form: field names sorted, arrays by dtype,
    shape and bytes, so equal values hash equally on every backend."""
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if array.dtype.hasobject:
            h.update(b"o" + struct.pack("<q", array.size))
            for item in array.reshape(-1):
                _feed(h, item)
            return
        head = f"a{array.dtype.str}{array.shape}".encode()
        h.update(struct.pack("<q", len(head)) + head)
        h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    elif isinstance(value, Mapping):
        h.update(b"d" + struct.pack("<q", len(value)))
        for key in sorted(value, key=str):
            _feed(h, str(key))
            _feed(h, value[key])
    elif isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        h.update(b"b" + struct.pack("<q", len(raw)) + raw)
    elif isinstance(value, str):
        encoded = value.encode("utf-8", "surrogatepass")
        h.update(b"s" + struct.pack("<q", len(encoded)) + encoded)
    elif isinstance(value, list | tuple):
        h.update(b"l" + struct.pack("<q", len(value)))
        for item in value:
            _feed(h, item)
    elif value is None or isinstance(value, bool | int | float | complex):
        text = f"{type(value).__name__}:{value!r}".encode()
        h.update(b"v" + struct.pack("<q", len(text)) + text)
    else:  # an object: its type, and its repr unless that names a memory address
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        shown = repr(value)
        named = (kind if " at 0x" in shown else f"{kind}:{shown}").encode()
        h.update(b"x" + struct.pack("<q", len(named)) + named)


@dataclass(frozen=True, eq=False)
class WindowCheck:
    """What a checkpoint records of a lane's next window (see the module's docstring).

    ``samples``: the window's real samples (fewer than the window at the end of a finite
    input); ``window``: their digest; ``records``: how many records the lane read making it;
    ``runs``: the first record id of each run of records (``-1`` where a record had none);
    ``run_digests``: each run's digest, ``RUN_BYTES`` bytes each.
    """

    samples: int
    window: bytes
    records: int
    runs: np.ndarray
    run_digests: bytes

    @classmethod
    def of(cls, samples: Sequence[Any], fed: Sequence[FedOutputs]) -> WindowCheck:
        """The check of a window made of ``samples`` after reading ``fed``."""
        h = hashlib.sha256()  # sha256 over blake2b: twice as fast here (SHA extensions)
        h.update(struct.pack("<q", len(samples)))
        for sample in samples:
            _feed(h, sample)
        bounds = run_bounds(len(fed))
        ids = np.full((len(bounds), 3), -1, dtype=np.int64)
        digests = []
        for g, (start, stop) in enumerate(bounds):
            run = hashlib.sha256()
            for doc, outputs in fed[start:stop]:
                _feed(run, _NO_DOC if doc is None else doc)
                _feed(run, list(outputs))
            digests.append(run.digest()[:RUN_BYTES])
            first = fed[start][0]
            if first is not None:
                ids[g] = first
        return cls(len(samples), h.digest()[:WINDOW_BYTES], len(fed), ids, b"".join(digests))

    @property
    def digest(self) -> str:
        """One hex digest of the whole check (for display and comparison)."""
        h = hashlib.sha256()
        h.update(struct.pack("<qq", self.samples, self.records))
        h.update(self.window)
        h.update(np.ascontiguousarray(self.runs, dtype="<i8").tobytes())
        h.update(self.run_digests)
        return h.hexdigest()[: 2 * WINDOW_BYTES]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WindowCheck):
            return NotImplemented
        return (
            self.samples == other.samples
            and self.window == other.window
            and self.records == other.records
            and np.array_equal(self.runs, other.runs)
            and self.run_digests == other.run_digests
        )

    __hash__ = None  # type: ignore[assignment]

    def run_digest(self, g: int) -> bytes:
        return self.run_digests[g * RUN_BYTES : (g + 1) * RUN_BYTES]

    def to_plain(self) -> dict[str, Any]:
        return {
            "version": CHECK_VERSION,
            "samples": self.samples,
            "window": self.window,
            "records": self.records,
            "runs": self.runs.tolist(),  # lists, so plain states compare with ==
            "run_digests": self.run_digests,
        }

    @classmethod
    def from_plain(cls, plain: Any, where: str) -> WindowCheck | None:
        """The check in a lane's plain state (None: a check of a version this code does not
        compare, which the resume then skips)."""
        if not isinstance(plain, dict):
            raise CorruptStateError(f"{where} should be a mapping, found {type(plain).__name__}")
        missing = [
            k for k in ("version", "samples", "window", "records", "runs", "run_digests") if k not in plain
        ]
        if missing:
            raise CorruptStateError(f"{where} is missing {', '.join(missing)}: the checkpoint is corrupt")
        if plain["version"] != CHECK_VERSION:
            return None
        samples, records, window = plain["samples"], plain["records"], plain["window"]
        try:
            runs = np.asarray(plain["runs"], dtype=np.int64).reshape(-1, 3)
        except (TypeError, ValueError, OverflowError) as exc:
            raise CorruptStateError(f"{where}: its record runs are malformed ({exc})") from exc
        digests = plain["run_digests"]
        if (
            not all(
                isinstance(n, int | np.integer) and not isinstance(n, bool) and n >= 0
                for n in (samples, records)
            )
            or not isinstance(window, bytes)
            or len(window) != WINDOW_BYTES
            or not isinstance(digests, bytes)
            or runs.dtype.kind not in "iu"
            or runs.shape != (len(run_bounds(int(records))), 3)
            or len(digests) != RUN_BYTES * runs.shape[0]
        ):
            raise CorruptStateError(f"{where} is malformed: the checkpoint is corrupt")
        return cls(int(samples), window, int(records), runs.astype(np.int64), digests)


def run_bounds(n: int) -> list[tuple[int, int]]:
    """The runs ``n`` records are cut into: at most ``GROUPS``, of near-equal lengths."""
    groups = min(n, GROUPS)
    return [(g * n // groups, (g + 1) * n // groups) for g in range(groups)]


def _doc(ids: np.ndarray) -> tuple[int, int, int] | None:
    doc = (int(ids[0]), int(ids[1]), int(ids[2]))
    return None if doc == _NO_DOC else doc


def difference(
    recorded: WindowCheck, found: WindowCheck, fed: Sequence[FedOutputs], name: Namer
) -> str | None:
    """What differs between the check a checkpoint recorded and the one of the window made now
    (``fed``: the records read for it), in words; None when they agree."""
    if recorded == found:
        return None
    bounds = run_bounds(found.records)
    same_runs = recorded.records == found.records
    for g, (start, stop) in enumerate(bounds):
        was = _doc(recorded.runs[g]) if g < recorded.runs.shape[0] else None
        now = _doc(found.runs[g])
        if same_runs and was == now and recorded.run_digest(g) == found.run_digest(g):
            continue
        if was != now and g < recorded.runs.shape[0]:
            shown_was = "a record without id" if was is None else name(was)
            shown_now = "a record without id" if now is None else name(now)
            return (
                f"the lane now reads {shown_now} where the checkpoint recorded {shown_was}: records "
                f"were added, removed or moved in the data before it (or a file was replaced)"
            )
        if not same_runs:
            break
        if stop - start == 1:
            what = "a record without id" if now is None else name(now)
            return (
                f"{what} gives other values than when the checkpoint was saved: its content changed "
                f"(a file edited in place), or the tokenizer or a stateless DoFn gives other output"
            )
        last = fed[stop - 1][0]
        span = "records without ids" if now is None else f"the records from {name(now)}"
        if last is not None and now is not None:
            span += f" to {name(last)}"
        return (
            f"one of {span} ({stop - start} records) gives other values than when the checkpoint "
            f"was saved: its content changed (a file edited in place), or the tokenizer or a "
            f"stateless DoFn gives other output"
        )
    if recorded.records != found.records:
        return (
            f"the lane read {found.records} record(s) to make the window where the checkpoint "
            f"recorded {recorded.records}: the data changed (records added, removed or split differently)"
        )
    return (
        f"the records the lane read are the same, but the window's {found.samples} sample(s) differ "
        f"from the {recorded.samples} recorded: a stateful operator (its code or a library under it) "
        f"now gives other output"
    )


class MadeWindow:
    """A window a lane made and the records it read for it, kept by reference (samples and
    outputs are never changed once made): its check is computed only when a state needs it."""

    __slots__ = ("_check", "_lock", "fed", "samples")

    def __init__(self, samples: Sequence[Any], fed: Sequence[FedOutputs]) -> None:
        self.samples, self.fed = samples, fed
        self._check: WindowCheck | None = None
        self._lock = threading.Lock()

    def check(self) -> WindowCheck:
        """The window's check (computed once, by whichever thread asks first; the window and
        records are let go then)."""
        with self._lock:
            if self._check is None:
                self._check = WindowCheck.of(self.samples, self.fed)
                self.samples, self.fed = (), ()
            return self._check


class PendingChecks:
    """The checks that complete a state taken at a window close: they are known only once the
    lanes made their next windows, which the producer does ahead of the consumer. ``fill``
    gives them (once); ``wait`` returns them, or None if the producer stops first. ``alive``
    says whether the producer may still fill them (default: no, never wait)."""

    __slots__ = ("_alive", "_event", "_made")

    def __init__(self, alive: Callable[[], bool] | None = None) -> None:
        self._event = threading.Event()
        self._made: dict[int, MadeWindow | WindowCheck] = {}
        self._alive = alive

    def fill(self, made: Mapping[int, MadeWindow | WindowCheck | None]) -> None:
        """The lanes' next windows (a lane with None stays unchecked); only the first call counts."""
        if not self._event.is_set():
            self._made = {lane: m for lane, m in made.items() if m is not None}
            self._event.set()

    def give_up(self) -> None:
        """The windows will never be made (the producer failed or stopped)."""
        self.fill({})

    @property
    def filled(self) -> bool:
        return self._event.is_set()

    def wait(
        self, alive: Callable[[], bool] | None = None, poll: float = 0.05
    ) -> dict[int, WindowCheck] | None:
        """The checks by lane once filled; None if ``alive()`` (default: the one given at
        construction) turns False before."""
        alive = alive or self._alive or _never
        while not self._event.wait(0.0 if self._event.is_set() else poll):
            if not alive():
                if self._event.is_set():
                    break
                return None
        return {lane: m.check() if isinstance(m, MadeWindow) else m for lane, m in self._made.items()}


def _never() -> bool:
    return False
