"""A tiny GPT trained on CPU by W data-parallel ranks from zephon-flow, checkpointed and resumable elsewhere.

    python examples/train_tiny_gpt.py --world-size 2 --steps 40 --checkpoint-every 10 --out run/
    # kill it (Ctrl-C, kill -9) any time after a checkpoint, then resume on another world size:
    python examples/train_tiny_gpt.py --world-size 4 --steps 40 --checkpoint-every 10 --out run/ --resume run/

Each rank is a process (torch.multiprocessing, or torchrun when its variables are set) in a gloo
process group; the model is wrapped in DistributedDataParallel. Data comes from
``ZephonDataset`` over an embedded ``zf.Loader`` (``--data embedded``) or a ``zephon serve``
process (``--data service --address HOST:PORT``). Every ``--checkpoint-every`` steps, model,
optimizer and data state go into one ``torch.distributed.checkpoint`` directory; the data state
is every rank's loader state merged (embedded) or the step (service; rank 0 also asks the server
to write its own checkpoint and records the path). Per step, rank 0 appends to ``log.jsonl``:
the step, the loss over the global batch and the global batch digest (rank 0 gathers the ranks'
slices and digests their concatenation, so it equals ``zephon digest`` of the same pipeline).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from pipeline import SEQ_LEN, example_data, example_spec, vocab_size
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import zephon_flow as zf
from zephon_flow.torch import ZephonDataset

LATEST = "latest"


# -- the model ---------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyGPT(nn.Module):
    """A causal LM; attention stays inside each packed document (``segment_ids``)."""

    def __init__(self, vocab: int, *, seq_len: int, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def token_losses(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token losses inside documents, and how many tokens it counts."""
    ids = batch["input_ids"].long()
    seg = batch["segment_ids"].long()
    logits = model(ids, batch["position_ids"].long(), seg)
    valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return (losses * valid.flatten()).sum(), valid.sum()


# -- one rank ----------------------------------------------------------------------------------
def make_dataset(args: argparse.Namespace, rank: int, world: int) -> ZephonDataset:
    spec = example_spec(args.data_dir)
    if args.data == "service":  # the server checks that it serves this very pipeline
        return ZephonDataset.from_client(
            args.address, rank=rank, world_size=world, fingerprint=spec.fingerprint
        )
    return ZephonDataset.from_loader(
        spec, rank=rank, world_size=world, backend=args.backend, workers=args.workers
    )


def save_checkpoint(args: argparse.Namespace, step: int, state: dict[str, Any], ds: ZephonDataset) -> None:
    path = Path(args.out) / f"step-{step:06d}"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), overwrite=True))
    meta: dict[str, Any] = {"step": step, "world_size": dist.get_world_size(), "data": args.data}
    if args.data == "service" and dist.get_rank() == 0:
        try:
            meta["server_checkpoint"] = ds.checkpoint_on_server(step)
        except zf.ZephonError as exc:  # the trainer's own checkpoint stays usable
            print(f"warning: the server wrote no checkpoint for step {step}: {exc}", flush=True)
    dist.barrier()  # every rank has written its part before the checkpoint is named the latest
    if dist.get_rank() == 0:
        (path / "zephon.json").write_text(json.dumps(meta) + "\n")
        tmp = Path(args.out) / f".{LATEST}.tmp"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, Path(args.out) / LATEST)
        print(
            f"checkpoint at step {step}: {path}"
            + (f" (server: {meta['server_checkpoint']})" if "server_checkpoint" in meta else ""),
            flush=True,
        )


def global_digest(batch: dict[str, torch.Tensor]) -> str | None:
    """Rank 0 gets every rank's slice and digests their concatenation; other ranks get None."""
    local = {k: v.numpy() for k, v in batch.items()}
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    if parts is None:
        return None
    return zf.batch_digest({k: np.concatenate([p[k] for p in parts]) for k in sorted(local)})


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if rank == 0:  # builds the corpus the first time; the other ranks wait and reuse it
        example_data(args.data_dir)
    dist.barrier()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyGPT(vocab_size(example_data(args.data_dir)), seq_len=SEQ_LEN))
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ds = make_dataset(args, rank, world)
    start = 0
    if args.resume:
        ckpt = Path(args.resume) / (Path(args.resume) / LATEST).read_text().strip()
        model_sd, optim_sd = get_state_dict(model, optim)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "data": ds}
        dcp.load(state, checkpoint_id=str(ckpt))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = ds.next_step
        if rank == 0:
            print(f"resumed from {ckpt} at step {start} with world size {world}", flush=True)
    log = Path(args.out) / "log.jsonl"
    batches = iter(DataLoader(ds, batch_size=None, num_workers=0))
    step = start
    while step < args.steps:
        got, batch = next(batches)
        assert got == step, (got, step)
        loss_sum, count = token_losses(model, batch)
        total = count.clone()
        dist.all_reduce(total)  # the global token count: the loss is the same whatever the world size
        loss = loss_sum * world / total.clamp(min=1)  # DDP averages gradients over the ranks
        optim.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
        logged = loss.detach() / world
        dist.all_reduce(logged)
        digest = global_digest(batch)
        step += 1
        if rank == 0:
            line = {"step": got, "loss": round(logged.item(), 6), "digest": digest, "world_size": world}
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps(line | {"time": round(time.time(), 3)}) + "\n")
            print(
                f"step {got:4d}  loss {logged.item():.4f}  digest {digest[:16] if digest else ''}", flush=True
            )
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            model_sd, optim_sd = get_state_dict(model, optim)
            save_checkpoint(args, step, {"model": model_sd, "optim": optim_sd, "data": ds}, ds)
    ds.close()
    dist.destroy_process_group()


# -- launching ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="data-parallel ranks (processes)")
    p.add_argument("--steps", type=int, default=40, help="train until this many steps are done")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: none)")
    p.add_argument("--out", required=True, help="directory for checkpoints and log.jsonl")
    p.add_argument("--resume", help="a previous --out directory: continue from its latest checkpoint")
    p.add_argument("--data", choices=["embedded", "service"], default="embedded")
    p.add_argument("--address", help="HOST:PORT of `zephon serve examples/pipeline.py:spec` (--data service)")
    p.add_argument(
        "--data-dir", help="corpus cache (default $ZEPHON_EXAMPLE_DIR or ~/.cache/zephon-flow/example)"
    )
    p.add_argument("--backend", default="inline", help="embedded loader backend: inline, threads, processes")
    p.add_argument("--workers", type=int, default=1, help="embedded loader workers per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    if args.data == "service" and not args.address:
        p.error("--data service needs --address HOST:PORT")
    if args.resume and not (Path(args.resume) / LATEST).is_file():
        p.error(f"--resume {args.resume}: no checkpoint there (no {LATEST} file)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    if args.world_size == 1:  # no need for a second process
        train(0, 1, args)
        return 0
    mp.spawn(train, args=(args.world_size, args), nprocs=args.world_size, join=True)  # type: ignore[no-untyped-call]
    return 0


if __name__ == "__main__":
    sys.exit(main())
