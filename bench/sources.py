"""Read rates of ReadArrow, ReadTextFiles and ReadWebDataset next to a plain reader of the same data.

Run from the repository root::

    .venv/bin/python -m bench.sources              # full run, 3 repeats
    .venv/bin/python -m bench.sources --quick      # a tiny smoke run

Each source lists its splits, reads every split with ``read_split`` and decodes every record, in
one thread: the work one lane's feed and its decoders do. Arrow and text-file listing is in the
timing (it is cheap); the WebDataset header index is built once beforehand, as a loader does
once per process, and timed on its own. Each baseline reads the same data the plain way in the
same run, contenders alternated within each repeat:

- **arrow**: ``pyarrow.ipc.open_file(...).read_all()`` and ``to_pylist()`` of the column;
- **text**: ``open(path, "rb").read().decode()`` for every file of the sorted glob;
- **webdataset**: ``tarfile.open`` and ``extractfile().read()`` of every member, grouped by key.

Also timed for WebDataset: building the header index alone (``splits()``, in samples indexed per
second), and the time to the first record when resuming at the last sample of a split against at
its first. Reported as
records/s medians and ratios (source over baseline). Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.ipc as ipc

from bench.stats import median
from zephon_flow.core.source import Source, Split
from zephon_flow.operators.arrow import ReadArrow
from zephon_flow.operators.text_files import ReadTextFiles
from zephon_flow.operators.webdataset import ReadWebDataset

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "and",
    "keeps",
    "on",
    "running",
    "far",
    "away",
]


def make_data(root: Path, scale: int) -> dict[str, str]:
    """``scale`` times 200 Arrow rows, 50 small text files and 2 x 100 tar samples."""
    texts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(20 + i % 40)) for i in range(200 * scale)]
    feather.write_feather(pa.table({"text": texts}), str(root / "a.arrow"), chunksize=100)
    (root / "txt").mkdir()
    for i, text in enumerate(texts[: 50 * scale]):
        (root / "txt" / f"{i:07d}.txt").write_text(text)
    for shard in range(2):
        with tarfile.open(root / f"s{shard}.tar", "w") as tar:
            for i in range(100 * scale):
                for ext, data in (("jpg", os.urandom(4096)), ("json", b"{}"), ("txt", texts[i].encode())):
                    info = tarfile.TarInfo(f"{shard}{i:07d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return {"arrow": str(root / "a.arrow"), "text": str(root / "txt" / "*.txt"), "tar": str(root / "*.tar")}


def read_source(source: Source) -> int:
    n = 0
    for split in source.splits():
        for _, record in source.read_split(split, -1):
            n += len(source.decode(record, source.operator_name))
    return n


def arrow_baseline(path: str) -> int:
    with pa.memory_map(path) as f:
        return len(ipc.open_file(f).read_all().column("text").to_pylist())


def text_baseline(paths: list[str]) -> int:
    n = 0
    for path in paths:
        with open(path, "rb") as f:
            n += bool(f.read().decode("utf-8"))
    return n


def tar_baseline(paths: list[str]) -> int:
    n, key = 0, None
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar:
                f = tar.extractfile(member) if member.isreg() else None
                if f is not None:
                    f.read()
                    k = member.name.split(".", 1)[0]
                    n, key = n + (k != key), k
    return n


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    n = fn()
    return time.perf_counter() - start, n


def _first_position(source: ReadWebDataset, split: Split, position: int) -> int:
    """The position after the first record read from ``position``."""
    return next(iter(source.read_split(split, position)))[0]


def resume_times(pattern: str, repeats: int) -> tuple[float, float]:
    """Median seconds to the first record resuming at a split's first sample and at its last."""
    source = ReadWebDataset(pattern, samples_per_split=100)
    split = source.splits()[0]
    times: dict[int, list[float]] = {split.start: [], split.stop - 1: []}
    for _ in range(repeats * 20):
        for position, got in times.items():
            t, _ = timed(partial(_first_position, source, split, position))
            got.append(t)
    return median(times[split.start]), median(times[split.stop - 1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny data, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=int, default=50, help="data size (x 200 rows, 50 files, 200 samples)")
    parser.add_argument("--out", default="bench/results/sources.json")
    args = parser.parse_args(argv)
    scale, repeats = (1, 1) if args.quick else (args.scale, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(Path(tmp), scale)
        text_paths = sorted(str(p) for p in Path(tmp, "txt").glob("*.txt"))
        tar_paths = sorted(str(p) for p in Path(tmp).glob("*.tar"))
        indexed = ReadWebDataset(data["tar"])
        indexed.splits()
        contenders: dict[str, Callable[[], int]] = {
            "arrow_source": lambda: read_source(ReadArrow(data["arrow"])),
            "arrow_baseline": lambda: arrow_baseline(data["arrow"]),
            "text_source": lambda: read_source(ReadTextFiles(data["text"])),
            "text_baseline": lambda: text_baseline(text_paths),
            "webdataset_source": lambda: read_source(indexed),
            "webdataset_baseline": lambda: tar_baseline(tar_paths),
            "webdataset_index": lambda: sum(s.stop - s.start for s in ReadWebDataset(data["tar"]).splits()),
        }
        rates: dict[str, list[float]] = {name: [] for name in contenders}
        counts: dict[str, int] = {}
        for _ in range(repeats):
            for name, fn in contenders.items():
                seconds, n = timed(fn)
                counts[name] = n
                rates[name].append(n / seconds)
        resume_first, resume_last = resume_times(data["tar"], repeats)
    medians = {f"{name}_per_s": median(r) for name, r in rates.items()}
    ratios = {
        f"{kind}_source_over_baseline": medians[f"{kind}_source_per_s"] / medians[f"{kind}_baseline_per_s"]
        for kind in ("arrow", "text", "webdataset")
    }
    ratios["webdataset_index_over_source"] = (
        medians["webdataset_index_per_s"] / medians["webdataset_source_per_s"]
    )
    medians["webdataset_resume_first_ms"] = resume_first * 1000
    medians["webdataset_resume_last_ms"] = resume_last * 1000
    ratios["webdataset_resume_last_over_first"] = resume_last / resume_first
    result = {"scale": scale, "repeats": repeats, "records": counts, "medians": medians, "ratios": ratios}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
