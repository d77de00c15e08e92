"""Padding, cut documents and speed of ``Pack``'s ``best_fit`` against ``concat``, on the demo corpus.

Run from the repository root::

    .venv/bin/python -m bench.packing                 # seq_len 512 and 2048, 3 repeats
    .venv/bin/python -m bench.packing --quick         # one seq_len, one repeat, a few documents

The corpus is the demo corpus (``zephon_flow.demo_data``: stdlib prose and code, built into
``~/.cache/zephon-flow/demo`` or ``--data-root``), tokenized once up front with its tokenizer,
EOS appended (as ``zephon_flow.demo`` does), in one seeded order that interleaves both sources.
Every contender is ``ops.Pack`` itself, fed the same documents through its ``process`` and
end-of-input timer without a runner, so only the operator is measured. Per contender:

- ``padding``: pad tokens / all tokens of the emitted sequences; ``padding_steady``: the same
  without the end-of-input flush (which an endless training stream never reaches);
- ``cut_docs``: documents whose tokens land in more than one sequence; ``avoidable_cuts``: those
  of them no longer than ``seq_len`` (they could have fit one sequence);
- ``cut_tokens``: tokens placed in a sequence other than the one holding their document's first
  token, i.e. cut off from their document's start (what attention masking per segment loses),
  and ``avoidable_cut_tokens``, those of documents no longer than ``seq_len``;
- ``extra_pieces``: pieces beyond the fewest each document needs (``ceil(n / seq_len)``);
- ``seqs_per_s``: emitted sequences per second (median over repeats, contenders alternated
  within each repeat), and its ratio to ``concat`` in the same repeat (median of the ratios).

Nothing is ever asserted about timings.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from bench.stats import median
from zephon_flow import operators as ops
from zephon_flow.demo_data import EOS_TOKEN, build_demo_data

SEQ_LENS = (512, 2048)
BUFFERS = (0, 16, 64, 256)
OPEN_BINS = 16
SEED = 0
DEFAULT_OUT = str(Path(__file__).resolve().parent / "results" / "packing.json")


class _Cell:
    """The runner's ReadModifyWrite state and timer, reduced to what ``Pack`` calls."""

    def __init__(self) -> None:
        self.value: Any = None

    def read(self) -> Any:
        return self.value

    def write(self, value: Any) -> None:
        self.value = value

    def clear(self) -> None:
        self.value = None

    def set(self, timestamp: Any) -> None:
        pass


def load_documents(
    data_root: str | None, *, limit: int | None, sources: str = "all", **build: Any
) -> list[np.ndarray]:
    """Every prose document and code file of the demo corpus (or only those of ``sources``) as
    int32 ids with EOS, in one seeded order that interleaves the two (the first ``limit``)."""
    data = build_demo_data(data_root, **build)
    texts: list[str] = []
    if sources in ("all", "prose"):
        with open(data.docs_jsonl, encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f if line.strip()]
    if sources in ("all", "code"):
        texts += [
            t for t in pq.read_table(data.code_parquet, columns=["content"])["content"].to_pylist() if t
        ]
    random.Random(SEED).shuffle(texts)
    texts = texts[:limit]
    tok = Tokenizer.from_file(data.tokenizer_json)
    eos = tok.token_to_id(EOS_TOKEN)
    return [
        np.asarray([*enc.ids, eos], dtype=np.int32)
        for enc in tok.encode_batch(texts, add_special_tokens=False)
    ]


def run(pack: ops.Pack, docs: list[np.ndarray]) -> tuple[float, list[dict[str, np.ndarray]], int]:
    """Seconds to pack ``docs`` (and flush the end), the sequences, and how many of them came
    before the end-of-input flush."""
    cell = _Cell()
    out: list[dict[str, np.ndarray]] = []
    start = time.perf_counter()
    for i, ids in enumerate(docs):
        out.extend(pack.process((0, ids), carry=cell, flush=cell, doc=(0, 0, i)))
    steady = len(out)
    out.extend(pack.flush_tail(carry=cell))
    return time.perf_counter() - start, out, steady


