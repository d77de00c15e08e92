"""ReadWebDataset: a source of samples from WebDataset tar shards, members grouped by key."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from zephon_flow.core import files
from zephon_flow.core.errors import DataError, SpecError
from zephon_flow.core.source import START, Record, Source, Split
from zephon_flow.operators import _file_cache, _plan

#: The fewest samples an automatic plan puts in a split.
MIN_SPLIT_SAMPLES = 16
#: The cached sample offsets' kind and version: bumped when how members group into samples changes.
LISTING = "webdataset-samples 1"
_BLOCK = tarfile.BLOCKSIZE
_COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ": "xz"}


def member_key(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name by the WebDataset convention, or None without one.

    The key is the path up to the first dot of the basename; the extension is the rest, as
    written (as the webdataset package keeps it): ``"a/b/000017.seg.PNG"`` ->
    ``("a/b/000017", "seg.PNG")``.
    """
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not (stem and dot and ext):
        return None
    return (f"{directory}/{stem}" if directory else stem), ext


@dataclass(frozen=True)
class TarSample:
    """A sample as read from its shard: its key and its members in shard order."""

    key: str
    #: ``(member name, extension, data)``; data is None for a member no field asks for.
    members: tuple[tuple[str, str, bytes | None], ...]

    @property
    def nbytes(self) -> int:
        """The bytes of member data it carries (what a chunk of records weighs)."""
        return sum(len(data) for _, _, data in self.members if data is not None)


