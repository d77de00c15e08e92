"""Checkpoint size, save, load and resume time and save memory: format 2, compact, incremental, recipe.

```bash
.venv/bin/python -m bench.checkpoints                  # the README's pipeline at its settings
.venv/bin/python -m bench.checkpoints --lanes 4 --buffer 64 --seq-len 256 --batch 16   # quick
```

The README's pipeline (two sources, ``Mix``, ``Tokenize``, ``Pack(seq_len=2048)``,
``Shuffle(buffer=4096)``, 16 lanes, global batch 256) runs over the demo corpus (Python's own
docs and code, a BPE tokenizer of 32,768 ids trained on it), until every shuffle buffer is full,
then 100 steps more. In the same process, one after the other:

- **format 2**: the encoder before this change (the whole checkpoint encoded in memory as
  int32 copies of every field, then written), and its load;
- **compact**: ``zf.save_state`` (format 3: lane by lane, narrowed ids, Pack's derived fields
  rebuilt on load, zstd), and ``zf.load_state``;
- **incremental**: ``zf.save_state(state, path, base=compact)`` 1, 10 and 100 steps after the
  compact one, and their load (which loads the base too);
- **recipe**: the same state as ``Loader(state_mode="recipe").state_dict()`` gives it (buffered
  sequences as their documents; the conversion is timed as part of the save), and a recipe
  checkpoint incremental on it 10 steps later.

*resume s* is what a trainer waits for: ``zf.Loader(spec, state=loaded)`` (for a recipe state:
re-reading the documents in flight and re-running the front on the loader's backend) until its
first batch. For the recipe state the run also reports how many distinct documents it
re-read and their tokens, the rate they were rebuilt at, and what resuming would take if every
sequence in flight held distinct documents (a corpus far larger than the state: this demo corpus
of 5 MB refills the buffers many times over, so its documents repeat and each is rebuilt once).

Peak RSS while saving is sampled every 2 ms from ``/proc/self/statm`` and reported above the RSS
before the save. "raw" is the state's in-memory bytes (every array at its size), and MB/s are raw
bytes per second of save. Every restore is checked: the loader resumed from it gives the
uninterrupted run's next batch digests.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import apache_beam as beam

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.core.checkpoint import blob
from zephon_flow.core.checkpoint.store import to_loader_state
from zephon_flow.demo_data import DemoData, build_demo_data
from zephon_flow.engine import recipe

_PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1e6


@dataclass(frozen=True)
class Config:
    lanes: int = 16
    buffer: int = 4096
    seq_len: int = 2048
    batch: int = 256
    workers: int = 2
    backend: str = "processes"
    later: tuple[int, ...] = (1, 10, 100)
    vocab: int = 32768
    code_files: int = 300


def readme_spec(data: DemoData, cfg: Config) -> zf.LoaderSpec:
    """The README's text pipeline over the demo corpus."""

    def build(p: beam.Pipeline) -> beam.PCollection:
        web = p | "web" >> ops.ReadJsonl(data.docs_jsonl, field="text", split_bytes=64 * 1024)
        code = p | "code" >> ops.ReadParquet(data.code_parquet, column="content")
        docs = (web, code) | "mix" >> ops.Mix(weights=[0.7, 0.3])
        toks = docs | "tok" >> beam.ParDo(ops.Tokenize(data.tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=cfg.seq_len))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=cfg.buffer))

    return zf.LoaderSpec(build, lanes=cfg.lanes, seed=1234, global_batch_size=cfg.batch)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


@contextmanager
def peak_rss() -> Iterator[dict[str, int]]:
    """Samples RSS every 2 ms; ``out["peak_above"]`` is the peak above the RSS at entry."""
    out = {"before": rss(), "peak_above": 0}
    stop = threading.Event()

    def sample() -> None:
        peak = out["before"]
        while not stop.is_set():
            peak = max(peak, rss())
            stop.wait(0.002)
        out["peak_above"] = max(peak, rss()) - out["before"]

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()


def save_format_2(state: dict[str, Any], path: str) -> None:  # returns nothing, like it did
    """How ``zf.save_state`` wrote checkpoints before format 3: one blob built in memory."""
    data = blob.encode({**to_loader_state(state).to_plain(), "format_version": 2})
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def raw_bytes(state: dict[str, Any]) -> int:
    """The state's arrays and bytes at their in-memory size (what every format starts from)."""

    def walk(v: Any) -> int:
        if isinstance(v, dict):
            return sum(walk(x) for x in v.values())
        if isinstance(v, list | tuple):
            return sum(walk(x) for x in v)
        return int(getattr(v, "nbytes", len(v) if isinstance(v, bytes) else 0))

    return walk(state)


