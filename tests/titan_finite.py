"""Test-only: one rank of a 2 data-parallel x 2 tensor-parallel gloo world reading a finite
pipeline through ``ZephonTitanDataLoader`` as torchtitan builds it (no trainer).

Ranks are laid out as torchtitan's mesh (tensor parallel innermost: rank = dp_rank * 2 + tp);
the world (4) is larger than the data-parallel degree (2). Writes
``{"rank", "dp_rank", "dp_group", "rows": [[row digests] per batch]}`` (``dp_group``: the ranks
of the data-parallel group the loader's end agreement uses) to ``$ZEPHON_TITAN_DIGESTS/finite<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from titan_pipeline import SEQ_LEN, row_digest

from zephon_flow.integrations.torchtitan import ZephonTitanDataLoader, data_parallel_group

TP = 2


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp_rank, dp_world_size = rank // TP, dist.get_world_size() // TP
    config = ZephonTitanDataLoader.Config(spec="titan_pipeline:finite_spec")
    loader = config.build(
        dp_world_size=dp_world_size,
        dp_rank=dp_rank,
        tokenizer=None,
        seq_len=SEQ_LEN,
        local_batch_size=4 // dp_world_size,
    )
    rows = []
    for inputs, labels in loader:
        rows.append([row_digest(i.numpy(), t.numpy()) for i, t in zip(inputs["input"], labels, strict=True)])
    loader.close()
    group = dist.get_process_group_ranks(data_parallel_group(dp_rank, dp_world_size))
    out = os.path.join(os.environ["ZEPHON_TITAN_DIGESTS"], f"finite{rank}.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "dp_rank": dp_rank, "dp_group": sorted(group), "rows": rows}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
