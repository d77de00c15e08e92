"""A reproducible offline demo corpus (prose and code from Python's stdlib) and a BPE tokenizer."""

from __future__ import annotations

import ast
import contextlib
import functools
import gzip
import hashlib
import itertools
import json
import os
import pydoc_data.topics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
ROW_GROUP_SIZE = 64
MIN_DOC_CHARS = 200
MIN_CODE_CHARS = 500
MAX_CODE_CHARS = 200_000
# Bumped whenever what is built (selection, layout, formats) changes, so old caches rebuild.
FORMAT_VERSION = 1

_EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3"})
_DOCS_JSONL = "docs.jsonl"
_DOCS_GZ = "docs.jsonl.gz"
_CODE_PARQUET = "code.parquet"
_TOKENIZER_JSON = "tokenizer.json"
_MANIFEST = "manifest.json"
_FILES = (_DOCS_JSONL, _DOCS_GZ, _CODE_PARQUET, _TOKENIZER_JSON)
# json.dumps(ensure_ascii=False) leaves these raw, and str.splitlines() breaks lines at them.
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_MB = 1_000_000


@dataclass(frozen=True, kw_only=True)
class DemoData:
    """Paths of a built demo corpus; every file lives in ``root``."""

    root: str
    docs_jsonl: str
    code_parquet: str
    docs_gz: str
    tokenizer_json: str
    eos_token: str


def default_demo_root() -> str:
    """``$ZEPHON_DEMO_DIR`` if set, else ``~/.cache/zephon-flow/demo``."""
    env = os.environ.get("ZEPHON_DEMO_DIR")
    if env:
        return env
    return str(Path("~/.cache/zephon-flow/demo").expanduser())


def build_demo_data(
    root: str | None = None,
    *,
    max_code_files: int = 600,
    vocab_size: int = 4096,
    progress: bool = False,
) -> DemoData:
    """Build (or reuse from ``root``) the demo corpus and its tokenizer.

    Prose is the ``pydoc`` help topics plus stdlib module docstrings; code is the source of the
    first ``max_code_files`` stdlib modules by relative path. The result is a pure function of
    the arguments and the running Python (its stdlib, ``tokenizers`` and ``pyarrow``): a cache
    built with the same parameters is returned without rebuilding.
    """
    if max_code_files < 1:
        raise ValueError(f"max_code_files must be at least 1, got {max_code_files}")
    if vocab_size < 257:
        raise ValueError(
            f"vocab_size must be at least 257 (256 byte tokens and {EOS_TOKEN}), got {vocab_size}"
        )
    root_path = Path(root if root is not None else default_demo_root())
    data = _demo_data(root_path)
    params = _params(max_code_files=max_code_files, vocab_size=vocab_size)
    if _is_cached(root_path, params):
        return data

    start = time.monotonic()
    _say(progress, f"building demo corpus in {root_path} ...")
    root_path.mkdir(parents=True, exist_ok=True)
    # A stale manifest must never vouch for half-rewritten files.
    (root_path / _MANIFEST).unlink(missing_ok=True)

    docs = _prose_docs()
    code = _code_files(_stdlib_sources(), max_code_files)
    prose_bytes = sum(len(text.encode("utf-8")) for _, text in docs)
    code_bytes = sum(len(text.encode("utf-8")) for _, text in code)
    _say(progress, f"prose: {len(docs)} docs, {prose_bytes / _MB:.2f} MB")
    _say(progress, f"code: {len(code)} files, {code_bytes / _MB:.2f} MB")

    jsonl = _jsonl_bytes(docs)
    _write_bytes(root_path / _DOCS_JSONL, jsonl)
    # mtime=0 and no file name in the header keep the archive byte-identical across builds.
    _write_bytes(root_path / _DOCS_GZ, gzip.compress(jsonl, compresslevel=6, mtime=0))
    _write_parquet(root_path / _CODE_PARQUET, code)

    _say(progress, f"training tokenizer (vocab {vocab_size}) ...")
    texts = [text for _, text in docs] + [text for _, text in code]
    tokenizer = _train_tokenizer(texts, vocab_size)
    with _atomic(root_path / _TOKENIZER_JSON) as tmp:
        tokenizer.save(str(tmp))

    stats = {
        "prose_docs": len(docs),
        "prose_bytes": prose_bytes,
        "code_files": len(code),
        "code_bytes": code_bytes,
    }
    _write_manifest(root_path, params, stats)
    _say(progress, f"demo corpus ready in {time.monotonic() - start:.1f} s")
    return data


