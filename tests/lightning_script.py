"""A tiny language model trained by PyTorch Lightning on zephon-flow batches, recording what each step saw.

Run in-process by ``test_integration_lightning.py`` (``fit``) and as a script, where Lightning's
DDP launcher starts the other ranks (``--devices 2``: strategy="ddp" on CPU, gloo)::

    python tests/lightning_script.py --corpus DIR --out DIR --devices 2 --steps 20 [--resume CKPT]

Each rank writes ``OUT/seen.rank<r>.npz``: the steps and ``input_ids`` it trained on, in order
(int32 [steps, rows, seq_len]), so a test can put the ranks' rows back together into global
batches. Checkpoints go to ``OUT/ckpt`` every 10 steps (``step=10.ckpt``, ``step=20.ckpt``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl
import numpy as np
import torch
from helpers import Corpus, example_spec
from lightning.pytorch.callbacks import ModelCheckpoint

import zephon_flow as zf
from _zephon_flow_lightning import LazyZephonGuard
from zephon_flow.integrations.lightning import ZephonDataModule, ZephonGuard

LANES, GLOBAL_BATCH, SEQ_LEN, VOCAB = 4, 8, 16, 300
EVERY = 10


def corpus_at(root: str | Path) -> Corpus:
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


class TinyLM(pl.LightningModule):
    """Embedding + linear next-token model; keeps the step and ``input_ids`` of every batch it trains."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        self.steps: list[int] = []
        self.seen: list[np.ndarray] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step, rows = batch
        ids = rows["input_ids"]
        self.steps.append(int(step))
        self.seen.append(ids.numpy().copy())
        ids = ids.long()
        logits = self.head(self.embed(ids[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(out: Path, *, steps: int, devices: int = 1) -> pl.Trainer:
    checkpoints = ModelCheckpoint(
        dirpath=out / "ckpt", filename="{step}", every_n_train_steps=EVERY, save_top_k=-1
    )
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        callbacks=[checkpoints],
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )


def fit(
    out: Path,
    *,
    steps: int,
    datamodule: pl.LightningDataModule | None = None,
    loader: Iterable[Any] | None = None,
    resume: Path | None = None,
    devices: int = 1,
    guard: bool = True,
) -> TinyLM:
    """Trains ``steps`` steps in all (a resumed fit continues to it) on a data module or a loader;
    ``guard=False`` takes out the ZephonGuard the entry point adds (a Trainer as if without it)."""
    model = TinyLM()
    run = trainer(out, steps=steps, devices=devices)
    if not guard:
        run.callbacks[:] = [cb for cb in run.callbacks if not isinstance(cb, LazyZephonGuard | ZephonGuard)]
    run.fit(model, train_dataloaders=loader, datamodule=datamodule, ckpt_path=resume)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--resume")
    args = parser.parse_args()
    out = Path(args.out)
    backend = "threads" if args.workers > 1 else "inline"
    data = ZephonDataModule(make_spec(corpus_at(args.corpus)), backend=backend, workers=args.workers)
    resume = Path(args.resume) if args.resume else None
    model = fit(out, steps=args.steps, datamodule=data, resume=resume, devices=args.devices)
    rank = model.global_rank
    np.savez(out / f"seen.rank{rank}.npz", steps=np.asarray(model.steps), input_ids=np.stack(model.seen))


if __name__ == "__main__":
    main()
