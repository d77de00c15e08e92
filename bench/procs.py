"""One contender process: run it, watch its process tree's memory, stop it by PID on timeout."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT_TAG = "BENCH-RESULT "


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


def kill_tree(pid: int) -> None:
    """Kills a contender process and its children (worker processes, a server), by their PIDs."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


@dataclass(frozen=True)
class Finished:
    """What a contender process left: its last result line (if any), stderr, and how it ran."""

    result: dict[str, Any] | None
    stderr: str
    wall_s: float
    peak_rss_bytes: int
    timed_out: bool


def run_contender(cmd: list[str], timeout: float, root: Path = ROOT) -> Finished:
    """Runs ``cmd`` from ``root`` (the repository's, or a baseline's unpacked package: see
    ``bench.speed``), first on the path; its whole tree is killed after ``timeout`` s."""
    env = {**os.environ, "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=err, text=True)
        peak = 0
        timed_out = False
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            if time.perf_counter() - start > timeout and not timed_out:
                timed_out = True
                kill_tree(proc.pid)
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_TAG)]
    result = json.loads(lines[-1][len(RESULT_TAG) :]) if lines else None
    return Finished(result, stderr, time.perf_counter() - start, peak, timed_out)


def run_task(
    name: str, cmd: list[str], timeout: float, *, label: str, root: Path = ROOT, **fallback: Any
) -> dict[str, Any]:
    """Runs one contender's task: its JSON result (or, when it printed none, ``fallback`` with
    ``ok`` false and the end of its stderr), marked when it was cut at ``timeout``, plus its name,
    wall time and the peak resident memory of its tree; one progress line to stderr."""
    done = run_contender(cmd, timeout, root)
    if done.result is not None:
        result = done.result
    else:
        result = {**fallback, "ok": False, "error": done.stderr.strip()[-1500:]}
    if done.timed_out:
        # what it printed before the timeout (a partial result) is kept, and says it was cut short
        result.update(timed_out=True, timeout_s=timeout)
        if done.result is None:
            result["error"] = f"timed out after {timeout:.0f} s; " + result["error"][-1000:]
    result.update(name=name, wall_s=done.wall_s, peak_rss_bytes=done.peak_rss_bytes)
    status = "ok" if result["ok"] else f"FAILED {result.get('error', '')[:300]}"
    print(f"bench.run: {label}: {status}", file=sys.stderr, flush=True)
    return result
