"""The translation of a compiled plan into a self-ordering Beam pipeline for Beam's own runners."""

from zephon_flow.runners.beam.translate import (
    Translation,
    draws_at_step,
    order_lanes,
    read_sources,
    translate,
)

__all__ = ["Translation", "draws_at_step", "order_lanes", "read_sources", "translate"]
