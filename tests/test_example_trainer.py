"""The example trainer, short: 2 ranks checkpoint at step 3 and are killed, 1 rank resumes on the same data."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from zephon_flow.demo_data import DemoData
from zephon_flow.engine.simulate import global_digests

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example_pipeline() -> ModuleType:
    spec = importlib.util.spec_from_file_location("zephon_example_pipeline", EXAMPLES / "pipeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trainer(out: Path, demo: DemoData, *args: str) -> list[str]:
    return [
        sys.executable,
        str(EXAMPLES / "train_tiny_gpt.py"),
        "--out",
        str(out),
        "--data-dir",
        demo.root,
        "--checkpoint-every",
        "3",
        *args,
    ]


def log_lines(out: Path) -> list[dict[str, Any]]:
    path = out / "log.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def run_until_step_then_kill(cmd: list[str], out: Path, step: int) -> None:
    """Starts the trainer in its own session and SIGKILLs all its processes once ``step`` is logged."""
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 500  # a hang guard, not a speed check
        while not any(line["step"] == step for line in log_lines(out)):
            if proc.poll() is not None:
                output = proc.stdout.read().decode() if proc.stdout else ""
                raise AssertionError(f"the trainer exited ({proc.returncode}) before step {step}:\n{output}")
            assert time.monotonic() < deadline, "the trainer did not reach the step"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout:
            proc.stdout.close()


@pytest.fixture(scope="module")
def killed_run(demo: DemoData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks checkpointed at step 3 only (5 is not a multiple of 3), killed once step 4 is
    logged: each test resumes a copy of it (the same killed run for every resume world size)."""
    out = tmp_path_factory.mktemp("killed") / "run"
    run_until_step_then_kill(trainer(out, demo, "--world-size", "2", "--steps", "5"), out, 4)
    return out


@pytest.mark.parametrize(
    "resume_world", [1, pytest.param(4, marks=pytest.mark.slow)], ids=lambda w: f"resume-on-{w}"
)
def test_killed_run_resumes_on_another_world_size_with_the_same_batches(
    demo: DemoData, killed_run: Path, tmp_path: Path, resume_world: int
) -> None:
    out = tmp_path / "run"
    shutil.copytree(killed_run, out, symlinks=True)
    killed = log_lines(out)
    assert (out / "latest").read_text().strip() == "step-000003"

    done = subprocess.run(
        trainer(out, demo, "--world-size", str(resume_world), "--steps", "6", "--resume", str(out)),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"at step 3 with world size {resume_world}" in done.stdout
    resumed = log_lines(out)[len(killed) :]

    reference = global_digests(example_pipeline().example_spec(demo.root), steps=6)
    assert [(line["step"], line["digest"]) for line in killed] == reference[:5]
    assert [(line["step"], line["digest"]) for line in resumed] == reference[3:]
    assert {line["world_size"] for line in killed} == {2}
    assert {line["world_size"] for line in resumed} == {resume_world}
    # Same weights, same optimizer state, same tokens: the loss continues where it was,
    # up to float rounding (the global batch is split differently across ranks).
    before = {line["step"]: line["loss"] for line in killed}
    for line in resumed:
        assert math.isfinite(line["loss"])
        if line["step"] in before:
            assert line["loss"] == pytest.approx(before[line["step"]], rel=1e-4)
    assert killed[0]["loss"] > resumed[-1]["loss"]  # it is learning
