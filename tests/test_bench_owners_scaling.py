"""Smoke tests of bench/owners_scaling.py and bench/owners_checkpoint.py at a tiny size, on one
local Ray for the module: every contender gives the same digests, the files and numbers are
there and sane. Never timings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    from zephon_flow.runners.ray_env import connect

    started = connect("tests", None, num_cpus=2)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def test_quick_scaling_run_gives_one_stream_under_every_owner_count(
    ray_session: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import owners_scaling

    out = tmp_path / "owners_scaling.json"
    assert owners_scaling.main(["--quick", "--out", str(out)]) == 0
    results = json.loads(out.read_text(encoding="utf-8"))
    assert set(results["runs"]) == {"loader", "owners2", "loader_wide"}
    assert results["digests_equal"] is True
    assert results["steps_compared"] == 2 + 4  # warm-up and timed steps of every contender
    assert all(rate > 0 for rate in results["steps_per_second"].values())
    assert len(results["runs"]["owners2"][0]["owner_nodes"]) == 2


def test_scaling_digests_differ_when_the_stream_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict can fail: a contender whose steps differ makes ``digests_equal`` False."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import owners_scaling

    run = {"seconds": 1.0, "digests": ["a", "b"]}
    runs = {"loader": [run], "owners1": [run], "owners2": [{**run, "digests": ["a", "c"]}]}
    summary = owners_scaling.summarise(runs, [1, 2], steps=2, ideal_1=1.0)
    assert summary["digests_equal"] is False
    assert summary["efficiency"]["owners2"]["median"] == pytest.approx(0.5)


def test_quick_checkpoint_run_measures_a_checkpoint_of_every_lane(
    ray_session: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import owners_checkpoint

    out = tmp_path / "owners_checkpoint.json"
    assert owners_checkpoint.main(["--quick", "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text(encoding="utf-8"))["results"]
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the one JSON line
    assert last["owners_checkpoint"][0]["lanes"] == 8
    (checkpoint,) = [c for c in result["checkpoints"] if c["way"] == "gather"]
    # 8 lanes, each a shuffle buffer of 1 MiB of 4 KB sequences: the state gathered is all of it.
    assert checkpoint["lane_state_bytes"] >= 8 * (1 << 20)
    assert checkpoint["files"] == 1 and checkpoint["bytes_on_disk"] == checkpoint["written"] > 0
    assert last["owners_checkpoint"][0]["written_mb"] > 0
    assert checkpoint["checkpoint_seconds"] > 0 and checkpoint["save_seconds"] > 0
    assert checkpoint["coordinator_peak_rss"] > 0 and result["coordinator_at_rest"]["VmRSS"] > 0
    assert checkpoint["rank_peak_rss"] > 0 and result["owners_rss"] > 0
    # Rank 0 of 2 holds half the lanes in its state_dict.
    for parts in [c for c in result["checkpoints"] if c["way"] == "parts"]:  # where it exists
        assert parts["files"] >= 2 and parts["bytes_on_disk"] > 0
    loader = result["loader"]  # the embedded Loader's reference, every lane in one process
    assert loader["lane_state_bytes"] == checkpoint["lane_state_bytes"] and loader["written"] > 0
    (state_dict,) = result["state_dicts"]
    assert state_dict["lanes"] == 4 and state_dict["lane_state_bytes"] >= 4 * (1 << 20)
