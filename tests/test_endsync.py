"""Ranks of a finite pass agree on its last step: in one process (threads) and over torch.distributed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zephon_flow as zf
from zephon_flow.core.clock import ManualClock
from zephon_flow.engine.simulate import global_batches
from zephon_flow.errors import RankLostError, WorkerLostError

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


# --- A rank that fails, closes or dies: the peers waiting on it raise, naming it -------------


def _vote_in_thread(sync: zf.ThreadEndSync, rank: int, step: int, stop: threading.Event) -> dict[str, Any]:
    """Rank ``rank``'s vote (True) on ``step`` in a thread; ``join`` it, then read its outcome."""
    out: dict[str, Any] = {}

    def vote() -> None:
        try:
            out["result"] = sync.vote(rank, step, True, stop)
        except RankLostError as exc:
            out["error"] = str(exc)

    out["thread"] = thread = threading.Thread(target=vote)
    thread.start()
    return out


def _outcome(out: dict[str, Any]) -> Any:
    out["thread"].join(timeout=30)
    assert not out["thread"].is_alive()
    return out.get("error", out.get("result"))


def test_a_peer_that_fails_makes_the_waiting_rank_raise_at_once_naming_it_and_its_error() -> None:
    sync = zf.ThreadEndSync(2)
    waiting = _vote_in_thread(sync, 0, 0, threading.Event())
    sync.leave(1, WorkerLostError("worker processes die as they start"))
    assert _outcome(waiting) == (
        "rank 1 of 2 left before the ranks agreed on step 0, so they cannot agree on the end of "
        "this pass: it failed with WorkerLostError: worker processes die as they start"
    )


def test_a_peer_that_closes_makes_a_later_vote_raise_but_its_votes_still_count() -> None:
    sync = zf.ThreadEndSync(2)
    stop1 = threading.Event()
    ahead = _vote_in_thread(sync, 1, 0, stop1)  # rank 1's producer voted on step 0, then closed
    with pytest.raises(RankLostError) as err:
        sync.leave(1, None)
        stop1.set()
        assert _outcome(ahead) is False  # its own loader closed: it returns, it does not raise
        assert sync.vote(0, 0, False, threading.Event()) is True  # rank 1's vote (True) counts
        sync.vote(0, 1, False, threading.Event())
    assert str(err.value) == (
        "rank 1 of 2 left before the ranks agreed on step 1, so they cannot agree on the end of "
        "this pass: its loader closed"
    )


def test_the_rank_that_failed_first_is_named_not_one_that_failed_because_of_it() -> None:
    sync = zf.ThreadEndSync(3)
    sync.leave(1, RankLostError("rank 2 of 3 left ..."))
    sync.leave(2, zf.DataError("docs.jsonl, line 7: not JSON"))
    with pytest.raises(RankLostError, match=r"^rank 2 of 3 left before .*: it failed with DataError: docs"):
        sync.vote(0, 0, True, threading.Event())


def test_a_rank_that_never_votes_makes_the_others_raise_after_the_timeout_on_the_injected_clock() -> None:
    clock = ManualClock()
    sync = zf.ThreadEndSync(3, timeout=30, clock=clock)
    with pytest.raises(RankLostError) as err:
        sync.vote(1, 0, True, threading.Event())
    assert str(err.value) == (
        "rank(s) [0, 2] of 3 did not vote on step 0 within 30 s (ThreadEndSync(timeout=...)): each "
        "rank's loader must be made and iterated"
    )
    assert 30 <= clock.now() < 30.2  # no real waiting: the clock moved by the polls only


def test_two_loaders_of_the_same_rank_on_one_sync_are_refused_by_name() -> None:
    sync = zf.ThreadEndSync(2)
    waiting = _vote_in_thread(sync, 0, 0, threading.Event())
    waiting["thread"].join(timeout=0.5)  # most likely in: either order gives the refusal below
    with pytest.raises(zf.SpecError) as err:
        sync.vote(0, 0, True, threading.Event())
        sync.vote(0, 0, True, threading.Event())
    assert str(err.value) == (
        "rank 0 voted twice on step 0: two loaders of the same rank share this ThreadEndSync; "
        "give each rank of the 2 its own rank="
    )
    sync.leave(1, None)
    assert "its loader closed" in _outcome(waiting)


