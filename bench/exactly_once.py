"""Repeats within a pass, lane balance and read speed: today's dealing against the previous one.

Run from the repository root::

    .venv/bin/python -m bench.exactly_once                  # 4 x ~100 MB .jsonl.zst, 16 lanes
    .venv/bin/python -m bench.exactly_once --mb 5 --quick   # a small smoke run

The corpus is a few large compressed JSON Lines files (numbered documents of random words),
written once under ``--data`` (default ``~/.cache/zephon-flow/bench-exactly-once``), as single
zstd frames (what the ``zstd`` tool writes) and, with ``--frames``, as many frames. The same
pipeline (read, parse the document's number) runs under this checkout and under ``--baseline``
(a git revision, default the commit before the dealing was rewritten, unpacked with
``git archive`` into a temporary tree), one after the other in the same run, each in its own
process. For each it reports:

- **repeats**: documents delivered more than once over the first 75 % of a pass (counted by
  document number over ``0.75 * documents`` rows; the goal is 0);
- **share spread**: the lanes' shares of pass 0, max/mean and min/mean (this checkout only;
  ``zephon inspect --splits``'s numbers);
- **throughput**: documents per second over that 75 %, and the ratio of the two.

Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zstandard

BASELINE = "4fe0ad5"  # main before issue 11's dealing
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "at",
    "or",
    "an",
    "which",
]

_CHILD = r"""
import json, sys, time, collections
import numpy as np
import apache_beam as beam
import zephon_flow as zf
from zephon_flow import operators as ops

pattern, lanes, rows, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

class DocNumber(beam.DoFn):
    def process(self, text):
        yield {"doc": np.int64(int(text.split(" ", 1)[0]))}

def build(p):
    return p | "src" >> ops.ReadJsonl(pattern) | "num" >> beam.ParDo(DocNumber())

spec = zf.LoaderSpec(build, lanes=lanes, seed=1234, global_batch_size=lanes * 4)
steps = max(1, rows // spec.global_batch_size)
seen = collections.Counter()
t0 = time.perf_counter()
first = None
with zf.Loader(spec, backend="inline") as loader:
    for step, batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        seen.update(batch["doc"].tolist())
        if step + 1 == steps:
            break
elapsed = time.perf_counter() - t0
result = {"rows": sum(seen.values()), "distinct": len(seen), "seconds": elapsed, "first_batch_s": first,
          "code": zf.__file__}
if sys.argv[5] == "share":
    from zephon_flow.engine.splitreport import split_report
    (src,) = split_report(spec)
    result["share"] = {"min": src.share_min, "mean": src.share_mean, "max": src.share_max,
                       "splits": src.splits, "shared_splits": src.shared_splits}
with open(out, "w") as f:
    json.dump(result, f)
"""


def write_corpus(root: Path, *, files: int, mb: float, frames: bool) -> int:
    """Writes ``files`` .jsonl.zst files of about ``mb`` MB of JSON each; returns the documents."""
    root.mkdir(parents=True, exist_ok=True)
    manifest = root / "manifest.json"
    want = {"files": files, "mb": mb, "frames": frames, "version": 1}
    if manifest.exists() and json.loads(manifest.read_text()).get("want") == want:
        return int(json.loads(manifest.read_text())["documents"])
    for old in root.glob("*.jsonl.zst"):
        old.unlink()
    rng = random.Random(0)
    doc = 0
    cctx = zstandard.ZstdCompressor(level=3)
    for i in range(files):
        path = root / f"shard-{i:02d}.jsonl.zst"
        size = 0
        frame: list[bytes] = []
        with open(path, "wb") as fh:
            writer = None if frames else cctx.stream_writer(fh, closefd=False)
            while size < mb * 1e6:
                n = rng.randint(20, 400)
                line = (json.dumps({"text": f"{doc} " + " ".join(rng.choices(WORDS, k=n))}) + "\n").encode()
                doc += 1
                size += len(line)
                if writer is not None:
                    writer.write(line)
                else:
                    frame.append(line)
                    if sum(map(len, frame)) >= 1 << 20:  # one frame per ~1 MiB
                        fh.write(cctx.compress(b"".join(frame)))
                        frame = []
            if writer is not None:
                writer.flush(zstandard.FLUSH_FRAME)
                writer.close()  # type: ignore[no-untyped-call]
            elif frame:
                fh.write(cctx.compress(b"".join(frame)))
    manifest.write_text(json.dumps({"want": want, "documents": doc}))
    return doc


def unpack(rev: str, where: Path) -> Path:
    """This repository at ``rev`` as an importable tree (``zephon_flow`` with its subpackages)."""
    src = where / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    tree = where / "tree" / "zephon_flow"
    tree.mkdir(parents=True)
    for entry in (src / "zephon_flow").iterdir():
        (tree / entry.name).symlink_to(entry)
    (tree / "operators").symlink_to(src / "operators")
    (tree / "runners").symlink_to(src / "runners")
    return where / "tree"


def run_one(pythonpath: Path | None, pattern: str, lanes: int, rows: int, out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    script = out.with_suffix(".py")
    script.write_text(_CHILD)
    share = "share" if pythonpath is None else "-"
    subprocess.run(
        [sys.executable, str(script), pattern, str(lanes), str(rows), str(out), share], check=True, env=env
    )
    result: dict[str, Any] = json.loads(out.read_text())
    result["repeats"] = result["rows"] - result["distinct"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.expanduser("~/.cache/zephon-flow/bench-exactly-once"))
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--mb", type=float, default=100.0, help="uncompressed MB per file")
    parser.add_argument("--lanes", type=int, default=16)
    parser.add_argument("--frames", action="store_true", help="write many zstd frames per file")
    parser.add_argument("--baseline", default=BASELINE, help="git revision to compare with")
    parser.add_argument("--quick", action="store_true", help="this checkout only (no baseline)")
    args = parser.parse_args(argv)
    root = Path(args.data) / ("frames" if args.frames else "single")
    t0 = time.perf_counter()
    documents = write_corpus(root, files=args.files, mb=args.mb, frames=args.frames)
    print(f"corpus: {args.files} files, {documents} documents ({time.perf_counter() - t0:.1f} s)")
    rows = int(0.75 * documents)
    pattern = str(root / "*.jsonl.zst")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        results["now"] = run_one(None, pattern, args.lanes, rows, tmpdir / "now.json")
        if not args.quick:
            tree = unpack(args.baseline, tmpdir / "baseline")
            results["baseline"] = run_one(tree, pattern, args.lanes, rows, tmpdir / "baseline.json")
    for name, r in results.items():
        print(f"{name}: zephon_flow from {r['code']}")
        rate = r["rows"] / r["seconds"]
        print(
            f"{name:9s} rows {r['rows']}, repeated documents {r['repeats']} "
            f"({100.0 * r['repeats'] / max(1, r['rows']):.1f} %), {rate:,.0f} docs/s, "
            f"first batch {r['first_batch_s']:.2f} s"
        )
        if "share" in r:
            s = r["share"]
            print(
                f"          {s['splits']} splits ({s['shared_splits']} shared by stride); lane share "
                f"max/mean {s['max'] / s['mean']:.2f}, min/mean {s['min'] / s['mean']:.2f}"
            )
    if "baseline" in results:
        now, base = results["now"], results["baseline"]
        ratio = (now["rows"] / now["seconds"]) / (base["rows"] / base["seconds"])
        print(f"throughput now/baseline: {ratio:.2f}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
