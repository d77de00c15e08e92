"""``import zephon_flow`` leaves logging alone, and importing Beam first prints no apitools notice."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import logging
import apache_beam
import zephon_flow
root = logging.getLogger()
print(len(root.filters), len(root.handlers), logging.getLevelName(root.level))
"""


def test_beam_then_zephon_is_silent_and_the_root_logger_untouched() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stderr == ""
    assert out.stdout == "0 0 WARNING\n"
