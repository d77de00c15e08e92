"""``zephon materialize``: a pipeline's exact global-batch sequence, run through Beam, as Parquet.

The spec's plan is translated (``runners/beam``, each lane reading only what its windows of
steps ``< steps`` need) and run on a Beam runner; each global batch ``step < steps`` is written
to ``OUT/step-<step>.parquet``: one row per batch row, columns ``step``, ``row`` and one per
field of the batch (a sample's array, flattened, with its dtype and shape in the file's
metadata; a ragged field such as ``documents`` as a list per row). The
batches read back (``read_materialized``) are the embedded ``Loader``'s, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner

from zephon_flow.core.batches import RAGGED_FIELDS, Batch
from zephon_flow.core.errors import DataError, SpecError, StageError
from zephon_flow.core.files import atomic_write
from zephon_flow.core.schedule import WindowLengths
from zephon_flow.engine.spec import LoaderSpec
from zephon_flow.runners.beam import Translation, translate

#: The Parquet key-value metadata entry describing the fields.
META_KEY = b"zephon.fields"
_FILE = re.compile(r"^step-(\d{8})\.parquet$")


def step_file(out: str, step: int) -> str:
    return os.path.join(out, f"step-{step:08d}.parquet")


# -- batches <-> Parquet -----------------------------------------------------------------


def batch_table(step: int, batch: Batch) -> pa.Table:
    """One global batch as a table: ``step``, ``row``, then one column per field (sorted)."""
    rows = next(
        len(a) for k, a in sorted(batch.items()) if not (k in RAGGED_FIELDS and k + "_count" in batch)
    )
    columns: dict[str, pa.Array] = {
        "step": pa.array(np.full(rows, step, dtype=np.int64)),
        "row": pa.array(np.arange(rows, dtype=np.int32)),
    }
    meta: dict[str, dict[str, Any]] = {}
    for name in sorted(batch):
        if name in ("step", "row"):
            raise StageError(
                f"global batch {step}: a field is named {name!r}, a column materialize adds; rename it"
            )
        arr = np.ascontiguousarray(batch[name])
        if arr.dtype.hasobject:
            raise StageError(
                f"global batch {step}: field {name!r} holds Python objects, which Parquet cannot keep exactly"
            )
        ragged = name in RAGGED_FIELDS and name + "_count" in batch
        shape = list(arr.shape[1:])
        meta[name] = {"dtype": arr.dtype.str, "shape": shape, "ragged": ragged}
        values = pa.array(arr.reshape(-1))
        if ragged:
            counts = np.asarray(batch[name + "_count"], dtype=np.int64) * max(1, int(np.prod(shape)))
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            columns[name] = pa.ListArray.from_arrays(pa.array(offsets), values)
        elif shape:
            columns[name] = pa.FixedSizeListArray.from_arrays(values, int(np.prod(shape)))
        else:
            columns[name] = values
    table = pa.table(columns)
    return table.replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True).encode()})


def table_batch(table: pa.Table, *, where: str) -> Batch:
    """The batch ``batch_table`` wrote (fields in their dtypes and shapes)."""
    raw = (table.schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise DataError(f"{where}: no {META_KEY.decode()!r} metadata; not written by zephon materialize")
    batch: Batch = {}
    for name, info in json.loads(raw).items():
        column = table.column(name).combine_chunks()
        dtype, shape = np.dtype(info["dtype"]), tuple(info["shape"])
        if info["ragged"] or shape:
            flat = column.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
            batch[name] = flat.reshape((-1, *shape) if info["ragged"] else (len(table), *shape))
        else:
            batch[name] = column.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return batch


def read_materialized(out: str) -> list[tuple[int, Batch]]:
    """``(step, global batch)`` of every step file in ``out``, in step order."""
    steps = sorted(int(m.group(1)) for f in os.listdir(out) for m in [_FILE.match(f)] if m)
    return [(s, table_batch(pq.read_table(step_file(out, s)), where=step_file(out, s))) for s in steps]


class WriteSteps(beam.DoFn):  # type: ignore[misc]
    """``(step, batch) ->`` ``OUT/step-<step>.parquet`` (atomically) for ``step < steps``."""

    def __init__(self, out: str, steps: int) -> None:
        super().__init__()
        self._out, self._steps = out, steps

    def process(self, element: tuple[int, Batch]) -> Iterator[int]:
        step, batch = element
        if step < self._steps:
            table = batch_table(step, batch)
            atomic_write(step_file(self._out, step), lambda f: pq.write_table(table, f))
            yield step


# -- running -----------------------------------------------------------------------------


class GlobalBatches(beam.PTransform):  # type: ignore[misc]
    """``p | GlobalBatches(spec)``: the spec's ``(step, global batch)`` pairs, translated to
    Beam (``runners/beam``), to feed a sink of your own on any Beam runner. ``passes``: how
    many passes of each endless source to read (the steps they fill completely are made).
    ``steps``: make only global batches ``0 .. steps-1``, each lane reading no further than
    they need (its read, front, mix and back then run in one call per lane); None makes every
    step of the passes read, the stateless front spread over the workers chunk by chunk."""

    def __init__(
        self, spec: LoaderSpec, *, passes: int = 1, chunk_records: int = 64, steps: int | None = None
    ) -> None:
        super().__init__()
        if not isinstance(passes, int) or passes < 1:
            raise SpecError(f"GlobalBatches: passes must be a positive integer, got {passes!r}")
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise SpecError(f"GlobalBatches: steps must be a positive integer or None, got {steps!r}")
        self._spec = spec
        self._how = Translation(
            lanes=spec.lanes,
            seed=spec.seed,
            # Under a batch size schedule the windows' length by step.
            per_lane=spec.per_lane
            if spec.batch_schedule.constant is not None
            else WindowLengths(spec.batch_schedule, spec.lanes),
            passes=passes,
            chunk_records=chunk_records,
            steps=steps,
        )

    def expand(self, pbegin: Any) -> Any:
        return translate(self._spec.compile(), pbegin.pipeline, self._how)


@dataclass(frozen=True)
class Materialized:
    """What a run wrote: ``steps`` files ``0 .. steps-1``; ``ended`` when the finite stream had
    fewer steps than were asked for."""

    out: str
    steps: int
    ended: bool


def beam_runner(name: str) -> Any:
    """The runner ``name`` names: ``FnApiRunner`` (Beam's local portable runner, in this
    process), else any runner Beam knows by name (``DirectRunner``, ``PrismRunner``,
    ``FlinkRunner``, ``SparkRunner``, ``DataflowRunner``)."""
    return FnApiRunner() if name == "FnApiRunner" else name


def materialize(
    spec: LoaderSpec,
    *,
    steps: int,
    out: str,
    runner: str = "FnApiRunner",
    beam_args: Sequence[str] = (),
    passes: int = 1,
    chunk_records: int = 64,
) -> Materialized:
    """Runs ``spec`` through Beam and writes global batches ``0 .. steps-1`` to ``out``;
    each lane reads and computes only what its windows of those steps need.

    ``passes`` is how many passes of each endless source (``epochs=None``) are read; a finite
    pipeline ends where the ``Loader`` ends. ``beam_args`` are Beam pipeline options
    (``--direct_num_workers=2``, ``--project=...``).
    """
    if not isinstance(steps, int) or steps < 1:
        raise SpecError(f"materialize: steps must be a positive integer, got {steps!r}")
    batches = GlobalBatches(spec, passes=passes, chunk_records=chunk_records, steps=steps)  # checks passes
    os.makedirs(out, exist_ok=True)
    stale = sorted(f for f in os.listdir(out) if _FILE.match(f))
    if stale:
        raise SpecError(
            f"materialize: {out} already holds step files ({stale[0]}, ...); give an empty --out "
            f"folder or remove them"
        )
    with beam.Pipeline(runner=beam_runner(runner), options=PipelineOptions(list(beam_args))) as p:
        _ = p | "zephon" >> batches | "write" >> beam.ParDo(WriteSteps(out, steps))
    written = sorted(int(m.group(1)) for f in os.listdir(out) for m in [_FILE.match(f)] if m)
    if written != list(range(len(written))):
        raise StageError(
            f"materialize: {out} holds steps {written}, not a run from 0; the run failed part way"
        )
    if len(written) < steps and not spec.compile().finite:
        raise DataError(
            f"materialize: {passes} pass(es) of the endless sources fill only {len(written)} of "
            f"the {steps} steps asked for; read more (--passes {_more_passes(passes, len(written), steps)})"
        )
    return Materialized(out, len(written), ended=len(written) < steps)


def _more_passes(passes: int, got: int, wanted: int) -> int:
    return passes + 1 if got == 0 else max(passes + 1, -(-passes * wanted // got) + 1)
