"""What a trainer rank does with a ``zephon serve`` process: iterate, checkpoint, close.

    zephon serve examples/pipeline.py:spec --port 50051 --checkpoint-dir ckpt/ &
    python examples/read_served.py localhost:50051 --world-size 2 --steps 4

Runs ranks ``0..W-1`` one after the other (in training each is its own process) and prints,
per rank, the steps it got and the server checkpoint written at the end.
"""

from __future__ import annotations

import argparse

import zephon_flow as zf


def read_rank(address: str, r: int, world_size: int, steps: int) -> str:
    client = zf.Client(address, rank=r, world_size=world_size, start_step=0)
    for step, batch in client:  # numpy arrays viewing the received bytes (read-only);
        rows = batch["input_ids"].shape[0]  # as_torch=True gives torch tensors sharing them
        if step == steps - 1:
            break
    path = client.checkpoint()  # ckpt/step-<next step>.zfstate, written by the server
    client.close()
    print(f"rank {r} of {world_size}: steps 0..{step}, {rows} rows each; server checkpoint {path}")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="read a few steps from a zephon serve process")
    parser.add_argument("address")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    for r in range(args.world_size):
        read_rank(args.address, r, args.world_size, args.steps)
