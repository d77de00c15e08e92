"""Plain DDP under torchrun: a ZephonDataset, DCP checkpoints of the step trained, a resume elsewhere.

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --steps 4 --save-at 2 --out ckpt-ddp
    torchrun --nproc-per-node 1 examples/ddp_torchrun.py --steps 4 --resume ckpt-ddp

The dataset is built before ``init_process_group`` (as a script's setup often is): its rank and
world size are read at the first batch. Every ``--save-at`` step, model, optimizer and the
data state after the last batch trained go into one ``torch.distributed.checkpoint``
(``ds.state_dict(step=...)``: no collective, each rank writes its own lanes); a resume loads
it at any world size and continues at that step. Rank 0 prints each step's global batch
digest (it gathers the ranks' rows), to compare runs. The data is ``stateful_dataloader.py``'s
(bytes as token ids), written to ``--data``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from stateful_dataloader import make_spec
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import zephon_flow as zf
from zephon_flow.torch import ZephonDataset


class Bigram(torch.nn.Module):
    """The smallest language model: next-byte logits from the current byte."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(256, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.table(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten().long())


def global_digest(batch: dict[str, torch.Tensor]) -> str | None:
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, batch["input_ids"].numpy())
    return zf.batch_digest({"input_ids": np.concatenate(parts)}) if dist.get_rank() == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=0, help="checkpoint after this many steps")
    parser.add_argument("--out", default="ckpt-ddp")
    parser.add_argument("--resume", default=None, help="a checkpoint folder written by --save-at")
    parser.add_argument("--data", default="ddp-data")
    args = parser.parse_args()
    os.makedirs(args.data, exist_ok=True)
    ds = ZephonDataset.from_loader(make_spec(args.data))  # rank, world size: at the first batch
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(Bigram())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.resume:
        model_sd, optim_sd = get_state_dict(model, optim)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "data": ds}
        dcp.load(state, checkpoint_id=args.resume)  # calls ds.load_state_dict with the data entry
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step, batch in DataLoader(ds, batch_size=None, num_workers=0):
        loss = model(batch["input_ids"])
        optim.zero_grad()
        loss.backward()
        optim.step()
        digest = global_digest(batch)
        if digest is not None:
            print(f"step {step} digest {digest[:16]} world {dist.get_world_size()}", flush=True)
        trained = step + 1
        if trained == args.save_at:
            model_sd, optim_sd = get_state_dict(model, optim)
            # The state after the last batch trained (a loader reading ahead would be past it).
            dcp.save(
                {"model": model_sd, "optim": optim_sd, "data": ds.state_dict(step=trained)},
                checkpoint_id=args.out,
            )
        if trained == args.steps:
            break
    ds.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
