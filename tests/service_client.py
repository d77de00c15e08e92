"""A trainer rank in its own process: ``ADDRESS RANK WORLD_SIZE START_STEP STEPS [PAUSE]`` prints
``STEP DIGEST`` for each batch it gets from the batch service, pausing PAUSE seconds after each
(a slow rank); used by the service tests."""

from __future__ import annotations

import sys
import time

import zephon_flow as zf


def main(argv: list[str]) -> int:
    address, rank, world_size, start, steps = argv[0], *(int(v) for v in argv[1:5])
    pause = float(argv[5]) if len(argv) > 5 else 0.0
    with zf.Client(address, rank, world_size, start_step=start, retries=10, backoff=0.05) as client:
        for n, (step, batch) in enumerate(client, 1):
            print(step, zf.batch_digest(batch), flush=True)
            time.sleep(pause)
            if n == steps:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
