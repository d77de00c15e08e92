"""Contender: zephon-flow embedded in the trainer's process (``zf.Loader``), main venv.

Options: ``engine=hf|auto|tiktoken`` (``Tokenize``'s engine; ``hf`` is the peers' own
tokenizer, ``auto`` may take the verified tiktoken fast path) and ``backend=processes|threads|
inline`` (default ``processes``; ``workers`` comes from the task).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from bench.contenders.harness import Batch, main
from bench.workload import TextWorkload


def make_spec(w: TextWorkload, engine: str) -> Any:
    """The text workload as a zephon-flow pipeline: ReadJsonl x3, Mix, Tokenize, Pack, Shuffle."""
    import apache_beam as beam

    import zephon_flow as zf
    from zephon_flow import operators as ops

    names = sorted(w.sources)

    def text(p: beam.Pipeline) -> beam.PCollection:
        reads = tuple(p | f"read_{n}" >> ops.ReadJsonl(w.sources[n], field="text") for n in names)
        mixed = reads | "mix" >> ops.Mix(weights=[w.weights[n] for n in names])
        toks = mixed | "tok" >> beam.ParDo(ops.Tokenize(w.tokenizer, append_eos=True, engine=engine))
        seqs = toks | "pack" >> beam.ParDo(ops.Pack(seq_len=w.seq_len))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=w.shuffle_per_lane))

    return zf.LoaderSpec(text, lanes=w.lanes, seed=w.seed, global_batch_size=w.global_batch)


class _Session:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def batches(self) -> Iterator[Batch]:
        for _step, batch in self._loader:
            yield batch

    def checkpoint(self) -> bytes:
        import zephon_flow as zf

        return bytes(zf.encode_state(self._loader.state_dict()))

    def close(self) -> None:
        self._loader.close()


class ZephonEmbedded:
    resumable = True

    def __init__(self, options: dict[str, str]) -> None:
        self.engine = options.get("engine", "hf")
        self.backend = options.get("backend", "processes")
        self.name = f"zephon_{self.backend}_{self.engine}"
        self._specs: dict[str, Any] = {}

    def _spec(self, w: TextWorkload) -> Any:
        key = w.to_json()
        if key not in self._specs:
            self._specs[key] = make_spec(w, self.engine)
        return self._specs[key]

    def open(
        self, workload: TextWorkload, *, rank: int, world_size: int, workers: int, state: bytes | None
    ) -> _Session:
        import zephon_flow as zf

        loader = zf.Loader(
            self._spec(workload),
            rank=rank,
            world_size=world_size,
            backend=self.backend,
            workers=workers,
            state=state,
        )
        return _Session(loader)


if __name__ == "__main__":
    sys.exit(main(ZephonEmbedded))
