"""A tiny language model trained by PyTorch Lightning on zephon-flow, checkpointed, resumed elsewhere.

    python examples/lightning_trainer.py --out run-pl --steps 20 --every 10 --devices 2
    python examples/lightning_trainer.py --out run-pl1 --steps 20 --resume run-pl/ckpt/step=10.ckpt

``ZephonDataModule`` hands each rank its rows of each global batch; every Lightning checkpoint
holds the data's state after the last batch trained (every rank's lanes, merged), which
``trainer.fit(ckpt_path=...)`` loads, at any world size and worker count, without replaying a
batch. ``--devices 2`` is Lightning's DDP on CPU (gloo): Lightning starts the second process.
The data is ``stateful_dataloader.py``'s (bytes as token ids, 64-token sequences, global batch
4), written to ``--data``. ``--digests FILE``: rank 0 appends ``step <n> <sha256 of the global
batch's input_ids>`` for every step trained (it gathers the ranks' rows), to compare runs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from stateful_dataloader import make_spec

import zephon_flow as zf
from zephon_flow.integrations.lightning import ZephonDataModule


class TinyLM(pl.LightningModule):  # type: ignore[misc]
    """Embedding + linear next-token model over byte ids."""

    def __init__(self, digests: str | None = None) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.head = torch.nn.Linear(32, 256)
        self.digests = digests

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step, rows = batch  # this rank's rows of global batch `step`
        ids = rows["input_ids"].long()
        if self.digests:
            self.write_digest(step, rows["input_ids"])
        logits = self.head(self.embed(ids[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))

    def write_digest(self, step: int, ids: torch.Tensor) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, ids)
            ids = torch.cat(parts)  # rank slices in rank order: the global batch
        if self.global_rank == 0 and self.digests:
            with open(self.digests, "a", encoding="utf-8") as f:
                f.write(f"step {step} {zf.batch_digest({'input_ids': ids.numpy()})}\n")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="checkpoints go to OUT/ckpt/step=N.ckpt")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--devices", type=int, default=1, help="processes (DDP on CPU when > 1)")
    parser.add_argument("--workers", type=int, default=1, help="loader threads")
    parser.add_argument("--resume", help="a checkpoint of any world size and worker count")
    parser.add_argument("--data", default="pl-data", help="where the example's JSONL file is written")
    parser.add_argument("--digests", help="append each step's global batch digest here")
    opts = parser.parse_args()

    os.makedirs(opts.data, exist_ok=True)
    spec = make_spec(opts.data)  # 2 lanes, global_batch_size 4, Pack(seq_len=64)
    # Rank and world size come from the process group Lightning starts.
    data = ZephonDataModule(spec, backend="threads" if opts.workers > 1 else "inline", workers=opts.workers)
    trainer = pl.Trainer(
        max_steps=opts.steps,  # the stream has no length
        accelerator="cpu",
        devices=opts.devices,
        strategy="ddp" if opts.devices > 1 else "auto",
        callbacks=[
            ModelCheckpoint(f"{opts.out}/ckpt", "{step}", every_n_train_steps=opts.every, save_top_k=-1)
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    trainer.fit(TinyLM(opts.digests), datamodule=data, ckpt_path=opts.resume)


if __name__ == "__main__":
    main()
