"""The demo: a real text pipeline on Python's own docs and code, shown elastic and resumable."""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import apache_beam as beam

from zephon_flow import operators as ops
from zephon_flow.core.batches import batch_digest
from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.checkpoint.store import CHECKPOINT_SUFFIX, encode_state, load_state, save_state
from zephon_flow.core.errors import SpecError
from zephon_flow.demo_data import build_demo_data, corpus_bytes
from zephon_flow.engine.simulate import global_batches
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.progress import Progress

SEQ_LEN = 512
LANES = 8
GLOBAL_BATCH = 32


def demo_spec(root: str | None = None) -> LoaderSpec:
    """The text pipeline of DESIGN.md over the demo corpus: mix, tokenize, pack, shuffle."""
    data = build_demo_data(root)

    def text_mix(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(data.docs_jsonl, field="text", split_bytes=64 * 1024)
        code = p | "code" >> ops.ReadParquet(data.code_parquet, column="content")
        mixed = (docs, code) | "mix" >> ops.Mix(weights=[0.3, 0.7])
        toks = mixed | "tok" >> beam.ParDo(ops.Tokenize(data.tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=SEQ_LEN))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=64))

    return LoaderSpec(text_mix, lanes=LANES, seed=1234, global_batch_size=GLOBAL_BATCH)


def _run(spec: LoaderSpec, desc: str, steps: int, **kwargs: object) -> tuple[list[str], float]:
    progress = Progress(
        total=steps, desc=desc, file=sys.stdout, enabled=True, tokens_per_step=GLOBAL_BATCH * SEQ_LEN
    )
    digests = [
        batch_digest(batch)
        for _, batch in progress(global_batches(spec, steps=steps, **kwargs))  # type: ignore[arg-type]
    ]
    tokens_per_s = progress.steps_per_second * GLOBAL_BATCH * SEQ_LEN
    print(
        f"  {desc}: {len(digests)} global batches, {tokens_per_s:,.0f} tokens/s after the first "
        f"batch ({progress.startup:.1f} s to the first)"
    )
    return digests, tokens_per_s


def run_demo(*, steps: int = 300, workers: int = 2, backend: str = "processes") -> int:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise SpecError(
            f"demo: steps must be an integer >= 2 (it resumes from a checkpoint at steps // 2), got {steps!r}"
        )
    print("zephon-flow demo: building the corpus and tokenizer (cached after the first run)")
    data = build_demo_data(progress=True)
    spec = demo_spec(data.root)
    print(
        f"corpus: {corpus_bytes(data) / 1e6:.1f} MB of Python docs and code; lanes={LANES}, "
        f"global batch={GLOBAL_BATCH} x {SEQ_LEN} tokens"
    )

    print(f"\n[1] {steps} steps as 4 ranks, backend={backend}, workers={workers} per rank")
    ref, _ = _run(spec, "4 ranks", steps, world_size=4, backend=backend, workers=workers)

    mid = steps // 2
    print(f"\n[2] the same stream as 2 ranks (threads) to step {mid}, a checkpoint, then 8 ranks (inline)")
    final: list[dict[str, Any]] = []
    first_half, _ = _run(spec, "2 ranks", mid, world_size=2, backend="threads", workers=2, final_state=final)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/step{mid}{CHECKPOINT_SUFFIX}"
        state = LoaderState.from_plain(final[0])
        save_state(state, path)
        size = len(encode_state(state))
        print(f"  checkpoint at step {mid}: {size / 1024:.0f} KiB (open windows and buffers only)")
        second_half, _ = _run(
            spec, "8 ranks", steps - mid, world_size=8, backend="inline", state=load_state(path)
        )
    resumed = first_half + second_half
    if resumed == ref:
        print(
            f"\nOK: all {steps} global batch digests match across 4 ranks / 2 ranks / resume at "
            f"step {mid} on 8 ranks (first {ref[0][:16]}..., last {ref[-1][:16]}...)"
        )
        return 0
    bad = (
        next(i for i, (a, b) in enumerate(zip(ref, resumed, strict=False)) if a != b)
        if len(ref) == len(resumed)
        else min(len(ref), len(resumed))
    )
    print(f"\nMISMATCH: digests differ first at step {bad}")
    return 1