class ReadWebDataset(Source):
    """Samples of WebDataset tar shards: consecutive members sharing a key form one sample.

    ``fields`` are the extensions every sample must have; ``"jpg;png"`` accepts either (the
    first one listed that the sample has). A field matches a member's extension whatever their
    case (``"jpg"`` finds ``x.JPG``); a sample with two members that differ only in case for one
    field (``x.jpg`` and ``x.JPG``) is refused by name. The element is a dict
    ``{"__key__": key, ext: value}`` with one entry per field, keyed by the extension found,
    as written in the shard (``"JPG"`` for ``x.JPG``, as the webdataset package keys it;
    ``DecodeImage`` finds its fields whatever their case). Values are the member's bytes,
    except for ``text_fields`` (default ``("txt",)``), decoded as UTF-8 to ``str`` so that a
    caption can go straight to ``Tokenize``. Members no field asks for are not read; members
    that are not regular files (directories, links) or whose basename has no extension are
    ignored. Shards must be uncompressed tar files (a compressed stream cannot be entered in the
    middle).

    - **Splits**: runs of samples, ``Split(shard, first, stop)`` counting samples, sized from the
      total sample count and the lane count (about ``SPLITS_PER_LANE`` per lane, at least
      ``MIN_SPLIT_SAMPLES``; equal runs within a shard), or exactly ``samples_per_split``
      when given. ``make_splits`` reads every member *header* of every shard once (not the
      data) and keeps the byte offset of each split's first member, so ``read_split`` seeks
      straight to it. Under ``on_error="skip"`` a shard that cannot be listed (zero bytes,
      not a tar) is left out with a warning naming it.
    - **Positions**: the number of the next sample in the shard; a record's ``offset`` is its
      sample number in the shard. Resuming inside a split re-reads the headers (never the
      data) of the samples before the position, at most one split's.
    - **Epochs**: ``epochs=None`` reads forever, each epoch dealing the splits anew; with a
      number, a lane's stream of this source ends after that many passes.
    - **Errors** (``DataError``, naming the shard and this operator): at listing, a zero-byte
      shard or one that is not an uncompressed tar; from ``read_split``, a shard cut short
      inside a member's header or data (naming the member), or a damaged header. Damage is
      found at listing but raised only when a lane reaches it, from the split that ends there,
      so with ``on_error="skip"`` the samples before it are read on every run and topology.
      From ``decode``: a sample without a required member (naming the key and the missing
      extension), with two members of one field's extension, or with text that is not UTF-8.
    """

    #: A record's offset is a position ``read_split`` starts at (see ``Source``).
    rereads_offsets = True

    def __init__(
        self,
        pattern: str,
        *,
        fields: Sequence[str] = ("jpg", "txt"),
        text_fields: Sequence[str] = ("txt",),
        samples_per_split: int | None = None,
        epochs: int | None = None,
        on_error: str = "raise",
        label: str | None = None,
    ) -> None:
        super().__init__(pattern, epochs=epochs, on_error=on_error, label=label)
        name = type(self).__name__
        self.fields = _parse_fields(name, fields)
        wanted = {ext for alternatives in self.fields for ext in alternatives}
        if isinstance(text_fields, str) or not all(isinstance(t, str) for t in text_fields):
            raise SpecError(f"{name}: text_fields must be a sequence of extensions, got {text_fields!r}")
        self.text_fields = tuple(t.lower() for t in text_fields)
        for ext in self.text_fields:
            if ext not in wanted:
                raise SpecError(f"{name}: text_fields names {ext!r}, which is not among fields {fields!r}")
        if samples_per_split is not None and (
            isinstance(samples_per_split, bool)
            or not isinstance(samples_per_split, int)
            or samples_per_split < 1
        ):
            raise SpecError(
                f"{name}: samples_per_split must be a positive integer or None, got {samples_per_split!r}"
            )
        self.samples_per_split = samples_per_split
        self._wanted = frozenset(wanted)
        #: Files left out at listing under ``on_error="skip"``.
        self.skipped_files: list[str] = []
        #: Per shard, the byte offset of the first member of each of its splits, by sample.
        self._offsets: dict[str, dict[int, int]] | None = None
        #: Every sample's offset, for shards whose splits were listed elsewhere.
        self._walked: dict[str, list[int]] = {}

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "fields": [";".join(alternatives) for alternatives in self.fields],
            "text_fields": list(self.text_fields),
            "samples_per_split": self.samples_per_split,
            "split_plan": _plan.PLAN_VERSION,
        }

    # -- listing -----------------------------------------------------------------------
    def make_splits(self, paths: Sequence[str], *, lanes: int = 1) -> list[Split]:
        skipped: list[str] = []
        listed = files.list_each(
            paths,
            lambda p: [(p, self._index(p))],
            on_error=self.on_error,
            operator=self.operator_name,
            skipped=skipped,
        )
        self.skipped_files = skipped
        fixed = self.samples_per_split
        step = fixed or _plan.target(sum(len(o) for _, o in listed), lanes, MIN_SPLIT_SAMPLES)
        splits: list[Split] = []
        index: dict[str, dict[int, int]] = {}
        for path, offsets in listed:
            n = len(offsets)
            if fixed:
                runs = [(a, min(a + step, n)) for a in range(0, n, step)]
            else:
                runs = _plan.ranges([0, n], step, refine=True) if n else []
            index[path] = {a: offsets[a] for a, _ in runs}
            splits.extend(Split(path, a, b) for a, b in runs)
        old = self._offsets or {}
        # Assigned whole (lanes' feeds may list concurrently), keeping other plans' starts.
        self._offsets = {**old, **{p: {**old.get(p, {}), **starts} for p, starts in index.items()}}
        return splits

    def _index(self, path: str) -> list[int]:
        """The offset of the first member of every sample of the shard, cached on disk between
        runs (``_file_cache``: keyed by the shard's path, size, time and end bytes), since
        walking every member header of every shard is what listing costs.

        A damaged shard counts the sample at the damage too, so that its last split ends there
        and reading it raises the damage.
        """
        info = files.stat(path, operator=self.operator_name)
        if info.size == 0:
            return self._walk(path)  # refuses it by name
        stat = _file_cache.stat_of(path)
        key = _file_cache.stat_key(path, info, LISTING, operator=self.operator_name, notes="tar", stat=stat)
        name = f"tar-samples-{key}.json"
        cached = _file_cache.load_json(name)
        if isinstance(cached, list) and all(type(o) is int for o in cached):
            return cached
        offsets = self._walk(path)
        _file_cache.store_json(name, offsets)
        return offsets

    def _walk(self, path: str) -> list[int]:
        """``_index`` from the shard's member headers."""
        offsets: list[int] = []
        with self._open(path) as (fh, size):
            if size == 0:
                raise DataError(
                    f"{self.operator_name}: {path} is empty (0 bytes), not a tar shard; "
                    f"remove it or narrow the glob {self.pattern!r}"
                )
            try:
                for group in _Grouper(self, fh, path, size).groups(0, 0):
                    offsets.append(group.offset)
            except _Damage as damage:
                offsets.append(damage.resume_offset)
        return offsets

    # -- reading -----------------------------------------------------------------------
    def read_split(self, split: Split, position: int) -> Iterator[tuple[int, Record]]:
        first = split.start if position == START else position
        if not split.start <= first <= split.stop:
            raise DataError(
                f"{self.operator_name}: cannot resume samples [{split.start}, {split.stop}) of "
                f"{split.path} at sample {first}; did the shard change since the checkpoint?"
            )
        starts = (self._offsets or {}).get(split.path, {})
        start = starts.get(split.start)
        if start is None:  # listed for another lane count, or by another process
            start = self._sample_offset(split.path, split.start)
        if start is None:
            raise DataError(
                f"{self.operator_name}: samples [{split.start}, {split.stop}) of {split.path} are "
                "not a split of this source; did the shard change since the splits were listed?"
            )
        return self._samples(split, start, first)

    def _sample_offset(self, path: str, sample: int) -> int | None:
        """The byte offset of sample ``sample``'s first member, from the shard's headers (walked
        once per shard and kept)."""
        offsets = self._walked.get(path)
        if offsets is None:
            offsets = self._index(path)
            self._walked = {**self._walked, path: offsets}
        return offsets[sample] if sample < len(offsets) else None

    def _samples(self, split: Split, start: int, first: int) -> Iterator[tuple[int, Record]]:
        path = split.path
        if first == split.stop:
            return
        with self._open(path) as (fh, size):
            try:
                for group in _Grouper(self, fh, path, size).groups(start, split.start):
                    if group.number >= first:
                        sample = TarSample(
                            group.key, tuple(self._read_member(fh, path, m) for m in group.members)
                        )
                        n = group.number
                        yield n + 1, Record(sample, path, f"sample {n} (key {group.key!r})", n)
                    if group.number + 1 == split.stop:
                        return
            except _Damage as damage:  # the user sees a plain DataError, not the private class
                raise DataError(str(damage)) from None
        raise DataError(
            f"{self.operator_name}: {path} ends before sample {split.stop - 1}; "
            "did the shard change since the splits were listed?"
        )

    def _read_member(self, fh: IO[bytes], path: str, member: _Member) -> tuple[str, str, bytes | None]:
        name, ext, info = member
        if ext.lower() not in self._wanted:
            return name, ext, None
        fh.seek(info.offset_data)
        data = fh.read(info.size)
        if len(data) != info.size:
            raise DataError(
                f"{self.operator_name}: {path} is truncated: member {name!r} has {len(data)} of its "
                f"{info.size} bytes; did the shard change since the splits were listed?"
            )
        return name, ext, data

    def _open(self, path: str) -> _OpenShard:
        return _OpenShard(path, self.operator_name)

    # -- decoding (runs in workers on a pickled copy of this transform) ------------------
    def decode(self, record: Record, operator: str) -> list[Any]:
        sample: TarSample = record.payload
        where = f"{record.path} at {record.where}"
        element: dict[str, Any] = {"__key__": sample.key}
        for alternatives in self.fields:  # lower case; a member's extension as written
            present = [m for m in sample.members if m[1].lower() in alternatives]
            if not present:
                has = ", ".join(repr(ext) for _, ext, _ in sample.members) or "no members"
                wanted = " or ".join(repr(ext) for ext in alternatives)
                raise DataError(
                    f"{operator}: {where} has no {wanted} member (it has {has}); "
                    f"every sample needs {', '.join(repr(';'.join(a)) for a in self.fields)}"
                )
            field = next(e for e in alternatives if any(m[1].lower() == e for m in present))
            chosen = [m for m in present if m[1].lower() == field]
            if len(chosen) > 1:
                names = ", ".join(repr(m[0]) for m in chosen)
                raise DataError(
                    f"{operator}: {where} has {len(chosen)} {field!r} members ({names}); a field "
                    f"matches extensions whatever their case"
                )
            name, ext, data = chosen[0]
            assert data is not None
            element[ext] = self._text(data, name, where, operator) if field in self.text_fields else data
        return [element]

    @staticmethod
    def _text(data: bytes, name: str, where: str, operator: str) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{operator}: {where}: member {name!r} is not valid UTF-8 at byte {exc.start}: "
                f"{exc.reason} (0x{data[exc.start]:02x})"
            ) from exc


