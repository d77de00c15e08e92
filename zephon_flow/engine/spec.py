"""``LoaderSpec``: a Beam pipeline plus lanes, seed and batch size, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from zephon_flow.core.errors import SpecError
from zephon_flow.core.lanes import check_batch_geometry
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


@dataclass(frozen=True)
class LoaderSpec:
    """The identity of a data stream: ``build(p)`` returns the PCollection of samples.

    The global batch sequence is a pure function of this spec and the data files. ``lanes``
    is fixed for the life of a run (choose at least the largest world size you expect);
    ``global_batch_size`` must be a multiple of ``lanes``.
    """

    build: Callable[[beam.Pipeline], beam.PCollection]
    lanes: int = 16
    seed: int = 0
    global_batch_size: int = 256
    _compiled: list[_Compiled] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not callable(self.build):
            raise SpecError(f"build must be a callable taking a beam.Pipeline, got {self.build!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise SpecError(f"seed must be a non-negative integer, got {self.seed!r}")
        check_batch_geometry(lanes=self.lanes, global_batch_size=self.global_batch_size)

    @property
    def per_lane(self) -> int:
        return self.global_batch_size // self.lanes

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
            "global_batch_size": _digest(self.global_batch_size),
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
