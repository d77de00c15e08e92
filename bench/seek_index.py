"""Seek indexes of compressed JSONL: one-time index cost against a plain decompression pass, and split reads.

Run from the repository root::

    .venv/bin/python -m bench.seek_index              # 4 files x 64 MB per format
    .venv/bin/python -m bench.seek_index --mb 8       # a quick run

Generates (once; kept under ``$TMPDIR/zephon-seek-bench``, never in git) four ``.jsonl.gz`` files
(one gzip member each, level 6) and four ``.jsonl.zst`` files written as 1 MiB frames (what
``zstd -B``/pzstd/seekable-zstd writers produce), of ``--mb`` MB of JSONL text each. Then, in one
run, side by side:

- **plain pass**: decompressing every file once with the standard reader (``gzip.GzipFile``,
  ``zstandard``), in s per GB of decompressed data: what reading a file whole costs;
- **index build**: ``seek_index.index_for`` with an empty cache (gzip: one ``indexed_gzip`` pass
  that stores a 32 KiB window per seek point, then written atomically; zstd: walking frame and
  block headers, no decompression), in s per GB, and as a ratio to the plain pass;
- **cache hit**: the same call again (stat, hash of the first and last MiB, JSON read);
- **split read**: ``ReadJsonl.read_split`` over the files' splits for 16 lanes, each split read
  on its own (seek to its seek point, read its lines), against reading each file whole as one
  split; in MB/s of decompressed lines, with the plan's split count and max/mean split weight.

Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from zephon_flow.core.source import START, Split
from zephon_flow.operators import seek_index
from zephon_flow.operators.jsonl import ReadJsonl
from zephon_flow.operators.parquet import ReadParquet

T = TypeVar("T")

FILES = 4
LANES = 16


def _corpus_lines(mb: int, seed: int) -> bytes:
    """``mb`` MB of JSONL documents of Zipf-distributed words (compresses like prose, ~3x)."""
    r = random.Random(seed)
    vocab = [
        "".join(r.choice("etaoinshrdlucmfwypvbgkqjxz") for _ in range(r.randint(2, 10)))
        for _ in range(30_000)
    ]
    weights = [1.0 / (i + 1) for i in range(len(vocab))]
    pool = []
    for i in range(4000):
        words = r.choices(vocab, weights, k=r.randint(50, 400))
        pool.append((f'{{"id": {i}, "text": "' + " ".join(words) + '"}\n').encode())
    out, size, n = [], 0, 0
    while size < mb * 1_000_000:
        line = pool[r.randrange(len(pool))].replace(b'"id": ', b'"id": %d' % n, 1)
        out.append(line)
        size += len(line)
        n += 1
    return b"".join(out)


def generate(root: Path, mb: int) -> tuple[list[str], list[str]]:
    root.mkdir(parents=True, exist_ok=True)
    gz, zst = [], []
    cctx = zstandard.ZstdCompressor(level=3)
    for k in range(FILES):
        g, z = root / f"{mb}mb-{k}.jsonl.gz", root / f"{mb}mb-{k}.jsonl.zst"
        if not (g.exists() and z.exists()):
            data = _corpus_lines(mb, seed=k)
            g.write_bytes(gzip.compress(data, compresslevel=6))
            frame = 1 << 20
            z.write_bytes(b"".join(cctx.compress(data[i : i + frame]) for i in range(0, len(data), frame)))
        gz.append(str(g))
        zst.append(str(z))
    return gz, zst


def plain_pass(path: str) -> int:
    """Decompresses the whole file with the standard reader; returns the decompressed bytes."""
    n = 0
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                n += len(chunk)
    else:
        with (
            open(path, "rb") as raw,
            zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as fh,
        ):
            while chunk := fh.read(1 << 20):
                n += len(chunk)
    return n


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def read_lines(source: ReadJsonl, splits: list[Split]) -> int:
    return sum(len(r.payload) + 1 for s in splits for _, r in source.read_split(s, START))


def run(paths: list[str], cache: str) -> dict[str, float]:
    os.environ["ZEPHON_CACHE_DIR"] = cache
    t_plain, total = timed(lambda: sum(plain_pass(p) for p in paths))
    gb = int(total) / 1e9  # type: ignore[call-overload]
    t_build, indexes = timed(lambda: [seek_index.index_for(p, operator="bench") for p in paths])
    t_hit, _ = timed(lambda: [seek_index.index_for(p, operator="bench") for p in paths])
    pattern = paths[0].rsplit("-", 1)[0] + "-*" + (".jsonl.gz" if paths[0].endswith(".gz") else ".jsonl.zst")
    source = ReadJsonl(pattern)  # one source over the 4 files, as a pipeline has it
    splits = source.splits(LANES)
    costs = [x.cost for x in splits]
    t_split, n_split = timed(lambda: read_lines(source, splits))
    t_whole, n_whole = timed(lambda: read_lines(source, [Split(p, 0, 0) for p in paths]))
    assert n_split == n_whole, (n_split, n_whole)
    return {
        "gb": gb,
        "plain_s_per_gb": t_plain / gb,
        "build_s_per_gb": t_build / gb,
        "hit_ms_per_file": 1000 * t_hit / len(paths),
        "points": sum(len(i.points) for i in indexes),
        "index_mb": sum(os.path.getsize(i.gzip_index) for i in indexes if i.gzip_index) / 1e6,
        "splits": len(splits),
        "max_over_mean": max(costs) / (sum(costs) / len(costs)),
        "split_mb_s": int(n_split) / 1e6 / t_split,  # type: ignore[call-overload]
        "whole_mb_s": int(n_whole) / 1e6 / t_whole,  # type: ignore[call-overload]
    }


def parquet_cost(root: Path) -> dict[str, float]:
    """Reading a 16-lane plan of a Parquet file of 2 big row groups against reading each group once."""
    path = root / "two-groups.parquet"
    if not path.exists():
        r = random.Random(7)
        rows = [" ".join(str(r.randrange(10**6)) for _ in range(20)) for _ in range(400_000)]
        pq.write_table(pa.table({"text": rows}), str(path), row_group_size=200_000)
    source = ReadParquet(str(path))
    splits = source.splits(LANES)
    t_plan, n_plan = timed(lambda: sum(1 for s in splits for _ in source.read_split(s, START)))
    pf = pq.ParquetFile(str(path))
    t_once, n_once = timed(
        lambda: sum(
            len(pf.read_row_group(g, columns=["text"]).column(0).to_pylist())
            for g in range(pf.num_row_groups)
        )
    )
    assert n_plan == n_once
    return {"splits": len(splits), "groups": pf.num_row_groups, "ratio": t_plan / t_once}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64, help="decompressed MB per file (default 64)")
    args = parser.parse_args()
    root = Path(tempfile.gettempdir()) / "zephon-seek-bench"
    gz, zst = generate(root, args.mb)
    with tempfile.TemporaryDirectory(dir=root) as cache:
        rows = {"gzip (1 member)": run(gz, cache + "/gz"), "zstd (1 MiB frames)": run(zst, cache + "/zst")}
    print(f"{FILES} files x {args.mb} MB decompressed per format, {LANES} lanes")
    head = (
        f"{'format':22} {'plain s/GB':>10} {'index s/GB':>10} {'index/plain':>11} {'hit ms':>7} "
        f"{'points':>6} {'idx MB':>6} {'splits':>6} {'max/mean':>8} {'split MB/s':>10} {'whole MB/s':>10} {'ratio':>6}"
    )
    print(head)
    for name, r in rows.items():
        print(
            f"{name:22} {r['plain_s_per_gb']:10.2f} {r['build_s_per_gb']:10.2f} "
            f"{r['build_s_per_gb'] / r['plain_s_per_gb']:11.2f} {r['hit_ms_per_file']:7.2f} "
            f"{int(r['points']):6d} {r['index_mb']:6.1f} {int(r['splits']):6d} {r['max_over_mean']:8.2f} "
            f"{r['split_mb_s']:10.1f} {r['whole_mb_s']:10.1f} {r['split_mb_s'] / r['whole_mb_s']:6.2f}"
        )
    pq_row = parquet_cost(root)
    print(
        f"Parquet, 400,000 rows in {int(pq_row['groups'])} row groups, {LANES} lanes: {int(pq_row['splits'])} "
        f"row-range splits read in {pq_row['ratio']:.2f}x the time of reading each group once"
    )


if __name__ == "__main__":
    main()