def _parse_fields(name: str, fields: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """``["jpg;png", "txt"]`` -> ``(("jpg", "png"), ("txt",))``, refusing malformed lists."""
    if isinstance(fields, str) or not fields or not all(isinstance(f, str) for f in fields):
        raise SpecError(f"{name}: fields must be a non-empty sequence of extensions, got {fields!r}")
    parsed = tuple(tuple(ext.strip().lower() for ext in f.split(";")) for f in fields)
    seen: set[str] = set()
    for alternatives in parsed:
        for ext in alternatives:
            if not ext or ext.startswith(".") or "/" in ext or ext == "__key__":
                raise SpecError(f"{name}: {ext!r} in fields {fields!r} is not an extension like 'jpg'")
            if ext in seen:
                raise SpecError(f"{name}: the extension {ext!r} appears twice in fields {fields!r}")
            seen.add(ext)
    return parsed


# -- reading a shard ---------------------------------------------------------------------------
_Member = tuple[str, str, tarfile.TarInfo]


@dataclass
class _Group:
    number: int  # the sample's number in the shard
    key: str
    offset: int  # where the header(s) of its first member start
    members: list[_Member] = field(default_factory=list)


class _Damage(DataError):
    """A shard is damaged; ``resume_offset`` is where reading must start to meet the damage.
    Internal: listing catches it, reading raises it again as a plain ``DataError``."""

    def __init__(self, message: str, resume_offset: int = 0) -> None:
        super().__init__(message)
        self.resume_offset = resume_offset


class _OpenShard:
    """``with _OpenShard(path, op) as (fh, size)``: the shard opened for reading, and its size."""

    def __init__(self, path: str, operator: str) -> None:
        self._path, self._op = path, operator
        self._fh: IO[bytes] | None = None

    def __enter__(self) -> tuple[IO[bytes], int]:
        self._fh = files.open_binary(self._path, operator=self._op)
        try:
            return self._fh, self._fh.seek(0, os.SEEK_END)
        except OSError as exc:
            self.__exit__()
            raise DataError(f"{self._op}: cannot read {self._path}: {exc.strerror or exc}") from exc

    def __exit__(self, *_: object) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class _Grouper:
    """Walks a shard's member headers from a byte offset and groups members into samples."""

    def __init__(self, source: ReadWebDataset, fh: IO[bytes], path: str, size: int) -> None:
        self._op, self._fh, self._path, self._size = source.operator_name, fh, path, size

    def groups(self, start: int, first_number: int) -> Iterator[_Group]:
        """Samples from the member whose header starts at ``start``, numbered from ``first_number``.

        A sample is complete when a member with another key (or the end) follows it, so damage
        raises ``_Damage`` before the sample it falls in is yielded.
        """
        group: _Group | None = None
        try:
            for info in self._regular_members(start):
                named = member_key(info.name)
                if named is None:
                    continue
                key, ext = named
                if group is None or key != group.key:
                    if group is not None:
                        yield group
                    group = _Group(first_number if group is None else group.number + 1, key, info.offset)
                if info.offset_data + info.size > self._size:
                    raise _Damage(
                        f"{self._op}: {self._path} is truncated: member {info.name!r} (sample "
                        f"{group.number}) has {info.size} bytes from byte {info.offset_data}, "
                        f"but the file ends at byte {self._size}"
                    )
                group.members.append((info.name, ext, info))
        except _Damage as damage:
            raise _Damage(str(damage), group.offset if group is not None else start) from None
        if group is not None:
            yield group

    def _regular_members(self, start: int) -> Iterator[tarfile.TarInfo]:
        """The regular-file members from ``start`` to the end of the archive; damage raises."""
        self._fh.seek(start)
        prev: tarfile.TarInfo | None = None
        try:
            tar = tarfile.TarFile(fileobj=self._fh)
            while (info := tar.next()) is not None:
                prev = info
                if info.isreg():
                    yield info
        except tarfile.TarError as exc:
            at = tar.offset if prev is not None else start
            if self._fh.tell() < self._size:
                raise self._damaged(at, prev, str(exc)) from None
            raise self._damaged(
                at, prev, f"the file ends inside the member whose header is at byte {at}"
            ) from None
        self._check_end(tar.offset, prev)

    def _check_end(self, at: int, prev: tarfile.TarInfo | None) -> None:
        """``tarfile`` ends quietly at any bad header after the first: tell an end from damage."""
        if at == self._size:
            return  # the last member ends the file (no end-of-archive blocks)
        self._fh.seek(at)
        block = self._fh.read(_BLOCK)
        if len(block) == _BLOCK and not block.strip(b"\0"):
            return  # the end-of-archive marker
        if len(block) < _BLOCK:
            raise self._damaged(at, prev, f"the file ends inside the header at byte {at}")
        raise self._damaged(at, prev, f"bad tar header at byte {at}")

    def _damaged(self, at: int, prev: tarfile.TarInfo | None, reason: str) -> DataError:
        if prev is None and at == 0:
            self._fh.seek(0)
            head = self._fh.read(6)
            kind = next((k for magic, k in _COMPRESSED_MAGIC.items() if head.startswith(magic)), None)
            hint = f" (it looks {kind}-compressed; decompress the shard)" if kind else ""
            return DataError(f"{self._op}: {self._path} is not an uncompressed tar file{hint}: {reason}")
        after = f"after member {prev.name!r}" if prev is not None else f"at byte {at}"
        truncated = "the file ends inside" in reason
        what = "is truncated" if truncated else "is damaged"
        return _Damage(f"{self._op}: {self._path} {what} {after}: {reason}")