def test_a_loader_whose_peer_closed_unread_raises_naming_it(tmp_path: Path) -> None:
    from test_exactly_once import doc_spec, write_file

    write_file(tmp_path, 0, "jsonl", 40)
    specs = [doc_spec(str(tmp_path / "*.jsonl"), "jsonl", lanes=4, batch=8, epochs=1) for _ in range(2)]
    sync = zf.ThreadEndSync(2)
    with zf.Loader(specs[0], rank=0, world_size=2, end_sync=sync) as rank0:
        zf.Loader(specs[1], rank=1, world_size=2, end_sync=sync).close()
        with pytest.raises(RankLostError) as err:
            list(rank0)
    assert str(err.value) == (
        "rank 1 of 2 left before the ranks agreed on step 0, so they cannot agree on the end of "
        "this pass: its loader closed"
    )


# Two ranks simulated in one script that lacks the ``__main__`` guard: rank 1's workers come
# from the forkserver (rank 0's loader runs threads by then), import the script again and die.
_UNGUARDED = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {tests!r})
    import zephon_flow as zf
    from test_exactly_once import doc_spec

    spec = doc_spec({pattern!r}, "jsonl", lanes=4, batch=8, epochs=1)
    sync = zf.ThreadEndSync(2)
    loaders = [zf.Loader(spec, rank=r, world_size=2, backend="processes", workers=1, end_sync=sync) for r in range(2)]
    errors = {{}}

    def run(rank):
        try:
            for _ in loaders[rank]:
                pass
        except zf.ZephonError as exc:
            errors[rank] = f"{{type(exc).__name__}}: {{exc}}"

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("RANK0", errors.get(0), flush=True)
    print("RANK1", errors.get(1), flush=True)
    """
)


def test_two_ranks_in_an_unguarded_script_both_fail_with_the_guard_error_instead_of_hanging(
    tmp_path: Path,
) -> None:
    from test_exactly_once import write_file

    write_file(tmp_path, 0, "jsonl", 60)
    script = tmp_path / "two_ranks.py"
    script.write_text(_UNGUARDED.format(tests=str(ROOT), pattern=str(tmp_path / "*.jsonl")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    lines = {line[:5]: line[6:] for line in done.stdout.splitlines() if line.startswith("RANK")}
    assert lines["RANK1"].startswith("WorkerLostError: worker processes die as they start"), done.stdout
    assert lines["RANK0"].startswith(
        "RankLostError: rank 1 of 2 left before the ranks agreed on step 0, so they cannot agree on "
        "the end of this pass: it failed with WorkerLostError: worker processes die as they start"
    )
    assert 'if __name__ == "__main__":' in lines["RANK0"]


_KILLED_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    sys.path.insert(0, {tests!r})
    import zephon_flow as zf
    from test_exactly_once import doc_spec

    rank, rdv, pattern = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + rdv, rank=rank, world_size=2)
    spec = doc_spec(pattern, "jsonl", lanes=4, batch=8, epochs=1)
    loader = zf.Loader(spec, rank=rank, world_size=2)
    try:
        for step, _ in loader:
            if rank == 1 and step == 2:
                print("AT STEP 2", flush=True)
                sys.stdin.readline()  # the test kills this process here
    except zf.ZephonError as exc:
        print(f"{{type(exc).__name__}}: {{exc}}", flush=True)
        sys.exit(3)
    """
)


def test_a_rank_killed_mid_pass_makes_its_torch_peer_raise_naming_it(tmp_path: Path) -> None:
    from test_exactly_once import write_file

    data = tmp_path / "data"
    data.mkdir()
    write_file(data, 0, "jsonl", 200)
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_SCRIPT.format(tests=str(ROOT)))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "rdv"), str(data / "*.jsonl")],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        assert procs[1].stdout is not None
        assert procs[1].stdout.readline().strip() == "AT STEP 2"
        os.kill(procs[1].pid, signal.SIGKILL)
        out = procs[0].communicate(timeout=120)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()  # reaps it and closes its pipes
    assert procs[0].returncode == 3, out
    assert out.startswith("RankLostError: rank 0 of 2: the ranks could not agree on step "), out
    assert ": rank 1 failed or died (torch.distributed: " in out
