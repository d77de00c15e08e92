"""Contender: zephon-flow embedded in the trainer's process (``zf.Loader``), main venv.

Options: ``engine=hf|auto|tiktoken`` (``Tokenize``'s engine; ``hf`` is the peers' own
tokenizer, ``auto`` may take the verified tiktoken fast path) and ``backend=processes|threads|
inline`` (default ``processes``; ``workers`` comes from the task).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

from bench.contenders.harness import Batch, main
from bench.workload import TextWorkload


def make_spec(w: TextWorkload, engine: str, *, tokenize: Any = None, shuffle: bool = True) -> Any:
    """The text workload as a zephon-flow pipeline: ReadJsonl x3, Mix, Tokenize, Pack, Shuffle.

    ``tokenize`` replaces ``Tokenize`` with another DoFn (``bench.consumer_cost``'s stand-in);
    ``shuffle=False`` leaves ``Shuffle`` out."""
    import apache_beam as beam

    import zephon_flow as zf
    from zephon_flow import operators as ops

    names = sorted(w.sources)

    def text(p: beam.Pipeline) -> beam.PCollection:
        reads = tuple(p | f"read_{n}" >> ops.ReadJsonl(w.sources[n], field="text") for n in names)
        mixed = reads | "mix" >> ops.Mix(weights=[w.weights[n] for n in names])
        tok = tokenize if tokenize is not None else ops.Tokenize(w.tokenizer, append_eos=True, engine=engine)
        toks = mixed | "tok" >> beam.ParDo(tok)
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=w.seq_len))
        if not shuffle:
            return seqs
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=w.shuffle_per_lane))

    return zf.LoaderSpec(text, lanes=w.lanes, seed=w.seed, global_batch_size=w.global_batch)


class LoaderSession:
    """An open ``zf.Loader``: its batches (``step`` is the last one's), its state, its bytes."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self.step = -1

    def batches(self) -> Iterator[Batch]:
        for step, batch in self._loader:
            self.step = step
            yield batch

    def state(self) -> dict[str, Any]:
        """``state_dict()``: the loader's state after the last batch taken."""
        return dict(self._loader.state_dict())

    def checkpoint(self) -> bytes:
        import zephon_flow as zf

        return bytes(zf.encode_state(self._loader.state()))

    def close(self) -> None:
        self._loader.close()


class ZephonEmbedded:
    """zephon-flow as a contender; ``spec`` fixes the pipeline (default: ``make_spec`` of each
    workload opened). ``init_s`` and ``session`` are those of the last ``open``."""

    resumable = True

    def __init__(self, options: dict[str, str], spec: Any = None) -> None:
        self.engine = options.get("engine", "hf")
        self.backend = options.get("backend", "processes")
        self.name = f"zephon_{self.backend}_{self.engine}"
        self._fixed = spec
        self._specs: dict[str, Any] = {}
        self.init_s = 0.0
        self.session: LoaderSession | None = None

    def _spec(self, w: TextWorkload) -> Any:
        if self._fixed is not None:
            return self._fixed
        key = w.to_json()
        if key not in self._specs:
            self._specs[key] = make_spec(w, self.engine)
        return self._specs[key]

    def open(
        self, workload: TextWorkload, *, rank: int, world_size: int, workers: int, state: bytes | None
    ) -> LoaderSession:
        import zephon_flow as zf

        spec = self._spec(workload)
        start = time.perf_counter()
        loader = zf.Loader(
            spec, rank=rank, world_size=world_size, backend=self.backend, workers=workers, state=state
        )
        self.init_s = time.perf_counter() - start
        self.session = LoaderSession(loader)
        return self.session


if __name__ == "__main__":
    sys.exit(main(ZephonEmbedded))
