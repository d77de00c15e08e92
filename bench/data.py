"""Builds the benchmark's real data from Debian packages, reproducibly, outside the repository.

``apt-get download`` fetches the packages into ``<root>/debs`` (no install, no root needed),
``dpkg -x`` unpacks each into ``<root>/extracted/<package>``, and the text is written as three
sources of JSONL shards (one document per line, ``{"text", "path"}``) in ``<root>/text/<source>``:

- **code**: Go's standard library sources (``golang-1.19-src``: ``src/**/*.go``) and Python's
  (``libpython3.11-stdlib``: ``*.py``), one file per document;
- **docs**: the Linux kernel's documentation (``linux-doc-6.1``: ``*.rst.gz``), Python's
  (``python3.11-doc``: ``_sources/**/*.rst.txt``) and Perl's (``perl-doc``: ``*.pod``);
- **prose**: the GNU Collaborative International Dictionary of English (``dict-gcide``:
  ``gcide.dict.dz``, cut into documents of about 8 KB at blank lines) and the Anarchist FAQ
  (``anarchism``: ``markdown/*.md.gz``).

Images for the vision-language workload go to ``<root>/images/*.tar`` (WebDataset style: a
``.png`` or ``.jpg`` and a ``.txt`` caption per sample): ``tuxpaint-stamps-default`` stamps with
their human-written English captions, and ``opencv-doc``'s ``examples/data`` photos, captioned
by their file name only (they have no captions). Every step is skipped when its output exists;
``<root>/manifest.json`` lists every shard with its size and sha256. The root is
``$ZEPHON_BENCH_DIR`` or ``~/.cache/zephon-flow/bench``.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SHARD_BYTES = 32 * 1024 * 1024
PROSE_DOC_BYTES = 8 * 1024
PACKAGES = (
    "golang-1.19-src",
    "libpython3.11-stdlib",
    "linux-doc-6.1",
    "python3.11-doc",
    "perl-doc",
    "dict-gcide",
    "anarchism",
)
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


def code_docs(root: Path) -> Iterator[Doc]:
    yield from _files(fetch(root, "golang-1.19-src"), "usr/share/go-1.19/src/**/*.go")
    yield from _files(fetch(root, "libpython3.11-stdlib"), "usr/lib/python3.11/**/*.py")


def docs_docs(root: Path) -> Iterator[Doc]:
    yield from _files(fetch(root, "linux-doc-6.1"), "usr/share/doc/linux-doc-6.1/**/*.rst.gz")
    yield from _files(fetch(root, "python3.11-doc"), "usr/share/doc/python3.11/html/_sources/**/*.rst.txt")
    yield from _files(fetch(root, "perl-doc"), "usr/share/perl/**/*.pod")


def prose_docs(root: Path) -> Iterator[Doc]:
    base = fetch(root, "dict-gcide")
    for name, text in _files(base, "usr/share/dictd/gcide.dict.dz"):
        yield from _paragraph_docs(name, text, PROSE_DOC_BYTES)
    yield from _files(fetch(root, "anarchism"), "usr/share/doc/anarchism/markdown/*.md.gz")


SOURCES: dict[str, Callable[[Path], Iterator[Doc]]] = {
    "code": code_docs,
    "docs": docs_docs,
    "prose": prose_docs,
}


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
    for name, docs in SOURCES.items():
        if name not in text:
            print(f"bench.data: building source {name}", file=sys.stderr)
            text[name] = write_shards(docs(root), root / "text" / name)
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
    for name, shards in manifest["text"].items():
        print(f"{name}: {len(shards)} shards, {sum(s['bytes'] for s in shards) / 1e6:.1f} MB")
    print("tokenizer verified:", manifest["tokenizer"]["identical"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
