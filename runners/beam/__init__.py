"""The translation of a compiled plan into a self-ordering Beam pipeline for Beam's own runners."""

from zephon_flow.runners.beam.translate import (
    Translation,
    check_orderable,
    order_lanes,
    read_sources,
    translate,
)

__all__ = ["Translation", "check_orderable", "order_lanes", "read_sources", "translate"]
