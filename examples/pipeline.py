"""The example trainer's data: a small demo corpus through mix, tokenize, pack and shuffle.

Serve it with ``zephon serve examples/pipeline.py:spec --port 50051``; the trainer builds the
same spec for embedded mode. The corpus (Python's own docs and code, about 6 s to build the
first time) is cached in ``$ZEPHON_EXAMPLE_DIR``, else ``~/.cache/zephon-flow/example``.
"""

from __future__ import annotations

import os
from pathlib import Path

# isort: off
import zephon_flow as zf  # first: it quiets notices Beam logs when imported

import apache_beam as beam
from tokenizers import Tokenizer

# isort: on
from zephon_flow import operators as ops
from zephon_flow.demo_data import DemoData, build_demo_data

SEQ_LEN = 64
LANES = 4  # the largest world size the example resumes under
GLOBAL_BATCH = 16
SEED = 1234
# A smaller corpus and vocabulary than `zephon demo`: the model is tiny and trains on CPU.
MAX_CODE_FILES = 40
VOCAB_SIZE = 512


def default_root() -> str:
    env = os.environ.get("ZEPHON_EXAMPLE_DIR")
    return env if env else str(Path("~/.cache/zephon-flow/example").expanduser())


def example_data(root: str | None = None) -> DemoData:
    """Builds (or reuses) the corpus and tokenizer in ``root``."""
    return build_demo_data(
        root if root is not None else default_root(), max_code_files=MAX_CODE_FILES, vocab_size=VOCAB_SIZE
    )


def vocab_size(data: DemoData) -> int:
    return int(Tokenizer.from_file(data.tokenizer_json).get_vocab_size())


def example_spec(root: str | None = None) -> zf.LoaderSpec:
    """Prose and code mixed 3:7, tokenized with an end-of-text token, packed, shuffled."""
    data = example_data(root)

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(data.docs_jsonl, field="text", split_bytes=64 * 1024)
        code = p | "code" >> ops.ReadParquet(data.code_parquet, column="content")
        mixed = (docs, code) | "mix" >> ops.Mix(weights=[0.3, 0.7])
        toks = mixed | "tok" >> beam.ParDo(ops.Tokenize(data.tokenizer_json, append_eos=True))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=SEQ_LEN))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=32))

    return zf.LoaderSpec(build, lanes=LANES, seed=SEED, global_batch_size=GLOBAL_BATCH)


def spec() -> zf.LoaderSpec:
    """``MODULE:SPEC`` target for ``zephon serve`` and ``zephon digest``."""
    return example_spec()
