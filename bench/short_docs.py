"""The text workload with short documents: each real document cut at a space after every
``--chars`` characters (default 600, about 150 GPT-2 tokens: chat turns, captions, tweets).

The real documents average about 3,800 tokens, so a loader pays its per-document costs about 340
times per million tokens; here about 6,700 times. This is where per-record overhead shows (read,
send to a worker and back, mix draw, ``Pack``'s state), and where a loader falls behind its
tokenizer while the long documents hide it.

    .venv/bin/python -m bench.short_docs              # builds once, prints the workload JSON's path
    .venv/bin/python -m bench.speed --workloads text --text-workload "$(.venv/bin/python -m bench.short_docs)"

The shards go to ``<root>/text-short-<chars>-<shards>/<source>/`` beside ``bench.run``'s data
(built first if missing), from the first ``--shards`` shards of each source, written by
``bench.data.write_shards``; the workload JSON is written last, so a build that did not reach it
is redone.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from bench import data
from bench.run import parse_args, real_workload


def pieces(text: str, chars: int) -> Iterator[str]:
    """``text`` cut at the first space at or after every ``chars`` characters (the last piece
    holds the rest); joined, the pieces are ``text``."""
    start = 0
    while start < len(text):
        cut = text.find(" ", start + chars)
        end = len(text) if cut < 0 else cut
        yield text[start:end]
        start = end


def _short_docs(pattern: str, chars: int, shards: int) -> Iterator[data.Doc]:
    """Every document of the first ``shards`` shards of a source, in pieces (named
    ``<path>#<piece>``)."""
    for path in sorted(glob.glob(pattern))[:shards]:
        with open(path, encoding="utf-8") as src:
            for line in src:
                doc = json.loads(line)
                for k, piece in enumerate(pieces(doc["text"], chars)):
                    yield f"{doc.get('path', path)}#{k}", piece


def build(chars: int = 600, shards: int = 4) -> Path:
    """Writes the short-document shards and their workload JSON (if missing); returns its path."""
    if chars < 1 or shards < 1:
        raise ValueError(f"chars and shards must be positive, got {chars} and {shards}")
    w, _ = real_workload(parse_args([]))
    root = data.default_root() / f"text-short-{chars}-{shards}"
    workload = root / "workload.json"
    if workload.exists():  # written last: the shards before it are complete
        return workload
    sources = {}
    for name, pattern in sorted(w.sources.items()):
        out_dir = root / name
        shutil.rmtree(out_dir, ignore_errors=True)  # what an interrupted build left
        data.write_shards(_short_docs(pattern, chars, shards), out_dir)
        sources[name] = str(out_dir / "shard-*.jsonl")
    workload.write_text(dataclasses.replace(w, sources=sources).to_json())
    return workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chars", type=int, default=600)
    p.add_argument("--shards", type=int, default=4, help="shards of each source to cut")
    args = p.parse_args(argv)
    if args.chars < 1 or args.shards < 1:
        p.error(f"--chars and --shards must be positive, got {args.chars} and {args.shards}")
    print(build(args.chars, args.shards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
