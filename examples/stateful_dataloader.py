"""``ZephonDataset`` under torchdata's ``StatefulDataLoader``: where the data state sits, and a resume.

    python examples/stateful_dataloader.py

``StatefulDataLoader.state_dict()`` stores the dataset's own ``state_dict()`` under the key
``"dataset_state"`` (with ``num_workers=0``, the only setting ZephonDataset accepts); that
entry is ``{"step", "lane_states"}``, positioned after the last batch yielded (nothing is
encoded until the dict is pickled, so taking it at every batch costs nothing). Loading the whole
dict into a new StatefulDataLoader over a new ZephonDataset continues at that step.
Self-contained: a small JSONL file written here, bytes as token ids (no tokenizer).
"""

from __future__ import annotations

import json
import tempfile

import apache_beam as beam
import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import zephon_flow as zf
from zephon_flow import operators as ops
from zephon_flow.torch import ZephonDataset


def byte_ids(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def make_spec(folder: str) -> zf.LoaderSpec:
    path = f"{folder}/docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"document {i}: " + "lorem ipsum " * (i % 23)}) + "\n")

    def build(p: beam.Pipeline) -> beam.PCollection:
        docs = p | "docs" >> ops.ReadJsonl(path)
        ids = docs | "bytes" >> beam.ParDo(ops.Map(byte_ids))
        seqs = ids | "pack" >> beam.ParDo(ops.Pack(seq_len=64))
        return seqs | "shuffle" >> beam.ParDo(ops.Shuffle(buffer=8))

    return zf.LoaderSpec(build, lanes=2, seed=7, global_batch_size=4)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        spec = make_spec(folder)
        loader = StatefulDataLoader(ZephonDataset.from_loader(spec), batch_size=None, num_workers=0)
        batches = iter(loader)
        for _ in range(3):  # steps 0, 1, 2
            next(batches)
        state = loader.state_dict()
        print("StatefulDataLoader state keys:", sorted(state))
        print("dataset_state:", sorted(state["dataset_state"]), "step", state["dataset_state"]["step"])
        expected = [next(batches) for _ in range(2)]

        resumed = StatefulDataLoader(ZephonDataset.from_loader(spec), batch_size=None, num_workers=0)
        resumed.load_state_dict(state)
        again = [item for item, _ in zip(resumed, range(2), strict=False)]
        assert [s for s, _ in again] == [s for s, _ in expected] == [3, 4]
        for (_, want), (_, got) in zip(expected, again, strict=True):
            assert all(torch.equal(want[k], got[k]) for k in want)
        print("resumed at step 3 with the same batches")


if __name__ == "__main__":
    main()
