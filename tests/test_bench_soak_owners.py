"""Smoke test of bench/soak.py's served-owners mode (``--owners N``) at a tiny length: a ``zephon
serve --ray --lane-owners 2`` under owner SIGKILLs, a coordinator SIGKILL and a client reconnect
gives every rank the embedded run's digests and leaves no process behind. Never timings.

The server SIGKILL + ``--resume`` is left out here (``--no-server-restart``): it needs a second
Ray start (about half a minute on this machine), and the ranks' clients do not survive it (see
bench/README.md, soak section)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_served_owners_soak_keeps_every_digest_under_owner_and_coordinator_kills(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.soak",
        "--owners",
        "2",
        "--minutes",
        "0.25",
        "--kill-every",
        "5",
        "--sample-every",
        "1",
        "--checkpoint-steps",
        "20",
        "--no-server-restart",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["digests_mismatched"] == 0
    assert report["digests_compared"] >= 2 * report["steps_served_per_rank"] > 0
    assert report["reference_matches_zephon_digest"] is True
    assert report["owner_kills"] >= 1
    assert any("SIGKILL coordinator" in event for event in report["events"])
    assert any("client rank 1 killed" in event for event in report["events"])
    assert report["server_exits"] == [] and report["client_exits"] == []
    assert report["processes_left_after_stop"] == 0
    assert report["tree_fds_range"][0] > 0 and report["tree_threads_range"][0] > 0
