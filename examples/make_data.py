"""Writes a small real corpus where the README's "Using it" reads it: ``data/`` by default.

    python examples/make_data.py data/

``data/web/part-0.jsonl.gz`` (prose: Python's own help topics and module docstrings),
``data/code/part-0.parquet`` (a ``content`` column: stdlib source files) and
``data/tokenizer.json`` (a byte-level BPE trained on both, with ``<|endoftext|>``). Built
offline from the running Python in a few seconds; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from zephon_flow.demo_data import build_demo_data


def make_data(out: str, *, max_code_files: int = 60, vocab_size: int = 1024) -> Path:
    root = Path(out)
    with tempfile.TemporaryDirectory() as build:
        data = build_demo_data(build, max_code_files=max_code_files, vocab_size=vocab_size)
        (root / "web").mkdir(parents=True, exist_ok=True)
        (root / "code").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data.docs_gz, root / "web" / "part-0.jsonl.gz")
        shutil.copyfile(data.code_parquet, root / "code" / "part-0.parquet")
        shutil.copyfile(data.tokenizer_json, root / "tokenizer.json")
    return root


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="data")
    root = make_data(parser.parse_args().out)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        print(f"{path}  {path.stat().st_size / 1e6:.2f} MB")
