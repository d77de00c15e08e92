"""A tiny GPT-2 trained by the Hugging Face ``Trainer`` on zephon-flow, checkpointed, resumed elsewhere.

    python examples/hf_trainer.py --out run-hf --steps 6 --save-steps 3
    python examples/hf_trainer.py --out run-hf --steps 6 --resume run-hf/checkpoint-3
    torchrun --nproc_per_node 2 examples/hf_trainer.py --out run-hf2 --steps 6 --resume run-hf/checkpoint-3

``ZephonTrainer`` trains on ``ZephonDataset.from_loader(spec)``: each rank its rows of each
global batch, one global batch per micro-step; every checkpoint folder gets
``zephon_state.zfstate`` (every rank's lanes after the last batch trained), which a resume
loads, at any world size, without replaying a batch. The data is ``stateful_dataloader.py``'s
(bytes as token ids, 64-token sequences, global batch 4), written to ``--data``.
``--digests FILE``: rank 0 appends ``step <n> <sha256 of the global batch's input_ids>`` for
every micro-step trained (it gathers the ranks' rows), to compare runs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from stateful_dataloader import make_spec
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import zephon_flow as zf
from zephon_flow.integrations.hf import ZephonTrainer
from zephon_flow.torch import ZephonDataset


class DigestTrainer(ZephonTrainer):
    """Appends each micro-step's global batch digest to a file (rank 0), for comparing runs."""

    def __init__(self, *args: Any, digests: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.digests = digests
        self.micro_step = 0

    def training_step(self, model: Any, inputs: dict[str, torch.Tensor], *args: Any) -> Any:
        ids = inputs["input_ids"].cpu()
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, ids)
            ids = torch.cat(parts)
        if self.args.process_index == 0:
            step = self.state.global_step * self.args.gradient_accumulation_steps + self.micro_step
            with open(self.digests, "a", encoding="utf-8") as f:
                f.write(f"step {step} {zf.batch_digest({'input_ids': ids.numpy()})}\n")
        self.micro_step = (self.micro_step + 1) % self.args.gradient_accumulation_steps
        return super().training_step(model, inputs, *args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoint-N folders)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--resume", help="a checkpoint-N folder (of any world size)")
    parser.add_argument("--data", default="hf-data", help="where the example's JSONL file is written")
    parser.add_argument("--digests", help="append each micro-step's global batch digest here")
    opts = parser.parse_args()

    os.makedirs(opts.data, exist_ok=True)
    spec = make_spec(opts.data)  # 2 lanes, global_batch_size 4, Pack(seq_len=64)
    # Rank and world size are read from torch.distributed at the first batch.
    dataset = ZephonDataset.from_loader(spec)
    args = TrainingArguments(
        output_dir=opts.out,
        max_steps=opts.steps,  # required: the stream has no length
        save_steps=opts.save_steps,
        per_device_train_batch_size=spec.global_batch_size // int(os.environ.get("WORLD_SIZE", "1")),
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_steps=opts.steps,
    )
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=32, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    extra = {"digests": opts.digests} if opts.digests else {}
    trainer = (DigestTrainer if opts.digests else ZephonTrainer)(
        model=model, args=args, train_dataset=dataset, **extra
    )
    trainer.train(resume_from_checkpoint=opts.resume)
    if args.process_index == 0:
        print(f"trained to step {trainer.state.global_step} on {args.world_size} rank(s)")


if __name__ == "__main__":
    main()
