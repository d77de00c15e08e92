"""Silences Beam log lines that do not apply to zephon-flow (cloud extras, key coders)."""

from __future__ import annotations

import logging


class _DropApitoolsNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        # The runner keys state by lane id (an int) and never encodes keys with a coder.
        return (
            "apitools not found" not in message
            and "with stateful DoFn may not be deterministic" not in message
        )


def quiet_beam_import_warnings() -> None:
    """Installs the filter on the root logger's handlers-to-be (idempotent)."""
    for name in ("", "apache_beam.transforms.core"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropApitoolsNotice) for f in logger.filters):
            logger.addFilter(_DropApitoolsNotice())
