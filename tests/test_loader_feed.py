"""``Loader.feed``: the loader makes its batches straight into a sink (``zephon serve`` holds
them this way, with no queue between the lanes and its held steps): the same batches and
states as iterating, the end and failures handed to the sink, and a loader fed or iterated
once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from helpers import Corpus, DocKey, chain_spec, example_spec, write_jsonl

import zephon_flow as zf
from zephon_flow.core.batches import Batch
from zephon_flow.core.checkpoint.state import LoaderState
from zephon_flow.core.errors import ZephonError
from zephon_flow.engine.simulate import global_digests


class ListSink:
    """Takes batches until ``stop_at`` (then ``room`` says stop), recording what it is told."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.batches: list[tuple[int, str, LoaderState]] = []
        self.ended: list[BaseException | None] = []

    def room(self, step: int) -> bool:
        return self.stop_at is None or step < self.stop_at

    def add(self, step: int, batch: Batch, after: LoaderState) -> None:
        self.batches.append((step, zf.batch_digest(batch), after))

    def end(self, error: BaseException | None) -> None:
        self.ended.append(error)


def test_a_fed_loader_makes_the_batches_and_states_of_an_iterated_one(corpus: Corpus) -> None:
    spec = example_spec(corpus, lanes=4, global_batch_size=8)
    sink = ListSink(stop_at=6)
    with zf.Loader(spec, backend="threads", workers=2) as loader:
        loader.feed(sink)
        assert loader.state().step == 6  # the loader's state follows the batches fed
        with pytest.raises(ZephonError, match=r"this Loader is fed"):
            iter(loader)
        with pytest.raises(ZephonError, match=r"already producing"):
            loader.feed(ListSink())
    assert [(step, digest) for step, digest, _ in sink.batches] == global_digests(spec, steps=6)
    assert [after.step for _, _, after in sink.batches] == [1, 2, 3, 4, 5, 6]
    assert sink.ended == []  # stopped by the sink: neither the end nor a failure
    # A state handed to the sink resumes where it says, with the same batches on.
    resumed = zf.encode_state(sink.batches[2][2])
    assert global_digests(spec, steps=3, state=resumed) == global_digests(spec, steps=6)[3:]


def test_the_end_of_a_finite_pass_is_handed_to_the_sink(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [f"web {i} x" for i in range(11)])
    spec = chain_spec(path, ("key", DocKey()), lanes=2, global_batch_size=4, epochs=1)
    sink = ListSink()
    with zf.Loader(spec) as loader:
        loader.feed(sink)
    assert [(step, digest) for step, digest, _ in sink.batches] == global_digests(spec, steps=100)
    assert len(sink.batches) == 3 and sink.ended == [None]


class FailAt(beam.DoFn):  # type: ignore[misc]
    def process(self, sample: dict[str, Any]) -> Any:
        if int(sample["doc"]) == 9:
            raise ValueError("document 9 is bad")
        yield sample


def test_a_failure_is_handed_to_the_sink_not_raised(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [f"web {i} x" for i in range(40)])
    spec = chain_spec(path, ("key", DocKey()), ("fail", FailAt()), lanes=1, global_batch_size=2)
    sink = ListSink()
    with zf.Loader(spec) as loader:
        loader.feed(sink)
    steps = [step for step, _, _ in sink.batches]  # as far as the chunks before document 9
    assert steps == list(range(len(steps))) and len(steps) <= 4
    (error,) = sink.ended
    assert error is not None and "document 9 is bad" in str(error) and "fail" in str(error)


def test_a_closed_loader_is_not_fed(corpus: Corpus) -> None:
    loader = zf.Loader(example_spec(corpus, lanes=2, global_batch_size=4))
    loader.close()
    with pytest.raises(ZephonError, match=r"this Loader is closed"):
        loader.feed(ListSink())
