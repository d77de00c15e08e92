"""Progress bars time the steady state: the first step (start-up) is reported apart."""

from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator

from zephon_flow.progress import Progress


def slow_start(n: int, first: float) -> Iterator[int]:
    time.sleep(first)
    yield from range(n)


def test_the_rate_leaves_out_the_first_step() -> None:
    out = io.StringIO()
    progress = Progress(total=20, desc="run", file=out, enabled=True, tokens_per_step=1000)
    assert list(progress(slow_start(20, first=0.6))) == list(range(20))
    assert progress.startup >= 0.6
    # Timed from the start, 20 steps in >= 0.6 s would be at most ~33 steps/s.
    assert progress.steps_per_second > 100
    final = out.getvalue().splitlines()[-1] if "\n" in out.getvalue() else out.getvalue().split("\r")[-1]
    rate = re.search(r"([\d.]+)step/s", final)
    assert rate is not None and float(rate.group(1)) > 100, final
    assert "20/20" in final and "tokens/s" in final


def test_no_bar_off_a_terminal_by_default() -> None:
    out = io.StringIO()
    progress = Progress(total=3, desc="run", file=out)
    assert list(progress(iter(range(3)))) == [0, 1, 2]
    assert out.getvalue() == ""
    assert progress.count == 3