def quality(
    seqs: list[dict[str, np.ndarray]], steady: int, lengths: list[int], seq_len: int
) -> dict[str, Any]:
    """Padding and cut documents of one run (from ``segment_ids`` and ``documents``)."""
    pads = [int((s["segment_ids"] < 0).sum()) for s in seqs]
    pad = sum(pads)
    first: dict[int, int] = {}  # document -> the sequence that holds its first token
    spans: dict[int, int] = {}  # document -> number of sequences it is in
    cut_tokens = avoidable_tokens = 0
    for i, s in enumerate(seqs):
        seg = s["segment_ids"]
        for j, d in enumerate(s["documents"][:, 2].tolist()):
            spans[d] = spans.get(d, 0) + 1
            if first.setdefault(d, i) != i:
                n = int((seg == j).sum())
                cut_tokens += n
                avoidable_tokens += n if lengths[d] <= seq_len else 0
    cut = [d for d, n in spans.items() if n > 1]
    total = len(seqs) * seq_len
    assert total - pad == sum(lengths), "every token is packed exactly once"
    return {
        "sequences": len(seqs),
        "real_tokens": total - pad,
        "pad_tokens": pad,
        "padding": pad / total,
        "padding_steady": sum(pads[:steady]) / (steady * seq_len),
        "cut_docs": len(cut),
        "avoidable_cuts": sum(1 for d in cut if lengths[d] <= seq_len),
        "cut_tokens": cut_tokens,
        "cut_token_fraction": cut_tokens / (total - pad),
        "avoidable_cut_tokens": avoidable_tokens,
        # pieces beyond the fewest a document needs (ceil(n / seq_len)), over all documents
        "extra_pieces": sum(n - -(-lengths[d] // seq_len) for d, n in spans.items()),
    }


def contenders(seq_len: int, buffers: tuple[int, ...]) -> dict[str, ops.Pack]:
    out = {"concat": ops.Pack(seq_len=seq_len)}
    for b in buffers:
        out[f"best_fit/buffer={b}"] = ops.Pack(
            seq_len=seq_len, strategy="best_fit", buffer=b, open_bins=OPEN_BINS
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--max-code-files", type=int, default=600, help="of a corpus built in --data-root")
    parser.add_argument("--vocab-size", type=int, default=4096, help="of a corpus built in --data-root")
    parser.add_argument("--sources", choices=("all", "prose", "code"), default="all")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    seq_lens: tuple[int, ...] = SEQ_LENS
    buffers: tuple[int, ...] = BUFFERS
    repeats, limit = args.repeats, None
    if args.quick:
        seq_lens, buffers, repeats, limit = (512,), (0, 16), 1, 200
    docs = load_documents(
        args.data_root,
        limit=limit,
        sources=args.sources,
        max_code_files=args.max_code_files,
        vocab_size=args.vocab_size,
    )
    lengths = [int(d.size) for d in docs]
    results: dict[str, Any] = {
        "config": {
            "sources": args.sources,
            "documents": len(docs),
            "tokens": sum(lengths),
            "open_bins": OPEN_BINS,
            "repeats": repeats,
            "quick": args.quick,
        },
        "runs": {},
    }
    for seq_len in seq_lens:
        packs = contenders(seq_len, buffers)
        times: dict[str, list[float]] = {name: [] for name in packs}
        ratios: dict[str, list[float]] = {name: [] for name in packs}
        rows: dict[str, Any] = {}
        for r in range(repeats):
            names = list(packs)
            names = names[r % len(names) :] + names[: r % len(names)]  # rotate the order
            secs: dict[str, float] = {}
            for name in names:
                secs[name], seqs, steady = run(packs[name], docs)
                times[name].append(len(seqs) / secs[name])
                rows.setdefault(name, quality(seqs, steady, lengths, seq_len))
            for name in packs:
                ratios[name].append(
                    (rows[name]["sequences"] / secs[name]) / (rows["concat"]["sequences"] / secs["concat"])
                )
        for name in packs:
            rows[name]["seqs_per_s"] = median(times[name])
            rows[name]["seqs_per_s_over_concat"] = median(ratios[name])
        results["runs"][str(seq_len)] = rows
        _print_table(seq_len, rows, docs=len(docs), long_docs=sum(n > seq_len for n in lengths))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def _print_table(seq_len: int, rows: dict[str, Any], *, docs: int, long_docs: int) -> None:
    print(f"\nseq_len {seq_len}: {docs} documents, {long_docs} longer than seq_len")
    print(
        "| packer | sequences | padding (steady) | cut docs (avoidable) | cut tokens (avoidable) | extra pieces "
        "| seqs/s | vs concat |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, q in rows.items():
        print(
            f"| {name} | {q['sequences']} | {q['padding']:.2%} ({q['padding_steady']:.2%}) | {q['cut_docs']} ({q['avoidable_cuts']}) "
            f"| {q['cut_tokens']} ({q['cut_token_fraction']:.1%}; {q['avoidable_cut_tokens']}) "
            f"| {q['extra_pieces']} | {q['seqs_per_s']:.0f} "
            f"| {q['seqs_per_s_over_concat']:.2f} |"
        )


if __name__ == "__main__":
    main()
