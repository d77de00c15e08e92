"""``LoaderSpec``: a Beam pipeline plus lanes, seed and batch size, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from zephon_flow.core.errors import SpecError
from zephon_flow.core.lanes import check_batch_geometry
from zephon_flow.core.schedule import BatchSchedule, Ramp, as_schedule
from zephon_flow.runners.dealing import DEALING_VERSION
from zephon_flow.runners.deterministic import DeterministicRunner
from zephon_flow.runners.plan import Plan


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True, kw_only=True)
class _Compiled:
    plan: Plan
    fingerprint: dict[str, str]


@dataclass(frozen=True, init=False, repr=False)
class LoaderSpec:
    """The identity of a data stream: ``build(p)`` returns the PCollection of samples.

    The global batch sequence is a pure function of this spec and the data files. ``lanes``
    is fixed for the life of a run (choose at least the largest world size you expect);
    ``global_batch_size`` is an int, or a schedule (``zf.Ramp``, ``zf.BatchSchedule``: the size
    of each step) whose every size is a multiple of ``lanes``. Lane ``l``'s window ``b`` is
    then its outputs ``[rows_before(b)/L, rows_before(b+1)/L)`` (see ``docs/batch-schedule.md``).
    """

    build: Callable[[beam.Pipeline], beam.PCollection]
    lanes: int
    seed: int
    #: ``global_batch_size`` as a schedule (an int is the constant one).
    batch_schedule: BatchSchedule
    _compiled: list[_Compiled] = field(compare=False)

    def __init__(
        self,
        build: Callable[[beam.Pipeline], beam.PCollection],
        lanes: int = 16,
        seed: int = 0,
        global_batch_size: int | BatchSchedule | Ramp | Mapping[int, int | Ramp] = 256,
    ) -> None:
        if not callable(build):
            raise SpecError(f"build must be a callable taking a beam.Pipeline, got {build!r}")
        if not isinstance(seed, int) or seed < 0:
            raise SpecError(f"seed must be a non-negative integer, got {seed!r}")
        if isinstance(global_batch_size, int) and not isinstance(global_batch_size, bool):
            check_batch_geometry(lanes=lanes, global_batch_size=global_batch_size)
        elif not isinstance(lanes, int) or lanes < 1:
            raise SpecError(f"lanes must be a positive integer, got {lanes!r}")
        schedule = as_schedule(global_batch_size)
        schedule.check_lanes(lanes)
        for name, value in (("build", build), ("lanes", lanes), ("seed", seed), ("batch_schedule", schedule)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_compiled", [])

    def __repr__(self) -> str:
        size = self.batch_schedule.constant
        return (
            f"LoaderSpec(build={self.build!r}, lanes={self.lanes}, seed={self.seed}, "
            f"global_batch_size={self.batch_schedule if size is None else size!r})"
        )

    @property
    def global_batch_size(self) -> int:
        """The global batch size of every step; refused for a schedule (``batch_size(step)``)."""
        return self.fixed_batch_size("this way of running the pipeline")

    @property
    def per_lane(self) -> int:
        """Each lane's samples in every global batch; refused for a schedule (``per_lane_at``)."""
        return self.global_batch_size // self.lanes

    def batch_size(self, step: int) -> int:
        """The number of rows of global batch ``step``."""
        return self.batch_schedule.size(step)

    def per_lane_at(self, step: int) -> int:
        """Each lane's samples in global batch ``step`` (its window ``step``'s length)."""
        return self.batch_schedule.size(step) // self.lanes

    def fixed_batch_size(self, what: str) -> int:
        """The global batch size, for ``what`` (named in the refusal), which needs one fixed
        size: a spec with a batch size schedule is refused."""
        size = self.batch_schedule.constant
        if size is None:
            raise SpecError(
                f"{what} takes one fixed global batch size, but this spec's global_batch_size is a "
                f"schedule ({self.batch_schedule!r}); schedules run on zf.Loader, "
                f"zephon_flow.torch.ZephonDataset, zephon serve with zf.Client and the Beam "
                f"translation (zephon materialize), not yet on lane owners (zephon_flow.cluster, "
                f"zephon serve --ray) or the trainer integrations (ZephonTrainer, torchtitan): use "
                f"one of the former, or an int global_batch_size"
            )
        return size

    def compile(self) -> Plan:
        """The plan, built and checked once per spec and shared by its loaders.

        A plan holds definitions only (DoFns, sources and their split tables); every loader
        keeps its own runtime state. Sharing it also keeps the split tables and the
        fingerprint from one and the same look at the data files.
        """
        return self._compiled_once().plan

    @property
    def fingerprint(self) -> dict[str, str]:
        """Digests of the parts that define the stream; ``total`` covers them all."""
        return self._compiled_once().fingerprint

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its plan and fingerprint, compiled first if nobody asked yet: a process
        that unpickles it (a Ray actor, a lane owner, a worker) uses its creator's. Recomputed
        there they could differ for the same code: a module Ray or Beam ships by value is in
        no ``sys.modules`` of the worker and has no source file there (``__main__`` is another
        module), so the code parts would not be the creator's, and a checkpoint would be
        refused (or another pipeline's accepted)."""
        self._compiled_once()
        return dict(self.__dict__)

    def _compiled_once(self) -> _Compiled:
        if not self._compiled:
            self._compiled.append(self._compile())
        return self._compiled[0]

    def _compile(self) -> _Compiled:
        runner = DeterministicRunner(seed=self.seed)
        pipeline = beam.Pipeline(runner=runner, options=PipelineOptions([]))
        try:
            output = self.build(pipeline)
            if not isinstance(output, beam.PCollection):
                raise SpecError(f"build(p) must return a beam.PCollection, got {type(output).__name__}")
            plan = runner.compile(pipeline, output)
        finally:  # Beam makes it for run(), which removes it; this pipeline is never run
            shutil.rmtree(pipeline.local_tempdir, ignore_errors=True)
        parts = {
            "graph": _digest(plan.graph),
            "lanes": _digest(self.lanes),
            "seed": _digest(self.seed),
            "global_batch_size": _digest(self.batch_schedule.to_plain()),
        }
        for label, params in plan.params:
            if isinstance(params, dict) and "code" in params:
                params = dict(params)
                parts[f"code {label}"] = _digest(params.pop("code"))
                for what, digest in sorted(params.pop("reaches", {}).items()):
                    parts[f"code {label} :: {what}"] = digest  # a helper the DoFn's code reaches
            parts[f"operator {label}"] = _digest(params)
        for sp in plan.sources:
            parts[f"data {sp.label}"] = _digest(sp.source.data_identity(self.lanes, DEALING_VERSION))
        parts["total"] = _digest(sorted(parts.items()))
        return _Compiled(plan=plan, fingerprint=parts)