def corpus_bytes(data: DemoData) -> int:
    """Total UTF-8 bytes of text in the corpus: every prose document and every code file."""
    prose = 0
    with open(data.docs_jsonl, encoding="utf-8") as f:
        for line in f:
            text: str = json.loads(line)["text"]
            prose += len(text.encode("utf-8"))
    content = pq.read_table(data.code_parquet, columns=["content"])["content"]
    code = pc.sum(pc.binary_length(content)).as_py()
    return prose + int(code or 0)


def _demo_data(root: Path) -> DemoData:
    return DemoData(
        root=str(root),
        docs_jsonl=str(root / _DOCS_JSONL),
        code_parquet=str(root / _CODE_PARQUET),
        docs_gz=str(root / _DOCS_GZ),
        tokenizer_json=str(root / _TOKENIZER_JSON),
        eos_token=EOS_TOKEN,
    )


def _params(*, max_code_files: int, vocab_size: int) -> dict[str, object]:
    return {
        "format": FORMAT_VERSION,
        "python": sys.version,
        "tokenizers": tokenizers.__version__,
        "pyarrow": pa.__version__,
        "max_code_files": max_code_files,
        "vocab_size": vocab_size,
        "row_group_size": ROW_GROUP_SIZE,
    }


def _is_cached(root: Path, params: dict[str, object]) -> bool:
    """True if ``root`` holds a complete build with ``params`` (checked by manifest and sizes)."""
    try:
        manifest = json.loads((root / _MANIFEST).read_text(encoding="utf-8"))
        if manifest["params"] != params or sorted(manifest["files"]) != sorted(_FILES):
            return False
        return all((root / name).stat().st_size == manifest["files"][name]["bytes"] for name in _FILES)
    except (OSError, ValueError, KeyError, TypeError):
        # No cache, or a damaged one: either way it is rebuilt.
        return False


def _stdlib_sources() -> list[tuple[str, str]]:
    """(relative posix path, text) of the stdlib's UTF-8 ``.py`` files, sorted by path."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            found.append((path.relative_to(stdlib).as_posix(), text))
    found.sort()
    return found


@functools.cache
def _prose_docs() -> tuple[tuple[str, str], ...]:
    """(id, text) of help topics and module docstrings of at least MIN_DOC_CHARS, sorted by id.

    Cached per process (about 1 MB): the stdlib does not change under a running interpreter,
    and parsing all of it is most of a small build's time.
    """
    docs = [(f"topic:{name}", text) for name, text in pydoc_data.topics.topics.items()]
    for rel, src in _stdlib_sources():
        try:
            doc = ast.get_docstring(ast.parse(src))
        except (SyntaxError, ValueError):
            continue
        if doc is not None:
            docs.append((f"module:{rel}", doc))
    return tuple(sorted((doc_id, text) for doc_id, text in docs if len(text) >= MIN_DOC_CHARS))


def _code_files(sources: list[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    """The first ``limit`` (path, text) sources of MIN_CODE_CHARS to MAX_CODE_CHARS chars."""
    eligible = (s for s in sources if MIN_CODE_CHARS <= len(s[1]) <= MAX_CODE_CHARS)
    return list(itertools.islice(eligible, limit))


def _jsonl_bytes(docs: tuple[tuple[str, str], ...]) -> bytes:
    lines = []
    for doc_id, text in docs:
        line = json.dumps({"text": text, "id": doc_id}, ensure_ascii=False)
        for raw, escaped in _LINE_BREAKS.items():
            line = line.replace(raw, escaped)
        lines.append(line + "\n")
    return "".join(lines).encode("utf-8")


def _write_parquet(path: Path, code: list[tuple[str, str]]) -> None:
    table = pa.table(
        {
            "path": pa.array([p for p, _ in code], type=pa.string()),
            "content": pa.array([t for _, t in code], type=pa.string()),
        }
    )
    with _atomic(path) as tmp:
        pq.write_table(table, str(tmp), row_group_size=ROW_GROUP_SIZE)


def _train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter(texts), trainer=trainer, length=len(texts))
    return tokenizer


def _write_manifest(root: Path, params: dict[str, object], stats: dict[str, int]) -> None:
    files = {}
    for name in _FILES:
        blob = (root / name).read_bytes()
        files[name] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    manifest = {"params": params, "stats": stats, "files": files}
    _write_bytes(root / _MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it onto ``path`` if the block succeeds."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is plain shared data
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_bytes(path: Path, blob: bytes) -> None:
    with _atomic(path) as tmp:
        tmp.write_bytes(blob)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"zephon-flow demo: {message}", file=sys.stderr, flush=True)
