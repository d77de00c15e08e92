"""The text workload with short documents: each real document cut at a space after every
``--chars`` characters (default 600, about 150 GPT-2 tokens: chat turns, captions, tweets).

The real documents average about 3,800 tokens, so a loader pays its per-document costs about 340
times per million tokens; here about 6,700 times. This is where per-record overhead shows (read,
send to a worker and back, mix draw, ``Pack``'s state), and where a loader falls behind its
tokenizer while the long documents hide it.

    .venv/bin/python -m bench.short_docs              # builds once, prints the workload JSON's path
    .venv/bin/python -m bench.speed --workloads text --text-workload "$(.venv/bin/python -m bench.short_docs)"

The shards go to ``<root>/text-short-<chars>/<source>/`` beside ``bench.run``'s data (built first
if missing), from the first ``--shards`` shards of each source; a file exists only once it is
complete, so an interrupted build is redone.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
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


def build(chars: int = 600, shards: int = 4) -> Path:
    """Writes the short-document shards and their workload JSON (if missing); returns its path."""
    if chars < 1 or shards < 1:
        raise ValueError(f"chars and shards must be positive, got {chars} and {shards}")
    w, _ = real_workload(parse_args([]))
    root = data.default_root() / f"text-short-{chars}"
    sources = {}
    for name, pattern in sorted(w.sources.items()):
        out_dir = root / name
        out_dir.mkdir(parents=True, exist_ok=True)
        for k, path in enumerate(sorted(glob.glob(pattern))[:shards]):
            target = out_dir / f"shard-{k:05d}.jsonl"
            if target.exists():
                continue
            partial = target.with_suffix(".partial")
            with open(path, encoding="utf-8") as src, open(partial, "w", encoding="utf-8") as dst:
                for line in src:
                    for piece in pieces(json.loads(line)["text"], chars):
                        dst.write(json.dumps({"text": piece}) + "\n")
            os.replace(partial, target)
        sources[name] = str(out_dir / "shard-*.jsonl")
    workload = root / "workload.json"
    workload.write_text(dataclasses.replace(w, sources=sources).to_json())
    return workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chars", type=int, default=600)
    p.add_argument("--shards", type=int, default=4, help="shards of each source to cut")
    args = p.parse_args(argv)
    print(build(args.chars, args.shards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
