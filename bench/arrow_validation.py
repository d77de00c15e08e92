"""What checking Arrow IPC batches before reading them costs ReadArrow, on large batches.

Run from the repository root::

    .venv/bin/python -m bench.arrow_validation            # 4 batches of 32,768 rows per column kind, 5 repeats
    .venv/bin/python -m bench.arrow_validation --quick    # a tiny smoke run

A damaged IPC file read unchecked makes pyarrow read out of bounds and crash the process, so
``ReadArrow`` checks the column it reads of each record batch in full before reading it
(``operators/arrow.check_column``). Side by side in one run, contenders alternated within each
repeat, on the same memory-mapped files (page cache warm):

- **unchecked**: the check replaced by nothing (what reading cost before any check; unsafe);
- **checked** (as shipped): Arrow's full validation of the column, strings viewed as bytes (the
  offsets and lengths; the UTF-8 check is left to the decoder, which makes it anyway);
- **checked_utf8**: Arrow's full validation of the column as it is, UTF-8 included (what the
  first fix did, on every column of the batch, also when the file was opened).

Two workloads per column kind (``text``: strings of ~500 bytes; ``tokens``: lists of 128
int32 ids): **read**, the lane's work (list the splits, ``read_split`` every split, ``decode``
every record: records/s), and **check**, the check alone on every batch's column (GB/s of
column buffers). Reported as medians and ratios to ``unchecked``; timings are never asserted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from bench.stats import median
from zephon_flow.core.source import START
from zephon_flow.operators import arrow
from zephon_flow.operators.arrow import ReadArrow


def _unchecked(values: pa.Array) -> None:
    return None


def _checked_utf8(values: pa.Array) -> None:
    values.validate(full=True)


CHECKS: dict[str, Callable[[pa.Array], None]] = {
    "unchecked": _unchecked,
    "checked": arrow.check_column,
    "checked_utf8": _checked_utf8,
}


def write_files(root: Path, *, batches: int, rows: int) -> dict[str, Path]:
    """One Arrow IPC file per column kind, ``batches`` record batches of ``rows`` rows each."""
    rng = np.random.default_rng(0)
    words = np.array(["lorem", "ipsum", "dolor", "sit", "amet", "data", "lane", "window", "ré"])
    paths = {}
    for kind in ("text", "tokens"):
        path = root / f"{kind}.arrow"
        with pa.OSFile(str(path), "wb") as sink:
            writer: ipc.RecordBatchFileWriter | None = None
            for _ in range(batches):
                if kind == "text":
                    picks = words[rng.integers(0, len(words), (rows, 80))]
                    column = pa.array([" ".join(p) for p in picks], type=pa.string())
                else:
                    ids = rng.integers(0, 50_000, rows * 128, dtype=np.int32)
                    column = pa.ListArray.from_arrays(np.arange(0, rows * 128 + 1, 128, dtype=np.int32), ids)
                batch = pa.record_batch({kind: column})
                if writer is None:
                    writer = ipc.new_file(sink, batch.schema)
                writer.write_batch(batch)
            assert writer is not None
            writer.close()
        paths[kind] = path
    return paths


@contextmanager
def using(check: Callable[[pa.Array], None]) -> Iterator[None]:
    saved = arrow.check_column
    arrow.check_column = check  # type: ignore[assignment]
    try:
        yield
    finally:
        arrow.check_column = saved


def read_all(path: Path, kind: str) -> int:
    """The lane's work: every split read and every record decoded; returns the records."""
    source = ReadArrow(str(path), column=kind)
    source.bind_label(kind)
    n = 0
    for split in source.splits(1):
        for _, record in source.read_split(split, START):
            source.decode(record, source.operator_name)
            n += 1
    return n


def check_all(path: Path, kind: str, check: Callable[[pa.Array], None]) -> int:
    """The check alone on every batch's column; returns the bytes of the columns' buffers."""
    total = 0
    with pa.memory_map(str(path)) as mapped:
        reader = ipc.open_file(mapped)
        for b in range(reader.num_record_batches):
            column = reader.get_batch(b).column(0)
            check(column)
            total += column.nbytes
    return total


def _timed(work: Callable[[], int]) -> tuple[float, int]:
    started = time.perf_counter()
    amount = work()
    return time.perf_counter() - started, amount


def run(*, batches: int, rows: int, repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {"batches": batches, "rows_per_batch": rows, "repeats": repeats}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(Path(tmp), batches=batches, rows=rows)
        results["file_mb"] = {k: round(p.stat().st_size / 1e6, 1) for k, p in paths.items()}
        for kind, path in paths.items():
            read_s: dict[str, list[float]] = {name: [] for name in CHECKS}
            check_s: dict[str, list[float]] = {name: [] for name in CHECKS}
            records: dict[str, int] = {}
            nbytes = 0
            read_all(path, kind)  # the page cache warm for every contender alike
            for repeat in range(repeats):
                order = list(CHECKS) if repeat % 2 == 0 else list(reversed(CHECKS))
                for name in order:
                    with using(CHECKS[name]):
                        seconds, records[name] = _timed(partial(read_all, path, kind))
                    read_s[name].append(seconds)
                    seconds, nbytes = _timed(partial(check_all, path, kind, CHECKS[name]))
                    check_s[name].append(seconds)
            base = median(read_s["unchecked"])
            results[kind] = {
                "records": records,
                "read_records_per_s": {n: round(records[n] / median(s)) for n, s in read_s.items()},
                "read_time_over_unchecked": {n: round(median(s) / base, 3) for n, s in read_s.items()},
                "check_gb_per_s": {
                    n: round(nbytes / 1e9 / median(s), 2) for n, s in check_s.items() if n != "unchecked"
                },
                "check_share_of_read": {
                    n: round(median(check_s[n]) / base, 3) for n in CHECKS if n != "unchecked"
                },
            }
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32_768, help="rows per record batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.rows, args.repeats = 2, 300, 1
    results = run(batches=args.batches, rows=args.rows, repeats=args.repeats)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
