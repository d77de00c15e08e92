"""Builds the benchmark's real data from Debian packages, reproducibly, outside the repository.

``apt-get download`` fetches the packages into ``<root>/debs`` (no install, no root needed),
``dpkg -x`` unpacks each into ``<root>/extracted/<package>``, and the text is written as three
sources of JSONL shards (one document per line, ``{"text", "path"}``) in ``<root>/text/<source>``:

- **code**: Go's standard library sources (``golang-1.19-src``: ``src/**/*.go``), Python's
  standard library and its test suite (``libpython3.11-stdlib``, ``libpython3.11-testsuite``:
  ``*.py``) and Perl's core modules (``perl-modules-5.36``: ``*.pm``), one file per document;
- **docs**: the Linux kernel's documentation (``linux-doc-6.1``: ``*.rst.gz``), Python's and
  Sphinx's (``python3.11-doc``, ``sphinx-doc``: ``_sources/**/*.rst.txt``), Perl's (``perl-doc``:
  ``*.pod``), Node.js's API reference (``nodejs-doc``: ``api/*.md.gz``) and the C library and
  system-call manual pages (``manpages-dev``: ``man2``/``man3`` troff), one file per document;
- **prose**: the GNU Collaborative International Dictionary of English (``dict-gcide``), the
  Free On-line Dictionary of Computing (``dict-foldoc``) and WordNet (``dict-wn``), each dictd
  file cut into documents of about 8 KB (at blank lines, or for WordNet before a headword), the
  Anarchist FAQ (``anarchism``: ``markdown/*.md.gz``) and the ``fortunes`` collections (one
  file per document).

Images for the vision-language workload go to ``<root>/images/*.tar`` (WebDataset style: a
``.png`` or ``.jpg`` and a ``.txt`` caption per sample): ``tuxpaint-stamps-default`` stamps with
their human-written English captions, and ``opencv-doc``'s ``examples/data`` photos, captioned
by their file name only (they have no captions). Every step is skipped when its output exists;
``<root>/manifest.json`` lists every shard with its size and sha256, and per source what went
in (``text_inputs``: package, the ``.deb`` unpacked, glob, how documents are cut, files,
documents and bytes per input). A source whose inputs changed is rebuilt (its old shards
removed); the other sources and the images are kept. The root is ``$ZEPHON_BENCH_DIR`` or
``~/.cache/zephon-flow/bench``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SHARD_BYTES = 32 * 1024 * 1024
PROSE_DOC_BYTES = 8 * 1024
IMAGE_PACKAGES = ("tuxpaint-stamps-default", "opencv-doc")

Doc = tuple[str, str]  # (path relative to the package root, text)


def default_root() -> Path:
    return Path(os.environ.get("ZEPHON_BENCH_DIR", Path.home() / ".cache" / "zephon-flow" / "bench"))


# -- packages -----------------------------------------------------------------------------------


def fetch(root: Path, package: str) -> Path:
    """The package unpacked under ``root/extracted/package`` (downloaded first if needed)."""
    target = root / "extracted" / package
    if (target / ".done").exists():
        return target
    debs = root / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        subprocess.run(["apt-get", "download", package], cwd=debs, check=True)
        found = sorted(debs.glob(f"{package}_*.deb"))
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg", "-x", str(found[-1]), str(target)], check=True)
    (target / ".done").write_text(found[-1].name + "\n", encoding="utf-8")
    return target


def _read(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix in (".gz", ".dz"):
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace")


def _files(base: Path, pattern: str) -> Iterator[Doc]:
    for path in sorted(base.glob(pattern)):
        if path.is_file():
            yield str(path.relative_to(base)), _read(path)


def _paragraph_docs(name: str, text: str, size: int) -> Iterator[Doc]:
    parts: list[str] = []
    length = start = 0
    for para in text.split("\n\n"):
        parts.append(para)
        length += len(para) + 2
        if length >= size:
            yield f"{name}#{start}", "\n\n".join(parts)
            start += length
            parts, length = [], 0
    if parts:
        yield f"{name}#{start}", "\n\n".join(parts)


def _entry_docs(name: str, text: str, size: int) -> Iterator[Doc]:
    """Documents of about ``size`` characters, cut before a line that starts a new entry (a line
    that does not begin with white space: a dictd headword, as in WordNet's file)."""
    lines: list[str] = []
    length = start = 0
    for line in text.split("\n"):
        if length >= size and line[:1] not in ("", " ", "\t"):
            yield f"{name}#{start}", "\n".join(lines)
            start += length
            lines, length = [], 0
        lines.append(line)
        length += len(line) + 1
    if lines:
        yield f"{name}#{start}", "\n".join(lines)


@dataclass(frozen=True)
class Input:
    """One package's share of a source: which files, and how they become documents."""

    package: str
    pattern: str  # glob under the unpacked package's root
    cut: str = "file"  # "file": one document per file; "paragraphs"/"entries": ~8 KB pieces
    bare_names: bool = False  # only files without a suffix (fortune files, not their .dat/.u8)

    def docs(self, root: Path) -> Iterator[Doc]:
        for name, text in _files(fetch(root, self.package), self.pattern):
            if self.bare_names and Path(name).suffix:
                continue
            if self.cut == "paragraphs":
                yield from _paragraph_docs(name, text, PROSE_DOC_BYTES)
            elif self.cut == "entries":
                yield from _entry_docs(name, text, PROSE_DOC_BYTES)
            else:
                yield name, text


SOURCES: dict[str, tuple[Input, ...]] = {
    "code": (
        Input("golang-1.19-src", "usr/share/go-1.19/src/**/*.go"),
        Input("libpython3.11-stdlib", "usr/lib/python3.11/**/*.py"),
        Input("libpython3.11-testsuite", "usr/lib/python3.11/test/**/*.py"),
        Input("perl-modules-5.36", "usr/share/perl/**/*.pm"),
    ),
    "docs": (
        Input("linux-doc-6.1", "usr/share/doc/linux-doc-6.1/**/*.rst.gz"),
        Input("python3.11-doc", "usr/share/doc/python3.11/html/_sources/**/*.rst.txt"),
        Input("perl-doc", "usr/share/perl/**/*.pod"),
        Input("sphinx-doc", "usr/share/doc/sphinx-doc/html/_sources/**/*.rst.txt"),
        Input("nodejs-doc", "usr/share/doc/nodejs/api/*.md.gz"),
        Input("manpages-dev", "usr/share/man/man[23]/*.gz"),
    ),
    "prose": (
        Input("dict-gcide", "usr/share/dictd/gcide.dict.dz", cut="paragraphs"),
        Input("dict-foldoc", "usr/share/dictd/foldoc.dict.dz", cut="paragraphs"),
        Input("dict-wn", "usr/share/dictd/wn.dict.dz", cut="entries"),
        Input("anarchism", "usr/share/doc/anarchism/markdown/*.md.gz"),
        Input("fortunes", "usr/share/games/fortunes/*", bare_names=True),
    ),
}


class _Tally:
    """Counts, per input, the files read and the documents and text bytes that went into a source."""

    def __init__(self, root: Path, inputs: tuple[Input, ...]) -> None:
        self.root, self.inputs = root, inputs
        self.rows: list[dict[str, Any]] = []

    def docs(self) -> Iterator[Doc]:
        for inp in self.inputs:
            row: dict[str, Any] = {**asdict(inp), "files": 0, "docs": 0, "text_bytes": 0}
            self.rows.append(row)
            files: set[str] = set()
            for name, text in inp.docs(self.root):
                if not text.strip():
                    continue
                files.add(name.split("#", 1)[0])
                row["docs"] += 1
                row["text_bytes"] += len(text.encode("utf-8"))
                yield name, text
            row["files"] = len(files)
            done = fetch(self.root, inp.package) / ".done"
            row["deb"] = done.read_text(encoding="utf-8").strip()


def _same_inputs(recorded: list[dict[str, Any]] | None, inputs: tuple[Input, ...]) -> bool:
    if recorded is None:
        return False
    keys = ("package", "pattern", "cut", "bare_names")
    return [tuple(r.get(k) for k in keys) for r in recorded] == [
        tuple(asdict(i)[k] for k in keys) for i in inputs
    ]


# -- shards and manifest ------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_shards(docs: Iterator[Doc], out: Path, shard_bytes: int = SHARD_BYTES) -> list[dict[str, Any]]:
    """JSONL shards ``shard-NNNNN.jsonl`` of about ``shard_bytes``; empty documents dropped."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Any]] = []
    f: io.BufferedWriter | None = None
    size = count = 0

    def finish() -> None:
        if f is not None:
            f.close()
            path = out / f"shard-{len(shards):05d}.jsonl"
            shards.append({"path": str(path), "bytes": size, "docs": count, "sha256": _sha256(path)})

    for name, text in docs:
        if not text.strip():
            continue
        if f is None or size >= shard_bytes:
            finish()
            f = open(out / f"shard-{len(shards):05d}.jsonl", "wb")  # noqa: SIM115 - closed by finish()
            size = count = 0
        line = json.dumps({"text": text, "path": name}, ensure_ascii=False).encode("utf-8") + b"\n"
        f.write(line)
        size += len(line)
        count += 1
    finish()
    return shards


def build_images(root: Path, out: Path, shard_bytes: int = SHARD_BYTES) -> list[dict[str, Any]]:
    """WebDataset-style tars of (image, caption) samples from the two image packages."""
    samples: list[tuple[str, Path, str]] = []
    stamps = fetch(root, "tuxpaint-stamps-default") / "usr/share/tuxpaint/stamps"
    for png in sorted(stamps.glob("**/*.png")):
        txt = png.with_suffix(".txt")
        if txt.exists():
            caption = txt.read_text(encoding="utf-8", errors="replace").split("\n", 1)[0].strip()
            if caption:
                samples.append(("tuxpaint", png, caption))
    photos = fetch(root, "opencv-doc") / "usr/share/doc/opencv-doc/examples/data"
    for img in sorted(photos.glob("*")):
        if img.suffix.lower() in (".jpg", ".png"):
            samples.append(("opencv", img, f"a photo: {img.stem.replace('_', ' ')}"))
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Any]] = []
    tar: tarfile.TarFile | None = None
    size = count = 0
    for i, (origin, image, caption) in enumerate(samples):
        if tar is None or size >= shard_bytes:
            if tar is not None:
                tar.close()
                shards.append({"path": tar.name, "bytes": size, "samples": count})
            tar = tarfile.open(out / f"images-{len(shards):05d}.tar", "w")  # noqa: SIM115
            size = count = 0
        key = f"{origin}-{i:06d}"
        for member, data in (
            (f"{key}{image.suffix.lower()}", image.read_bytes()),
            (f"{key}.txt", caption.encode()),
        ):
            info = tarfile.TarInfo(member)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
            size += len(data)
        count += 1
    if tar is not None:
        tar.close()
        shards.append({"path": str(tar.name), "bytes": size, "samples": count})
    for shard in shards:
        shard["path"] = str(shard["path"])
        shard["sha256"] = _sha256(Path(shard["path"]))
    return shards


def build(root: Path | None = None, *, images: bool = True) -> dict[str, Any]:
    """Builds what is missing under ``root`` and returns the manifest (also written as JSON)."""
    from bench import gpt2

    root = root or default_root()
    manifest_path = root / "manifest.json"
    manifest: dict[str, Any] = {}
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    text = manifest.setdefault("text", {})
    recorded = manifest.setdefault("text_inputs", {})
    for name, inputs in SOURCES.items():
        if name in text and _same_inputs(recorded.get(name), inputs):
            continue
        print(f"bench.data: building source {name}", file=sys.stderr)
        out = root / "text" / name
        for old in out.glob("shard-*.jsonl"):
            old.unlink()  # a rebuild may write fewer shards: none of the old may stay in the glob
        text.pop(name, None)
        manifest.pop("tokenizer", None)  # verified on a sample of the text: verify again
        tally = _Tally(root, inputs)
        text[name] = write_shards(tally.docs(), out)
        recorded[name] = tally.rows
        _save(manifest_path, manifest)
    if images and "images" not in manifest:
        print("bench.data: building image shards", file=sys.stderr)
        manifest["images"] = build_images(root, root / "images")
        _save(manifest_path, manifest)
    tokenizer = gpt2.build(root / "tokenizer" / "gpt2.json")
    if "tokenizer" not in manifest:
        sample = [json.loads(line)["text"] for line in _first_lines(text, 20)]
        manifest["tokenizer"] = {
            "path": str(tokenizer),
            "sha256": _sha256(tokenizer),
            **gpt2.verify(tokenizer, sample),
        }
        _save(manifest_path, manifest)
    return manifest


def _first_lines(text: dict[str, Any], per_source: int) -> Iterator[str]:
    for shards in text.values():
        with open(shards[0]["path"], encoding="utf-8") as f:
            for _, line in zip(range(per_source), f, strict=False):
                yield line


def _save(path: Path, manifest: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--no-images", action="store_true")
    args = parser.parse_args(argv)
    manifest = build(args.root, images=not args.no_images)
    total = 0
    for name, shards in manifest["text"].items():
        size = sum(s["bytes"] for s in shards)
        total += size
        print(f"{name}: {len(shards)} shards, {size / 1e6:.1f} MB")
        for row in manifest["text_inputs"][name]:
            print(
                f"  {row['deb']}: {row['files']} files, {row['docs']} docs, {row['text_bytes'] / 1e6:.1f} MB"
            )
    print(f"text in all: {total / 1e6:.1f} MB")
    print("tokenizer verified:", manifest["tokenizer"]["identical"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
