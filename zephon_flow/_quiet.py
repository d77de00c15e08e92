"""Silences the one Beam log line that does not apply to zephon-flow (key coders of stateful DoFns).

Only Beam's own ``apache_beam.transforms.core`` logger gets a filter: ``import zephon_flow``
never touches the root logger or its handlers (logging is the application's, and the
``zephon`` command's, to configure). Beam's "apitools not found" warning, logged on the root
logger by ``apache_beam.io.gcp.internal.clients.bigquery`` whenever ``google-apitools`` is not
installed, is prevented at its source: zephon-flow depends on ``google-apitools`` (the version
Beam's own ``gcp`` extra pins), so that import succeeds, whichever package is imported first.
"""

from __future__ import annotations

import logging

_BEAM_CORE = "apache_beam.transforms.core"


class _DropKeyCoderNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # The runner keys state by lane id (an int) and never encodes keys with a coder.
        return "with stateful DoFn may not be deterministic" not in record.getMessage()


def quiet_beam_import_warnings() -> None:
    """Installs the filter on Beam's ``transforms.core`` logger (idempotent)."""
    logger = logging.getLogger(_BEAM_CORE)
    if not any(isinstance(f, _DropKeyCoderNotice) for f in logger.filters):
        logger.addFilter(_DropKeyCoderNotice())
