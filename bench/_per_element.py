"""``Tokenize`` with its batched path hidden, for before/after measurements of the batched path."""

from __future__ import annotations

import apache_beam as beam

from zephon_flow import operators as ops


class PerElementTokenize(ops.Tokenize):
    """The runner sees no ``process_batch`` and calls ``process`` once per document (same ids,
    same fingerprint: the parameters are Tokenize's)."""

    process_batch = beam.DoFn.process_batch
