"""A tiny GPT-2 trained by ``ZephonTrainer`` on the test corpus, recording what each micro-step saw.

Run in-process by ``test_integration_hf.py`` (``run``) and under torchrun as a script::

    python -m torch.distributed.run --nproc_per_node 2 tests/hf_trainer_script.py \\
        --corpus DIR --job OUT RECORD RESUME [--job OUT RECORD RESUME ...]

Each rank writes ``FILE.rank<r>.npy``: the ``input_ids`` of every micro-step it trained, in
order (int64 [micro-steps, rows, seq_len]), so a test can put the ranks' rows back together into
global batches.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from helpers import Corpus, example_spec
from tokenizers import Tokenizer
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import zephon_flow as zf
from zephon_flow.integrations.hf import ZephonTrainer
from zephon_flow.torch import ZephonDataset

SEQ_LEN = 32
GLOBAL_BATCH = 8
LANES = 4


def corpus_at(root: str) -> Corpus:
    """The session corpus's files, found by their names (``helpers.make_corpus``)."""
    folder = Path(root)
    return Corpus(
        root=folder,
        web_jsonl=str(folder / "web.jsonl"),
        code_parquet=str(folder / "code.parquet"),
        tokenizer_json=str(folder / "tokenizer.json"),
        web_texts=(),
        code_texts=(),
    )


def make_spec(corpus: Corpus) -> zf.LoaderSpec:
    return example_spec(corpus, lanes=LANES, global_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN)


def tiny_gpt2(corpus: Corpus) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    vocab = Tokenizer.from_file(corpus.tokenizer_json).get_vocab_size()
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=32, vocab_size=vocab, n_positions=SEQ_LEN, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


class RecordingTrainer(ZephonTrainer):
    """Keeps the ``input_ids`` of every micro-step it trains."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[np.ndarray] = []

    def training_step(self, model: Any, inputs: dict[str, torch.Tensor], *args: Any) -> Any:
        assert inputs["input_ids"].dtype == torch.int64 and inputs["labels"].dtype == torch.int64
        self.seen.append(inputs["input_ids"].cpu().numpy().copy())
        return super().training_step(model, inputs, *args)


def training_args(
    out: str, *, steps: int, save_steps: int, rows: int, ga: int = 1, **change: Any
) -> TrainingArguments:
    options: dict[str, Any] = dict(
        output_dir=out,
        max_steps=steps,
        save_steps=save_steps,
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=ga,
        learning_rate=1e-3,
        logging_steps=1000,
        report_to=[],
        use_cpu=True,
        save_only_model=False,
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**{**options, **change})


def run(
    corpus: Corpus,
    out: str,
    *,
    steps: int = 20,
    save_steps: int = 10,
    resume: str | bool | None = None,
    backend: str = "inline",
    workers: int = 1,
    ga: int = 1,
) -> list[np.ndarray]:
    """Trains (or resumes) and returns this rank's ``input_ids`` per micro-step."""
    spec = make_spec(corpus)
    dataset = ZephonDataset.from_loader(spec, backend=backend, workers=workers)  # before the args
    args = training_args(out, steps=steps, save_steps=save_steps, rows=GLOBAL_BATCH // _world(), ga=ga)
    trainer = RecordingTrainer(model=tiny_gpt2(corpus), args=args, train_dataset=dataset)
    # One intra-op thread: a model this small only loses time to threads on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        torch.set_num_threads(threads)
    return trainer.seen


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", required=True)
    parser.add_argument(
        "--job",
        nargs=3,
        action="append",
        required=True,
        metavar=("OUT", "RECORD", "RESUME"),
        help="a training run (RESUME: a checkpoint folder, or - for none); several run in turn",
    )
    opts = parser.parse_args()
    corpus = corpus_at(opts.corpus)
    rank = int(os.environ.get("RANK", "0"))
    for out, record, resume in opts.job:
        seen = run(corpus, out, resume=None if resume == "-" else resume)
        np.save(f"{record}.rank{rank}.npy", np.stack(seen))


if __name__ == "__main__":
    main()
