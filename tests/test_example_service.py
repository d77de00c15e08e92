"""The example trainer in service mode against a real ``zephon serve`` (default ``--keep``): 2 ranks
checkpoint at step 3, trainer and server are killed, the server resumes from the checkpoint the
trainer recorded and 1 rank continues on the same global batches."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from service_helpers import ServerProcess
from test_example_trainer import EXAMPLES, example_pipeline, log_lines, run_until_step_then_kill, trainer

from zephon_flow.demo_data import DemoData
from zephon_flow.engine.simulate import global_digests

# About 90 s on the shared 2-core machine (two trainer launches, torch start-up): slow.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_served_run_killed_and_resumed_on_one_rank_with_the_same_batches(
    demo: DemoData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZEPHON_EXAMPLE_DIR", demo.root)  # the server's examples/pipeline.py:spec
    target, served = f"{EXAMPLES / 'pipeline.py'}:spec", str(tmp_path / "srv")
    out = tmp_path / "run"
    server = ServerProcess(target, "--checkpoint-dir", served, log=tmp_path / "server.log")
    try:
        service = ("--data", "service", "--address", server.address)
        run_until_step_then_kill(trainer(out, demo, *service, "--world-size", "2", "--steps", "5"), out, 4)
    finally:
        server.kill(signal.SIGKILL)
    killed = log_lines(out)
    assert (out / "latest").read_text().strip() == "step-000003"
    meta = json.loads((out / "step-000003" / "zephon.json").read_text())
    assert meta["server_checkpoint"] == str(Path(served, "step-3.zfstate"))

    server = ServerProcess(
        target,
        "--checkpoint-dir",
        served,
        "--resume",
        meta["server_checkpoint"],
        log=tmp_path / "server2.log",
    )
    try:
        service = ("--data", "service", "--address", server.address)
        done = subprocess.run(
            trainer(out, demo, *service, "--world-size", "1", "--steps", "6", "--resume", str(out)),
            capture_output=True,
            text=True,
            timeout=500,
        )
    finally:
        server.kill()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warning" not in done.stdout
    assert "at step 3 with world size 1" in done.stdout
    resumed = log_lines(out)[len(killed) :]
    reference = global_digests(example_pipeline().example_spec(demo.root), steps=6)
    assert [(line["step"], line["digest"]) for line in killed] == reference[:5]
    assert [(line["step"], line["digest"]) for line in resumed] == reference[3:]
    assert {line["world_size"] for line in resumed} == {1}
