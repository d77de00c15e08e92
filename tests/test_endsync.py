"""Ranks of a finite pass agree on its last step: in one process (threads) and over torch.distributed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import zephon_flow as zf
from zephon_flow.engine.simulate import global_batches

ROOT = Path(__file__).resolve().parent


def test_thread_end_sync_ors_the_votes_of_every_rank_per_step() -> None:
    sync = zf.ThreadEndSync(3)
    stop = threading.Event()
    results: dict[int, list[bool]] = {}

    def vote(rank: int) -> None:
        results[rank] = [sync.any_rank(step, local=(rank == step), stop=stop) for step in range(5)]

    threads = [threading.Thread(target=vote, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    # Step s has data only on rank s (ranks 0-2); steps 3 and 4 have none anywhere.
    assert results == {r: [True, True, True, False, False] for r in range(3)}


def test_a_waiting_rank_returns_when_its_loader_closes() -> None:
    sync = zf.ThreadEndSync(2)
    stop = threading.Event()
    stop.set()
    assert sync.any_rank(0, True, stop) is False


def test_thread_end_sync_refuses_a_bad_world_size() -> None:
    with pytest.raises(zf.SpecError, match="world_size must be a positive integer, got 0"):
        zf.ThreadEndSync(0)


_RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    sys.path.insert(0, {tests!r})
    import zephon_flow as zf
    from test_exactly_once import doc_spec

    rank, world, rdv, out, pattern = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method="file://" + rdv, rank=rank, world_size=world)
    spec = doc_spec(pattern, "jsonl", lanes=4, batch=8, epochs=1)
    rows = []
    with zf.Loader(spec, rank=rank, world_size=world) as loader:
        for step, batch in loader:
            rows.append([step, batch["doc"].tolist(), batch["valid"].tolist()])
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(rows, f)
    """
)


def test_ranks_over_torch_distributed_yield_the_same_steps_as_one_rank(tmp_path: Path) -> None:
    from test_exactly_once import doc_spec, write_file

    data = tmp_path / "data"
    data.mkdir()
    write_file(data, 0, "jsonl", 61)
    write_file(data, 1, "jsonl", 7)
    pattern = str(data / "*.jsonl")
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT.format(tests=str(ROOT)))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), "2", str(tmp_path / "rdv"), str(outs[r]), pattern], env=env
        )
        for r in range(2)
    ]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0]
    ranks = [json.loads(o.read_text()) for o in outs]
    assert len(ranks[0]) == len(ranks[1]) > 0
    spec = doc_spec(pattern, "jsonl", lanes=4, batch=8, epochs=1)
    one = [(step, b["doc"].tolist(), b["valid"].tolist()) for step, b in global_batches(spec, steps=10**6)]
    merged = [(a[0], a[1] + b[1], a[2] + b[2]) for a, b in zip(ranks[0], ranks[1], strict=True)]
    assert merged == one
    delivered = [d for _, docs, valid in one for d, v in zip(docs, valid, strict=True) if v]
    assert sorted(delivered) == list(range(61)) + list(range(100_000, 100_007))
    assert not np.all(one[-1][2])  # the tail is padded


_CLOSE_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch.distributed as dist
    sys.path.insert(0, {tests!r})
    import zephon_flow as zf
    from test_exactly_once import doc_spec

    rank, world, rdv, pattern = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method="file://" + rdv, rank=rank, world_size=world)
    spec = doc_spec(pattern, "jsonl", lanes=4, batch=8, epochs=1)
    loader = zf.Loader(spec, rank=rank, world_size=world, prefetch=2)
    for step, _ in loader:
        if step == 2:  # training stops here; the producers are ahead, each in its own agreement
            break
    if rank == 1:
        time.sleep(1.0)  # rank 0 has closed: rank 1's producer may wait for an agreement that never comes
    t0 = time.monotonic()
    loader.close()
    print(f"closed in {{time.monotonic() - t0:.2f}}", flush=True)
    """
)


def test_a_loader_whose_producer_waits_for_a_closed_rank_closes_at_once(tmp_path: Path) -> None:
    from test_exactly_once import write_file

    data = tmp_path / "data"
    data.mkdir()
    write_file(data, 0, "jsonl", 200)
    script = tmp_path / "close.py"
    script.write_text(_CLOSE_SCRIPT.format(tests=str(ROOT)))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), "2", str(tmp_path / "rdv"), str(data / "*.jsonl")],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0]
    for out in outs:
        seconds = float(out.split("closed in ")[1].split()[0])
        assert seconds < 5.0, out