def _save_incremental(state: dict[str, Any], path: str, *, base: str) -> None:
    zf.save_state(to_loader_state(state), path, base=base)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run(data: DemoData, cfg: Config, workdir: str) -> dict[str, Any]:
    spec = readme_spec(data, cfg)
    fill = 1  # the first batch needs every lane's buffer full
    wanted = {fill, *(fill + k for k in cfg.later)}
    last = max(wanted) + 2
    states: dict[int, dict[str, Any]] = {}
    digests: list[str] = []
    start = time.perf_counter()
    with zf.Loader(spec, backend=cfg.backend, workers=cfg.workers, prefetch=1) as loader:
        for step, batch in loader:
            digests.append(zf.batch_digest(batch))
            if step + 1 in wanted:
                states[step + 1] = loader.state_dict()
            if step + 1 == last:
                break
    fill_seconds = time.perf_counter() - start
    raw = raw_bytes(states[fill])

    def resumes(state: Any, step: int) -> tuple[bool, float]:
        """Whether a loader resumed from ``state`` gives the next two digests, and the seconds
        from its construction to its first batch."""
        start = time.perf_counter()
        with zf.Loader(spec, state=state, backend=cfg.backend, workers=cfg.workers, prefetch=1) as ld:
            it = iter(ld)
            got = [zf.batch_digest(next(it)[1])]
            first = time.perf_counter() - start
            got.append(zf.batch_digest(next(it)[1]))
        return got == digests[step : step + 2], first

    rows: list[dict[str, Any]] = []

    def measure(name: str, step: int, save: Callable[[str], Any], path: str) -> None:
        with peak_rss() as mem:
            stats, save_s = timed(lambda: save(path))
        loaded, load_s = timed(lambda: zf.load_state(path))
        ok, resume_s = resumes(loaded, step)
        del loaded
        rows.append(
            {
                "format": name,
                "step": step,
                "bytes": os.path.getsize(path),
                "bytes_before_zstd": getattr(stats, "uncompressed", os.path.getsize(path)),
                "save_s": save_s,
                "load_s": load_s,
                "resume_s": resume_s,
                "save_peak_rss_above_mb": mem["peak_above"] / MB,
                "raw_mb_per_s": raw / MB / save_s,
                "resume_digests_match": ok,
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    old, full = os.path.join(workdir, "format2.zf"), os.path.join(workdir, "compact.zf")
    measure("format 2 (before)", fill, lambda p: save_format_2(states[fill], p), old)
    os.unlink(old)
    measure("compact", fill, lambda p: zf.save_state(to_loader_state(states[fill]), p), full)
    for k in cfg.later:
        measure(
            f"incremental, {k} step(s) after the base",
            fill + k,
            functools.partial(_save_incremental, states[fill + k], base=full),
            os.path.join(workdir, f"plus{k}.zf"),
        )
    plan = spec.compile()

    def as_recipe(step: int) -> zf.LoaderState:
        return recipe.to_recipes(plan, to_loader_state(states[step]))

    later = max(k for k in cfg.later if k <= 10) if any(k <= 10 for k in cfg.later) else min(cfg.later)
    base = os.path.join(workdir, "recipe.zf")
    measure("recipe", fill, lambda p: zf.save_state(as_recipe(fill), p), base)
    measure(
        f"recipe, incremental, {later} step(s) after the recipe base",
        fill + later,
        lambda p: zf.save_state(as_recipe(fill + later), p, base=base),
        os.path.join(workdir, f"recipe-plus{later}.zf"),
    )
    rebuild = rebuild_figures(plan, spec.lanes, zf.load_state(base), cfg)
    # What Loader(state_mode="recipe").state_dict() costs: cold, then one step later (warm:
    # the writer remembers the recipes of the sequences that stayed).
    writer = recipe.RecipeWriter(plan)
    _, cold_s = timed(lambda: writer(to_loader_state(states[fill])))
    soon = min(cfg.later)
    _, warm_s = timed(lambda: writer(to_loader_state(states[fill + soon])))
    rebuild.update(state_dict_cold_s=cold_s, state_dict_later_s=warm_s, state_dict_later_steps=soon)
    before = rows[0]["bytes"]
    compact = rows[1]["bytes"]
    for row in rows:
        row["size_vs_format_2"] = row["bytes"] / before
        row["size_vs_compact"] = row["bytes"] / compact
        row["before_zstd_vs_format_2"] = row["bytes_before_zstd"] / before
    return {
        "config": asdict(cfg),
        "raw_state_mb": raw / MB,
        "fill_seconds": fill_seconds,
        "rows": rows,
        "format_2_over_compact": before / compact,
        "recipe_rebuild": rebuild,
    }


def rebuild_figures(plan: Any, lanes: int, state: Any, cfg: Config) -> dict[str, Any]:
    """What a recipe restore re-reads: distinct documents and their tokens, against the tokens
    of every sequence in flight, and the rate the front rebuilt them at (inline, one core)."""
    loaded = to_loader_state(state)
    need = recipe.needs(recipe.layout(plan), list(loaded.lane_states.values()))
    pieces, tokens_in_flight = need.pieces, need.tokens
    documents, seconds = timed(lambda: recipe.reread(plan, lanes, need.keys))
    tokens = sum(int(a.size) for outs in documents.values() for a in outs)
    rate = tokens / seconds if seconds else float("nan")
    return {
        "distinct_documents": len(need.keys),
        "pieces": pieces,
        "document_tokens_reread": tokens,
        "tokens_in_flight": tokens_in_flight,
        "reread_s_one_core": seconds,
        "rebuilt_tokens_per_s_one_core": rate,
        "projected_resume_s_all_distinct_one_core": tokens_in_flight / rate if rate else float("nan"),
        "projected_resume_s_all_distinct_per_rank_of_16": tokens_in_flight / rate / 16
        if rate
        else float("nan"),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| checkpoint | bytes | vs format 2 | vs compact | before zstd | save s | raw MB/s saved "
        "| peak RSS above, saving | load s | resume s (to first batch) | resume digests |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        size = f"{r['bytes'] / MB:,.1f} MB" if r["bytes"] >= 100_000 else f"{r['bytes'] / 1e3:,.1f} KB"
        lines.append(
            f"| {r['format']} | {size} | {r['size_vs_format_2']:.4f} | {r['size_vs_compact']:.4f} | "
            f"{r['bytes_before_zstd'] / MB:,.1f} MB | {r['save_s']:.2f} | "
            f"{r['raw_mb_per_s']:,.0f} | {r['save_peak_rss_above_mb']:,.0f} MB | {r['load_s']:.2f} | "
            f"{r['resume_s']:.2f} | {'match' if r['resume_digests_match'] else 'DIFFER'} |"
        )
    rb = result["recipe_rebuild"]
    lines.append("")
    lines.append(
        f"recipe restore: {rb['distinct_documents']:,} distinct documents ({rb['document_tokens_reread']:,} "
        f"tokens) re-read for {rb['pieces']:,} pieces holding {rb['tokens_in_flight']:,} tokens; "
        f"front rebuilt {rb['rebuilt_tokens_per_s_one_core']:,.0f} tokens/s on one core; if every "
        f"piece were a distinct document: ~{rb['projected_resume_s_all_distinct_one_core']:,.0f} s on one "
        f"core for all lanes (~{rb['projected_resume_s_all_distinct_per_rank_of_16']:,.0f} s per rank at "
        f"world size 16); recipe state_dict(): {rb['state_dict_cold_s']:.2f} s cold, "
        f"{rb['state_dict_later_s']:.2f} s {rb['state_dict_later_steps']} step(s) after the previous one"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Config()
    for name in ("lanes", "buffer", "seq_len", "batch", "workers", "vocab", "code_files"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--backend", default=defaults.backend)
    parser.add_argument("--later", default=",".join(map(str, defaults.later)), help="steps after the base")
    parser.add_argument("--data", default=os.path.expanduser("~/.cache/zephon-flow/bench-checkpoints"))
    parser.add_argument("--out", default="bench/results/checkpoints.json")
    args = parser.parse_args(argv)
    cfg = Config(
        lanes=args.lanes,
        buffer=args.buffer,
        seq_len=args.seq_len,
        batch=args.batch,
        workers=args.workers,
        backend=args.backend,
        later=tuple(int(k) for k in args.later.split(",")),
        vocab=args.vocab,
        code_files=args.code_files,
    )
    data = build_demo_data(args.data, max_code_files=cfg.code_files, vocab_size=cfg.vocab, progress=True)
    with tempfile.TemporaryDirectory(prefix="zephon-ck-bench-") as workdir:
        result = run(data, cfg, workdir)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"raw state {result['raw_state_mb']:,.0f} MB, buffers filled in {result['fill_seconds']:.0f} s")
    print(table(result))
    return 0 if all(r["resume_digests_match"] for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
