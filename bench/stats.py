"""What every benchmark report is made of: medians, ratios, validity flags, number formats, the machine.

Standard library only: the contenders' processes import it too, in the peers' venv as well.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: A rate above the limit by more than this is not a measurement of steady throughput.
NOISE = 0.10
#: First half of a timed window faster than its second by more than this: a buffer was draining.
UNSTEADY = 1.25

ROOT = Path(__file__).resolve().parent.parent


def median(values: Iterable[float]) -> float:
    """The median, as a float; an empty input is refused (``statistics.StatisticsError``)."""
    return float(statistics.median(values))


def median_or_none(values: Sequence[float]) -> float | None:
    """The median, or None when there is nothing to take it of (every run failed)."""
    return median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def fmt(x: Any, spec: str = ",.0f") -> str:
    """``x`` formatted with ``spec``; ``n/a`` for a missing number."""
    return "n/a" if x is None else format(x, spec)


def table(runs: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """One row per contender (a run's ``name``): how many runs, why the failed ones failed, the
    median peak memory of its process tree and the median of each of ``keys`` over its good
    runs (those that have it)."""
    by_name: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for run in runs:
        by_name[run["name"]].append(run)
    rows: dict[str, dict[str, Any]] = {}
    for name, items in by_name.items():
        good = [r for r in items if r["ok"]]
        rows[name] = {
            "runs": len(items),
            "failed": [r.get("error", "")[:300] for r in items if not r["ok"]],
            "peak_rss_mb": median_or_none([r["peak_rss_bytes"] / 1e6 for r in good]),
            **{key: median_or_none([r[key] for r in good if r.get(key) is not None]) for key in keys},
        }
    return rows


def paired_over_limit(runs: Sequence[Mapping[str, Any]], key: str) -> dict[str, float | None]:
    """Per contender: the median over rounds of its ``key`` over the limit's in the same round."""
    rounds: dict[int, dict[str, float]] = defaultdict(dict)
    for run in runs:
        if run["ok"]:
            rounds[run["round"]][run["name"]] = run[key]
    names = {run["name"] for run in runs}
    return {
        name: median_or_none([r[name] / r["limit"] for r in rounds.values() if name in r and r.get("limit")])
        for name in names
    }


def rotated(names: Sequence[str], round_: int) -> list[str]:
    """The order of the contenders in round ``round_``: rotated by one each round, so that a
    noisy neighbour hurts all of them alike."""
    k = round_ % len(names) if names else 0
    return [*names[k:], *names[:k]]


def rate_flags(row: Mapping[str, Any], limits: Mapping[str, float | None]) -> list[str]:
    """Why a contender's rates are not valid steady-state throughput (empty when they look valid).

    ``limits`` maps each rate of ``row`` to check to the limit's rate it must not beat by more
    than ``NOISE`` (empty for the limit itself, or for a contender that may beat it legitimately);
    a timed window whose first half ran faster than its second by more than ``UNSTEADY`` was
    draining a buffer.
    """
    flags = []
    for key, base in limits.items():
        rate = row.get(key)
        if base and rate and rate > base * (1 + NOISE):
            flags.append(f"{key} {rate / base:.2f}x the limit (> {1 + NOISE:.2f}x): read-ahead or a bug")
    half = row.get("half_rate_ratio")
    if half and half > UNSTEADY:
        flags.append(
            f"timed window not steady: its first half {half:.2f}x faster than its second (buffer draining)"
        )
    return flags


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict[str, Any]:
    """Where a benchmark ran: CPUs (count, affinity, model), platform, Python, load, git commit."""
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "loadavg": loadavg(),
        "git": git_revision(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def git_revision() -> dict[str, Any] | None:
    """The repository's commit and whether tracked files differ from it (None outside git)."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
        )
        return done.stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "dirty": bool(dirty)}
